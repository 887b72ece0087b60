"""Probe: the FP8 expert layer at DeepSeek-V3's expert shape with E experts, 64 tokens; prints
its relative error against the float32 reference, or the error the call raised.

``PYTHONPATH=. python tools/dsv3_fp8_probe.py E IMPL [unguarded]``: ``unguarded`` turns off
``grouped_gemm.triton_offsets_fit``, to see what the Pallas kernels do past it (run each case
in its own process: an illegal address ends the process's GPU context).
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.bench import grouped_gemm as bg
from jtbo.kernels import grouped_gemm
from jtbo.models import experts

num_experts, impl = int(sys.argv[1]), sys.argv[2]
if len(sys.argv) > 3:
    grouped_gemm.triton_offsets_fit = lambda size, itemsize: True
shapes = bg.Shapes(7168, 2048, num_experts, 8)
tokens = 64
ids_np, routing_np = bg.route(tokens, shapes, 0.0, 3)
ids_np[:, 0] = num_experts - 1 - np.arange(tokens) % 8  # the last experts are used
x, weights = bg.make_inputs(tokens, shapes, jnp.bfloat16, jax.random.key(0), "float8_e4m3fn")
ids, routing = jnp.asarray(ids_np), jnp.asarray(routing_np)
layer = jax.jit(functools.partial(experts.experts_capacity, impl=impl))
try:
    out = np.asarray(layer(x, ids, routing, weights))
except Exception as e:  # noqa: BLE001
    print(f"E={num_experts} impl={impl}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    sys.exit(1)
rows = np.arange(0, tokens, 4)
ref = bg.reference(x, ids, routing, weights, rows, (128, 128))
print(f"E={num_experts} impl={impl}: rel err {bg.rel_error(out[rows], ref):.2e}")
