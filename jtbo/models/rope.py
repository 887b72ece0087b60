"""Rotary position embedding (RoPE), NeoX layout (rotate the two halves of each head).

Head channel ``i < D/2`` pairs with channel ``i + D/2``; the pair is rotated by the angle
``position * theta^(-2i/D)``. Angles are computed in float32 from integer positions, so a token's
rotation depends only on its own position: rows can be split across micro-batches freely.
Linear RoPE scaling (Hugging Face ``rope_type: linear``) divides every angle by a factor.
"""

import jax
import jax.numpy as jnp


def rope_cos_sin(
    positions: jax.Array, head_dim: int, theta: float, scaling_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Returns ``cos, sin``, each ``[num_tokens, head_dim // 2]`` float32, for ``positions``."""
    exponent = jnp.arange(0, head_dim // 2, dtype=jnp.float32) * (2.0 / head_dim)
    inv_freq = 1.0 / (theta**exponent)  # [head_dim // 2]
    if scaling_factor != 1.0:
        inv_freq = inv_freq / scaling_factor
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: jax.Array, positions: jax.Array, theta: float, scaling_factor: float = 1.0
) -> jax.Array:
    """Rotates each head of ``x`` by its token's position.

    Args:
      x: ``[num_tokens, num_heads, head_dim]`` queries or keys.
      positions: ``[num_tokens]`` integer positions.
      theta: RoPE base.
      scaling_factor: linear scaling (angles divided by it; 1: none).

    Returns:
      ``[num_tokens, num_heads, head_dim]`` in ``x.dtype``.
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta, scaling_factor)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
