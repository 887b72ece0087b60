"""Expert-parallel MoE exchange inside ``jax.shard_map``: capacity slots + dense all-to-all.

Experts are sharded over every device of the TP group (``E_local = E / D`` experts each, in
device order, so expert ``e`` lives on device ``e // E_local``). Each device routes its own rows:

1. ``pack``: every (row, choice) pair takes slot ``(expert, position)`` of a send buffer
   ``[E, capacity, H]`` (``position`` counts earlier pairs of this device for that expert; see
   ``experts.slot_positions``); viewed as ``[D, E_local, capacity, H]`` it is ordered by the
   owning device.
2. ``exchange``: one tiled ``lax.all_to_all`` over the TP group sends block ``d`` to device
   ``d``; the receiver holds ``[D_source, E_local, capacity, H]``.
3. ``run_local_experts``: one batched matmul per local expert over all sources' slots.
4. ``exchange`` again (the reverse permutation is the same all-to-all) and ``unpack``: each
   pair reads its slot back and the row sums its pairs times the routing weights.

``capacity = rows`` can never drop a pair (a row picks an expert at most once). A smaller
capacity is allowed for memory; pairs past it are counted in ``overflow`` so the host can
refuse the result rather than return silently wrong numbers. The all-to-all is the dense,
fixed-size one: XLA runs it asynchronously on GPU and overlaps it (DESIGN.md Facts).
"""

import jax
import jax.numpy as jnp

from jtbo.models import experts


def pack(
    x: jax.Array, topk_ids: jax.Array, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Places every routed pair in its expert slot.

    Args:
      x: ``[R, H]`` this device's rows.
      topk_ids: ``[R, k]`` chosen experts; -1 marks a padding row's pairs (no slot).
      num_experts: E.
      capacity: slots per expert in the send buffer.

    Returns:
      ``(send [E, capacity, H], expert [R, k], position [R, k], overflow [] int32)`` where
      ``expert`` is E for pairs without a slot.
    """
    position = experts.slot_positions(topk_ids, num_experts)
    routed = (topk_ids >= 0) & (topk_ids < num_experts)
    kept = routed & (position < capacity)
    overflow = jnp.sum(routed & ~kept).astype(jnp.int32)
    expert = jnp.where(kept, topk_ids, num_experts)
    token = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None], topk_ids.shape)
    send = jnp.zeros((num_experts, capacity, x.shape[1]), x.dtype)
    send = send.at[expert, position].set(x[token], mode="drop")
    return send, expert, position, overflow


def exchange(buffer: jax.Array, axis_name, num_devices: int) -> jax.Array:
    """All-to-all of ``[E, C, H]`` blocks: block ``d`` (of ``E / D`` experts) goes to device ``d``.

    Args:
      buffer: ``[E, C, H]`` slots ordered by owning device.
      axis_name: the mesh axes spanning the expert-parallel group.
      num_devices: D, the group size.

    Returns:
      ``[E, C, H]``: block ``d`` now holds what device ``d`` sent here.
    """
    if num_devices == 1:
        return buffer
    return jax.lax.all_to_all(buffer, axis_name, split_axis=0, concat_axis=0, tiled=True)


def run_local_experts(
    received: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array], num_devices: int
) -> jax.Array:
    """Applies the local experts to every source's slots.

    Args:
      received: ``[D * E_local, C, H]`` slots from every source, source-major.
      weights: local expert weights ``([E_local, H, F], [E_local, H, F], [E_local, F, H])``.
      num_devices: D.

    Returns:
      ``[D * E_local, C, H]`` expert outputs in the same layout.
    """
    e_local = weights[0].shape[0]
    _, capacity, hidden = received.shape
    per_expert = received.reshape(num_devices, e_local, capacity, hidden).transpose(1, 0, 2, 3)
    out = experts.experts_ffn_slots(per_expert.reshape(e_local, -1, hidden), *weights)
    out = out.reshape(e_local, num_devices, capacity, hidden).transpose(1, 0, 2, 3)
    return out.reshape(received.shape)


def unpack(
    returned: jax.Array, expert: jax.Array, position: jax.Array, topk_weights: jax.Array
) -> jax.Array:
    """Sums each row's expert outputs times its routing weights.

    Args:
      returned: ``[E, C, H]`` outputs back in this device's send layout.
      expert: ``[R, k]`` slot expert of each pair (E: no slot, contributes nothing).
      position: ``[R, k]`` slot position of each pair.
      topk_weights: ``[R, k]`` routing weights.

    Returns:
      ``[R, H]`` in ``returned.dtype``.
    """
    num_experts = returned.shape[0]
    gathered = returned.at[expert, position].get(mode="fill", fill_value=0)  # [R, k, H]
    scale = jnp.where(expert < num_experts, topk_weights, 0.0).astype(jnp.float32)
    out = jnp.einsum("rkh,rk->rh", gathered.astype(jnp.float32), scale)
    return out.astype(returned.dtype)
