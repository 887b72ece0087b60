"""The sampled pick on the GPU: ``sampler.sample_rows`` (a search over the probabilities' bit
patterns, no sort) against the sort-based pick it replaced, and the greedy pick.

Times, in turns in one process, per ``(rows, vocab)``:

* ``search pP``: ``sampler.sample_rows`` (softmax, the nucleus search, the drawn token's search,
  the tie order) with ``sampler.SEARCH_PIVOTS = P`` for each ``--pivots`` (the first is the
  shipped value's row unless given otherwise);
* ``sort``: ``sorted_pick``, the same definition through a keys-only sort of each row's
  probabilities (their inverted bit patterns as ``uint32`` keys, unstable: the sort XLA's GPU
  compiler runs as CUB's radix sort), cumulative sums in sorted order and the tie order;
* ``greedy``: ``sample_rows(..., greedy_only=True)`` (the argmax), the floor of a step's pick.

Both sampled picks draw the same tokens but where float32 rounding puts a cut or a target on a
boundary (their sums add the same probabilities in other orders): the table counts the rows
whose tokens differ. It also lists each compiled program's custom-call targets (a CUB sort
shows as a target naming CUB).

Usage (GPU): ``PYTHONPATH=. python tools/sampler_probe.py [--rows 8,64,256]
[--vocab 151936,129280,32000]``.
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates
from jtbo.models import sampler

_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _sort_descending(probs):
    """Each row's float32 probabilities in descending order, through a sort of their inverted
    bit patterns alone."""
    keys = jnp.invert(jax.lax.bitcast_convert_type(probs, jnp.uint32))
    sorted_keys = jax.lax.sort(keys, dimension=probs.ndim - 1, is_stable=False)
    return jax.lax.bitcast_convert_type(jnp.invert(sorted_keys), jnp.float32)


def _sorted_position(probs, top_p, uniforms):
    """The drawn position of the descending order: the nucleus from the exclusive cumulative
    sums, then the first kept token of nonzero probability past ``uniform * kept mass``."""
    ranked = _sort_descending(probs)
    inclusive = jnp.cumsum(ranked, axis=-1)
    keep = (inclusive - ranked < top_p[..., None]) | (jnp.arange(ranked.shape[-1]) == 0)
    kept_cumulative = jnp.cumsum(jnp.where(keep, ranked, 0.0), axis=-1)
    target = uniforms * kept_cumulative[..., -1]
    candidate = keep & (ranked > 0)
    below = jnp.sum(candidate & (kept_cumulative <= target[..., None]), axis=-1)
    last = jnp.maximum(jnp.sum(candidate, axis=-1) - 1, 0)
    return ranked, jnp.clip(below, 0, last).astype(jnp.int32)


def sorted_pick(logits, temperature, top_p, uniforms):
    """``sampler.sample_rows``' definition through a sort (the pick it replaced)."""
    logits = logits.astype(jnp.float32)
    greedy = temperature == 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[..., None]
    probs = jax.lax.optimization_barrier(jax.nn.softmax(scaled, axis=-1))
    ranked, position = _sorted_position(probs, top_p, uniforms)
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)
    chosen = jnp.take_along_axis(ranked, position[..., None], axis=-1)[..., 0]
    chosen_bits = jax.lax.bitcast_convert_type(chosen, jnp.int32)
    ahead = jnp.sum(bits > chosen_bits[..., None], axis=-1, dtype=jnp.int32)
    tied = bits == chosen_bits[..., None]
    is_token = tied & (jnp.cumsum(tied, axis=-1) == (position - ahead + 1)[..., None])
    sampled = jnp.argmax(is_token, axis=-1).astype(jnp.int32)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)


def custom_call_targets(compiled) -> list[str]:
    """The custom-call targets of a compiled program, each once, sorted."""
    return sorted(set(_TARGET.findall(compiled.as_text())))


def _search_with(pivots: int):
    """``sampler.sample_rows`` traced with ``SEARCH_PIVOTS = pivots``."""

    def pick(*args):
        shipped = sampler.SEARCH_PIVOTS
        sampler.SEARCH_PIVOTS = pivots
        try:
            return sampler.sample_rows(*args)
        finally:
            sampler.SEARCH_PIVOTS = shipped

    return pick


def _cases(rows: int, vocab: int, pivots: list[int]):
    """``{label: (compiled fn, args)}`` for one shape: temperature 0.7, top-p 0.9."""
    rng = np.random.default_rng(rows + vocab)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4, jnp.bfloat16).astype(jnp.float32)
    temperature = jnp.full((rows,), 0.7, jnp.float32)
    top_p = jnp.full((rows,), 0.9, jnp.float32)
    uniforms = sampler.sampling_uniforms(0, jnp.arange(rows), 0)
    pick = (logits, temperature, top_p, uniforms)
    fns = {f"search p{p}": _search_with(p) for p in pivots}
    fns |= {
        "sort": sorted_pick,
        "greedy": lambda *a: sampler.sample_rows(*a, greedy_only=True),
    }
    return {k: (jax.jit(fn).lower(*pick).compile(), pick) for k, fn in fns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,64,256")
    parser.add_argument("--vocab", default="151936,129280,32000")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--pivots", default=str(sampler.SEARCH_PIVOTS))
    args = parser.parse_args()
    pivots = [int(p) for p in args.pivots.split(",")]
    first = f"search p{pivots[0]}"
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}")
    searches = [f"search p{p}" for p in pivots]
    print(f"| rows | vocab | {' | '.join(f'{k} (ms)' for k in searches)} | sort (ms) | "
          f"sort / {first} | greedy (ms) | rows whose tokens differ from sort's |")  # fmt: skip
    print("|---" * (len(searches) + 6) + "|")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            cases = _cases(rows, vocab, pivots)
            labels = list(cases)
            seconds = device_rates.time_fns_interleaved(
                [cases[k] for k in labels], warmup=2, iters=10, reps=args.reps
            )
            ms = {k: s * 1e3 for k, s in zip(labels, seconds, strict=True)}
            tokens = {k: np.asarray(cases[k][0](*cases[k][1])) for k in [*searches, "sort"]}
            differ = ", ".join(str(int(np.sum(tokens[k] != tokens["sort"]))) for k in searches)
            for k in labels:  # before the table's row, which grep keeps ("^|")
                print(f"  {rows} x {vocab} {k}: custom calls {custom_call_targets(cases[k][0])}")
            cells = " | ".join(f"{ms[k]:.3f}" for k in searches)
            print(
                f"| {rows} | {vocab} | {cells} | {ms['sort']:.3f} | "
                f"{ms['sort'] / ms[first]:.2f} | {ms['greedy']:.3f} | {differ} |"
            )


if __name__ == "__main__":
    main()
