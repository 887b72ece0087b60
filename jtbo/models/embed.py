"""Token embedding and LM head.

Both are replicated on every device (a gather by token id; a ``[H, V]`` projection of each
rank's own tokens), so neither needs communication.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jtbo.models import mlp


class Embedding(nnx.Module):
    """Token id -> hidden row, table ``[V, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, *, rngs: nnx.Rngs):
        """Args: vocab_size: V; hidden_size: H; rngs: parameter init keys."""
        table = jax.random.normal(rngs.params(), (vocab_size, hidden_size), jnp.float32)
        self.table = nnx.Param(table)  # [V, H]

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Returns ``[T, H]`` rows for ``input_ids [T]`` (ids must lie in ``[0, V)``)."""
        return jnp.take(self.table[...], input_ids, axis=0)


class LMHead(nnx.Module):
    """Hidden -> vocabulary logits, weight ``[H, V]``."""

    def __init__(self, hidden_size: int, vocab_size: int, *, rngs: nnx.Rngs):
        """Args: hidden_size: H; vocab_size: V; rngs: parameter init keys."""
        self.weight = mlp.init_matrix(rngs, (hidden_size, vocab_size), hidden_size)  # [H, V]

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Returns float32 logits ``[T, V]`` for ``hidden [T, H]``."""
        return jnp.dot(hidden, self.weight[...], preferred_element_type=jnp.float32)
