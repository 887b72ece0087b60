"""The sampler's sort on the GPU: integer keys (``sampler.sort_descending``) against float keys.

``sampler.sample_rows`` sorts each row's probabilities in descending order, stably, with the
vocabulary ids as values. This probe times, in turns in one process, per ``(rows, vocab)``:

* ``int keys``: ``sampler.sort_descending`` (inverted bit patterns as ``uint32`` keys);
* ``float keys``: the same sort on the negated float32 probabilities (NumPy-order float
  comparator), the form the sampler had before;
* ``sample_rows``: the whole sampled pick (softmax, sort, nucleus, inverse CDF);
* ``greedy``: ``sample_rows(..., greedy_only=True)`` (the argmax), the floor of a step's pick.

It checks that both sorts give the same bits, and prints whether each compiled sort became
XLA's CUB radix sort (the ``__cub$DeviceRadixSort`` custom call) or stayed XLA's own sort.

Usage (GPU): ``PYTHONPATH=. python tools/sampler_sort_probe.py [--rows 8,64,256]
[--vocab 151936,129280,32000]``.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates
from jtbo.models import sampler

CUB_SORT = "__cub$DeviceRadixSort"


def float_key_sort(probs):
    """The sort on float keys: ``(-probs, vocab ids)``, stable; the same result as
    ``sampler.sort_descending``."""
    vocab_ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    negated, order = jax.lax.sort((-probs, vocab_ids), dimension=probs.ndim - 1, is_stable=True)
    return -negated, order


def _compiled(fn, *args):
    """``(fn`` compiled for ``args``, ``args)``: one compile, whose text ``_sort_kind`` reads."""
    return jax.jit(fn).lower(*args).compile(), args


def _sort_kind(compiled) -> str:
    """``cub`` or ``xla``: which sort the compiled program runs."""
    return "cub" if CUB_SORT in compiled.as_text() else "xla"


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
        "int keys": _compiled(sampler.sort_descending, probs),
        "float keys": _compiled(float_key_sort, probs),
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
    print("| rows | vocab | int keys (ms, sort) | float keys (ms, sort) | float / int | "
          "sample_rows (ms) | greedy (ms) | same bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for vocab in map(int, args.vocab.split(",")):
        for rows in map(int, args.rows.split(",")):
            cases = _cases(rows, vocab)
            labels = list(cases)
            seconds = device_rates.time_fns_interleaved(
                [cases[k] for k in labels], warmup=2, iters=10, reps=args.reps
            )
            ms = {k: s * 1e3 for k, s in zip(labels, seconds, strict=True)}
            int_out = jax.device_get(cases["int keys"][0](*cases["int keys"][1]))
            float_out = jax.device_get(cases["float keys"][0](*cases["float keys"][1]))
            same = all(
                np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
                for a, b in zip(int_out, float_out, strict=True)
            )
            kinds = {k: _sort_kind(cases[k][0]) for k in ("int keys", "float keys")}
            print(
                f"| {rows} | {vocab} | {ms['int keys']:.3f} {kinds['int keys']} | "
                f"{ms['float keys']:.3f} {kinds['float keys']} | "
                f"{ms['float keys'] / ms['int keys']:.2f} | {ms['sample_rows']:.3f} | "
                f"{ms['greedy']:.3f} | {same} |"
            )


if __name__ == "__main__":
    main()
