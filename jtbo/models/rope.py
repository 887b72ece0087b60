"""Rotary position embedding (RoPE), NeoX layout (rotate the two halves of each head).

Head channel ``i < D/2`` pairs with channel ``i + D/2``; the pair is rotated by the angle
``position * theta^(-2i/D)``. Angles are computed in float32 from integer positions, so a token's
rotation depends only on its own position: rows can be split across micro-batches freely.
Linear RoPE scaling (Hugging Face ``rope_type: linear``) divides every angle by a factor.

DeepSeek's YaRN (``rope_type: yarn``, ``RopeScaling``) keeps the high frequencies (those that
turn more than ``beta_fast`` times over the pre-training context), divides the low ones (fewer
than ``beta_slow`` turns) by the factor, and blends linearly in between; the rotated values
are multiplied by an "attention factor" (``mscale`` ratio), and MLA's softmax scale by
``mscale(factor, mscale_all_dim)`` squared.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


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


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when factor <= 1)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequencies and magnitudes of one model (static; see the module docstring).

    Attributes:
      theta: RoPE base.
      factor: context extension factor (1: none).
      kind: "linear" or "yarn".
      original_max_position: YaRN: pre-training context length.
      beta_fast: YaRN: rotations above which frequencies are kept.
      beta_slow: YaRN: rotations below which frequencies are divided by ``factor``.
      mscale: YaRN: mscale of the rotated values (0: unset).
      mscale_all_dim: YaRN: mscale of the softmax scale (0: unset).
    """

    theta: float
    factor: float = 1.0
    kind: str = "linear"
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def inv_freq(self, dim: int) -> np.ndarray:
        """``[dim // 2]`` float32 inverse frequencies of a ``dim``-wide rotated head."""
        exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
        base = self.theta**exponent
        if self.factor == 1.0:
            return (1.0 / base).astype(np.float32)
        if self.kind == "linear":
            return (1.0 / (self.factor * base)).astype(np.float32)
        low, high = self._correction_range(dim)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
        inv = (1.0 / (self.factor * base)) * (1.0 - keep) + (1.0 / base) * keep
        return inv.astype(np.float32)

    def _correction_range(self, dim: int) -> tuple[float, float]:
        def dim_of(rotations):
            turns = self.original_max_position / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(self.theta))

        low = math.floor(dim_of(self.beta_fast))
        high = math.ceil(dim_of(self.beta_slow))
        return max(low, 0), min(high, dim - 1)

    @property
    def rotation_scale(self) -> float:
        """Factor on the rotated values (YaRN's attention factor; 1 otherwise)."""
        if self.kind != "yarn" or self.factor == 1.0:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """Factor on MLA's softmax scale: ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
        if self.kind != "yarn" or self.factor == 1.0 or not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


def apply_scaled_rope(x: jax.Array, positions: jax.Array, scaling: RopeScaling) -> jax.Array:
    """``apply_rope`` with ``scaling``'s frequencies and rotated-value factor.

    Args:
      x: ``[num_tokens, num_heads, dim]`` (NeoX half layout).
      positions: ``[num_tokens]`` integer positions.
      scaling: frequencies and magnitudes.

    Returns:
      ``[num_tokens, num_heads, dim]`` in ``x.dtype``.
    """
    inv_freq = jnp.asarray(scaling.inv_freq(x.shape[-1]))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = (jnp.cos(angles) * scaling.rotation_scale)[:, None, :]
    sin = (jnp.sin(angles) * scaling.rotation_scale)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
