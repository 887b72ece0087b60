"""The sampler's sort on the GPU: its keys-only sort (``sampler.sort_descending``) against the
key-value sorts it replaced.

``sampler.sample_rows`` sorts each row's probabilities in descending order. This probe times,
in turns in one process, per ``(rows, vocab)``:

* ``keys``: ``sampler.sort_descending`` (inverted bit patterns as ``uint32`` keys, alone,
  unstable: the sort XLA's GPU compiler can run as CUB's radix sort);
* ``int pairs``: the stable sort of those keys with the vocabulary ids as values (the form the
  sampler had before; XLA's ``StableSortExpander`` puts the ids into its comparator);
* ``float pairs``: the stable sort of the negated float32 probabilities with the ids (NumPy-order
  float comparator), the form before that;
* ``sample_rows``: the whole sampled pick (softmax, sort, nucleus, inverse CDF, tie order);
* ``greedy``: ``sample_rows(..., greedy_only=True)`` (the argmax), the floor of a step's pick.

It checks that the three sorts give the same sorted bits, and prints whether each compiled sort
became a CUB radix sort (a custom call whose target names CUB: ``__cub$DeviceRadixSort`` in
older XLA, FFI targets for keys and for pairs in newer ones) or stayed XLA's own, and the
custom-call targets each compiled program holds.

Usage (GPU): ``PYTHONPATH=. python tools/sampler_sort_probe.py [--rows 8,64,256]
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


def _pair_sort(keys, probs):
    """A stable key-value sort of ``keys`` with the vocabulary ids: ``(sorted keys, ids)``."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    return jax.lax.sort((keys, vocab_ids), dimension=probs.ndim - 1, is_stable=True)


def int_pair_sort(probs):
    """The sampler's sort before: inverted bit patterns and ids, stable; sorted probabilities."""
    keys = jnp.invert(jax.lax.bitcast_convert_type(probs, jnp.uint32))
    sorted_keys, _ = _pair_sort(keys, probs)
    return jax.lax.bitcast_convert_type(jnp.invert(sorted_keys), jnp.float32)


def float_pair_sort(probs):
    """The form before that: ``(-probs, ids)`` stable; sorted probabilities."""
    negated, _ = _pair_sort(-probs, probs)
    return -negated


def _compiled(fn, *args):
    """``(fn`` compiled for ``args``, ``args)``: one compile, whose text ``_sort_kind`` reads."""
    return jax.jit(fn).lower(*args).compile(), args


def custom_call_targets(compiled) -> list[str]:
    """The custom-call targets of a compiled program, each once, sorted."""
    return sorted(set(_TARGET.findall(compiled.as_text())))


def _sort_kind(compiled) -> str:
    """``cub`` or ``xla``: which sort the compiled program runs (a custom call naming CUB)."""
    return "cub" if any("cub" in t.lower() for t in custom_call_targets(compiled)) else "xla"


def _cases(rows: int, vocab: int):
    """``{label: (compiled fn, args)}`` for one shape."""
    rng = np.random.default_rng(rows + vocab)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 4, jnp.bfloat16).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    temperature = jnp.full((rows,), 0.7, jnp.float32)
    top_p = jnp.full((rows,), 0.9, jnp.float32)
    uniforms = sampler.sampling_uniforms(0, jnp.arange(rows), 0)
    pick = (logits, temperature, top_p, uniforms)
    return {
        "keys": _compiled(sampler.sort_descending, probs),
        "int pairs": _compiled(int_pair_sort, probs),
        "float pairs": _compiled(float_pair_sort, probs),
        "sample_rows": _compiled(sampler.sample_rows, *pick),
        "greedy": _compiled(lambda *a: sampler.sample_rows(*a, greedy_only=True), *pick),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,64,256")
    parser.add_argument("--vocab", default="151936,129280,32000")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print(f"device {jax.devices()[0].device_kind}  jax {jax.__version__}")
    print("| rows | vocab | keys (ms, sort) | int pairs (ms, sort) | float pairs (ms, sort) | "
          "int pairs / keys | sample_rows (ms) | greedy (ms) | same bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    sorts = ("keys", "int pairs", "float pairs")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            cases = _cases(rows, vocab)
            labels = list(cases)
            seconds = device_rates.time_fns_interleaved(
                [cases[k] for k in labels], warmup=2, iters=10, reps=args.reps
            )
            ms = {k: s * 1e3 for k, s in zip(labels, seconds, strict=True)}
            outs = [np.asarray(jax.device_get(cases[k][0](*cases[k][1]))) for k in sorts]
            same = all(np.array_equal(outs[0].view(np.uint32), o.view(np.uint32)) for o in outs)
            cells = " | ".join(f"{ms[k]:.3f} {_sort_kind(cases[k][0])}" for k in sorts)
            for k in labels:  # before the table's row, which grep keeps ("^|")
                print(f"  {rows} x {vocab} {k}: custom calls {custom_call_targets(cases[k][0])}")
            print(
                f"| {rows} | {vocab} | {cells} | {ms['int pairs'] / ms['keys']:.2f} | "
                f"{ms['sample_rows']:.3f} | {ms['greedy']:.3f} | {same} |"
            )


if __name__ == "__main__":
    main()
