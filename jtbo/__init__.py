"""jtbo: two-batch overlap (TBO) and DP attention for MoE inference in JAX/XLA."""

__version__ = "0.1.0"
