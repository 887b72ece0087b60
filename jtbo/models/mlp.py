"""SwiGLU MLP: ``down(silu(x @ gate) * (x @ up))``; used by dense layers and shared experts.

The hidden width may be sharded (tensor parallel): each shard then returns a partial sum that
the caller reduces, which is why ``swiglu`` takes the weights as arguments.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU feed-forward.

    Args:
      x: ``[T, H]`` activations.
      w_gate: ``[H, F]``; w_up: ``[H, F]``; w_down: ``[F, H]``.

    Returns:
      ``[T, H]`` in ``x.dtype`` (a partial sum when ``F`` is a shard of the hidden width).
    """
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.dot(hidden, w_down, preferred_element_type=jnp.float32).astype(x.dtype)


def init_matrix(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> nnx.Param:
    """A ``Param`` of normal values scaled by ``fan_in ** -0.5`` (keeps activations O(1))."""
    return nnx.Param(fan_in**-0.5 * jax.random.normal(rngs.params(), shape, jnp.float32))


class MLP(nnx.Module):
    """SwiGLU MLP with weights ``gate [H, F]``, ``up [H, F]``, ``down [F, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs):
        """Args: hidden_size: H; intermediate_size: F; rngs: parameter init keys."""
        self.w_gate = init_matrix(rngs, (hidden_size, intermediate_size), hidden_size)  # [H, F]
        self.w_up = init_matrix(rngs, (hidden_size, intermediate_size), hidden_size)  # [H, F]
        self.w_down = init_matrix(rngs, (intermediate_size, hidden_size), intermediate_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies ``swiglu`` with this module's (possibly sharded) weights."""
        return swiglu(x, self.w_gate[...], self.w_up[...], self.w_down[...])
