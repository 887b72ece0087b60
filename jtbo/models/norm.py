"""RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and cast back.

Float32 accumulation keeps bf16 models stable; the result takes the input's dtype so that the
residual stream keeps one dtype through the layer loop.
"""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalises the last axis of ``x`` by its root mean square and scales by ``weight``.

    Args:
      x: ``[..., dim]`` activations.
      weight: ``[dim]`` learned scale.
      eps: added to the mean square before the square root.

    Returns:
      ``[..., dim]`` in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale (initialised near 1 so tests see its effect)."""

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs):
        """Args: dim: normalised width; eps: see ``rms_norm``; rngs: parameter init keys."""
        noise = 0.1 * jax.random.normal(rngs.params(), (dim,), jnp.float32)
        self.weight = nnx.Param(1.0 + noise)  # [dim]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Applies ``rms_norm`` with this module's weight."""
        return rms_norm(x, self.weight[...], self.eps)
