"""Probe: ``experts_capacity`` (the model's path, capacity = T) with the blocked group ranks
(``rows.group_ranks``) against the same layer with the one-hot running count and ``bincount``
they replaced, timed in turns, at Qwen3-30B-A3B's expert shape, bf16 and FP8 experts; prints
a markdown table last.

``PYTHONPATH=. python tools/layer_ranks_probe.py`` (a GPU)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import device_rates, kernel_time, trace_calls
from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import slot_rows
from jtbo.models import experts


def _old_rank(group, num_groups):
    one_hot = group[:, None] == jnp.arange(num_groups, dtype=group.dtype)[None, :]
    earlier = jnp.cumsum(one_hot, axis=0, dtype=jnp.int32) - one_hot
    return jnp.sum(jnp.where(one_hot, earlier, 0), axis=1)


def old_layer(x, topk_ids, topk_weights, weights, *, impl, fp8_activations=True):
    num_experts = weights[0].shape[0]
    capacity = x.shape[0]
    position = _old_rank(topk_ids.reshape(-1), num_experts).reshape(topk_ids.shape)
    valid = (topk_ids >= 0) & (topk_ids < num_experts) & (position < capacity)
    expert = jnp.where(valid, topk_ids, num_experts)
    slots = slot_rows.SlotRows(x, experts._slot_tokens(expert, position, num_experts, capacity))
    counts = jnp.bincount(expert.reshape(-1), length=num_experts + 1)[:num_experts]
    max_rows = min(num_experts * capacity, topk_ids.size)
    out_slots = experts.experts_ffn_slots(
        slots,
        counts.astype(jnp.int32),
        weights,
        impl=impl,
        max_rows=max_rows,
        zero_padding=False,
        fp8_activations=fp8_activations,
    )
    gathered = slot_rows.take_slots(out_slots, expert, position)
    scale = jnp.where(valid, topk_weights, 0.0).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", gathered.astype(jnp.float32), scale).astype(x.dtype)


def main():
    shapes = bg.Shapes(2048, 768, 128, 8)
    rows = []
    for dtype in (None, "float8_e4m3fn"):
        for tokens, impl in ((64, "pallas"), (256, "pallas"), (4096, "mosaic"), (16384, "mosaic")):
            ids_np, routing_np = bg.route(tokens, shapes, 0.0, tokens)
            x, weights = bg.make_inputs(tokens, shapes, jnp.bfloat16, jax.random.key(tokens), dtype)
            ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
            new = bg.jit_as_step(functools.partial(experts.experts_capacity, impl=impl))
            old = bg.jit_as_step(functools.partial(old_layer, impl=impl))
            args = (x, ids, routing, weights)
            a, b = np.asarray(new(*args), np.float32), np.asarray(old(*args), np.float32)
            same = np.array_equal(a, b)
            t = device_rates.time_fns_interleaved(
                [(old, args), (new, args)], warmup=2, iters=25 if tokens < 1000 else 10, reps=7
            )
            gb = shapes.weight_bytes(len(np.unique(ids_np)), 1 if dtype else 2) / 1e9
            line = (
                f"| {dtype or 'bfloat16'} | {tokens} | {impl} "
                f"| {t[0] * 1e3:.3f} | {t[1] * 1e3:.3f} "
                f"| {t[0] / t[1]:.3f} | {gb:.3f} | {same} |"
            )
            rows.append(line)
            print(line, flush=True)
            for name, f in (("old", old), ("new", new)):
                ks = trace_calls.trace_kernels(functools.partial(f, *args), 10)
                print(f"  {name}: {kernel_time.kernels_per_call(ks, 10, top=6)}", flush=True)
    print("| experts | tokens | impl | old ms | new ms | old / new | weight GB | bit-equal |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
