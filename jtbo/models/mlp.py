"""SwiGLU MLP: ``down(silu(x @ gate) * (x @ up))``; used by dense layers and shared experts.

Gate and up are one fused weight ``w_gate_up [H, 2, F]`` (SGLang's ``gate_up_proj``), so a call
runs one matmul per weight. With two weights XLA's dot merger joins a micro-batch's gate and up
matmuls (they share the activations) instead of micro-batch A's and B's (they share the
weight), and each micro-batch then reads the weight on its own; in prefill XLA concatenated
the two weights at run time every step (docs/benchmarks/, "TBO step cost on one H200", fused
weights and one CUDA graph per step, "GPU time").

The hidden width may be sharded (tensor parallel, the ``F`` axis): each shard then returns a
partial sum that the caller reduces, which is why ``swiglu`` takes the weights as arguments.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward.

    Args:
      x: ``[T, H]`` activations.
      w_gate_up: ``[H, 2, F]`` (gate at index 0, up at 1); w_down: ``[F, H]``.

    Returns:
      ``[T, H]`` in ``x.dtype`` (a partial sum when ``F`` is a shard of the hidden width).
    """
    gate_up = jnp.einsum("th,hcf->tcf", x, w_gate_up, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]).astype(x.dtype)
    # In x's dtype: the GPU's dot accumulates in float32 and rounds once either way, and a
    # float32 result would cost a separate convert wherever XLA picks cuBLAS.
    return jnp.dot(hidden, w_down, preferred_element_type=x.dtype)


def init_matrix(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> nnx.Param:
    """A ``Param`` of normal values scaled by ``fan_in ** -0.5`` (keeps activations O(1))."""
    return nnx.Param(fan_in**-0.5 * jax.random.normal(rngs.params(), shape, jnp.float32))


class MLP(nnx.Module):
    """SwiGLU MLP with weights ``gate_up [H, 2, F]`` and ``down [F, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs):
        """Args: hidden_size: H; intermediate_size: F; rngs: parameter init keys."""
        shape = (hidden_size, 2, intermediate_size)
        self.w_gate_up = init_matrix(rngs, shape, hidden_size)  # [H, 2, F]
        self.w_down = init_matrix(rngs, (intermediate_size, hidden_size), intermediate_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies ``swiglu`` with this module's (possibly sharded) weights."""
        return swiglu(x, self.w_gate_up[...], self.w_down[...])
