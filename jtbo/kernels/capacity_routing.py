"""Capacity slots of routed (token, choice) pairs, in one kernel.

The capacity-slot expert layout gives each of E experts C slots. Pair ``p`` (token-major order
over ``[T, k]`` choices) takes slot ``position[p]`` of its expert: the number of earlier pairs
routed to the same expert. A pair ranked at or past C is dropped, as is a pair whose expert id
lies outside ``[0, E)``. The layer needs three things from the ids: each pair's position, the
filled slots per expert (``counts``, at most C) and the token in each slot (-1 for an empty
one). XLA computes them as a dozen small kernels (a one-hot running count, a bincount, the
scatter into the slots, the selects between them); at decode sizes, a few hundred pairs, each
is a launch of about the same cost as the work, and together they take a tenth of the expert
layer's time.

Kernel (``impl="pallas"``, the Triton lowering; the Pallas interpreter on the CPU): one program
per chunk of ``block_pairs`` pairs. Each program walks every chunk's expert ids and sums the
chunk's ``[block_pairs, E]`` one-hot per expert, which gives the totals (``counts`` before the
clip) and the totals of the chunks before its own (each expert's first rank in its chunk).
Inside its chunk an exclusive running count of the one-hot down the pairs adds the ranks among
the chunk's earlier pairs. The program then writes its pairs' positions and their tokens into
the filled slots, and -1 into the empty slots of its share of the experts; filled and empty
slots are disjoint, so every slot is written once and no program waits for another. Program 0
writes ``counts``.

Each program reads all ``P`` ids, so the work grows as ``P**2 * E / block_pairs``: the kernel
is for decode sizes. ``impl=None`` takes it on a GPU up to ``KERNEL_MAX_PAIRS`` pairs and XLA
above. ``capacity_slots_reference`` is the plain jnp definition.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jtbo.core import arith
from jtbo.kernels import impls, slot_rows

KERNEL_MAX_PAIRS = 4096
"""The most pairs for which ``impl=None`` takes the kernel on a GPU (its work grows as the square
of the pairs; XLA's kernels grow linearly)."""
_ONE_HOT_ELEMS = 8192  # a chunk's [block_pairs, E] one-hot held in registers by 8 warps
_FILL_ELEMS = 4096  # a [experts, slots] tile of the empty-slot fill


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CapacitySlots:
    """Where the routed pairs go in the ``[E, C]`` capacity slots."""

    position: (
        jax.Array
    )  # [T, k] int32 rank of each pair within its expert (0 for an id outside [0, E))
    counts: jax.Array  # [E] int32 filled slots per expert, at most C
    slot_token: jax.Array  # [E, C] int32 token in each slot, -1 for an empty slot

    def valid(self, topk_ids: jax.Array) -> jax.Array:
        """``[T, k]`` whether each pair holds a slot: its id in ``[0, E)``, its rank below C."""
        num_experts, capacity = self.slot_token.shape
        return (topk_ids >= 0) & (topk_ids < num_experts) & (self.position < capacity)


def _routing_kernel(
    ids_ref, position_ref, counts_ref, token_ref, *, num_pairs, num_experts, capacity,
    pairs_per_token, block_pairs, experts_pad, experts_per_program, fill_slots,
):  # fmt: skip
    # ids_ref [P] int32 expert of each pair; position_ref [P] int32; counts_ref [E] int32;
    # token_ref [E * C] int32, the slots expert-major. A masked-off lane of a scattered store
    # points one past the slots: the interpreter drops it, the GPU never touches it.
    chunk = pl.program_id(0)
    experts = jnp.arange(experts_pad, dtype=jnp.int32)

    def chunk_ids(index):
        pair = index * block_pairs + jnp.arange(block_pairs, dtype=jnp.int32)
        inside = pair < num_pairs
        ids = plgpu.load(ids_ref.at[pl.ds(index * block_pairs, block_pairs)], mask=inside, other=-1)
        hot = (ids[:, None] == experts[None, :]) & (experts < num_experts)[None, :]
        return pair, inside, ids, hot.astype(jnp.int32)

    def count(index, carry):
        totals, before = carry
        per_expert = jnp.sum(chunk_ids(index)[3], axis=0)
        return totals + per_expert, before + jnp.where(index < chunk, per_expert, 0)

    zeros = jnp.zeros((experts_pad,), jnp.int32)
    num_chunks = arith.ceil_div(num_pairs, block_pairs)
    totals, before = jax.lax.fori_loop(0, num_chunks, count, (zeros, zeros))
    pair, inside, ids, hot = chunk_ids(chunk)
    earlier = jnp.cumsum(hot, axis=0) - hot + before[None, :]  # exclusive, per expert
    position = jnp.sum(hot * earlier, axis=1)
    plgpu.store(position_ref.at[pl.ds(chunk * block_pairs, block_pairs)], position, mask=inside)
    filled = inside & (ids >= 0) & (ids < num_experts) & (position < capacity)
    slot = jnp.where(filled, ids * capacity + position, num_experts * capacity)
    plgpu.store(token_ref.at[slot], pair // pairs_per_token, mask=filled)
    counts = jnp.minimum(totals, capacity)
    write_counts = (experts < num_experts) & (chunk == 0)
    count_slot = jnp.where(write_counts, experts, num_experts)
    plgpu.store(counts_ref.at[count_slot], counts, mask=write_counts)
    first_expert = chunk * experts_per_program
    _fill_empty_slots(
        token_ref, counts, first_expert, (experts_per_program, num_experts, capacity), fill_slots
    )


def _fill_empty_slots(token_ref, counts, first_expert, sizes, fill_slots: int) -> None:
    """-1 into the slots at or past ``counts[e]`` of the experts ``[first_expert, first_expert +
    num_local)``; ``sizes = (num_local, E, C)``, ``counts [E padded]`` in registers."""
    num_local, num_experts, capacity = sizes
    local_pad = arith.power_of_two_at_least(num_local)
    expert = first_expert + jnp.arange(local_pad, dtype=jnp.int32)
    # counts[expert] through a one-hot: a register vector takes no traced index.
    pick = expert[:, None] == jnp.arange(counts.shape[0], dtype=jnp.int32)[None, :]
    filled = jnp.sum(jnp.where(pick, counts[None, :], 0), axis=1)
    mine = (expert < first_expert + num_local) & (expert < num_experts)
    empty = jnp.full((local_pad, fill_slots), -1, jnp.int32)

    def fill(index, carry):
        position = index * fill_slots + jnp.arange(fill_slots, dtype=jnp.int32)[None, :]
        to_fill = mine[:, None] & (position >= filled[:, None]) & (position < capacity)
        slot = jnp.where(to_fill, expert[:, None] * capacity + position, num_experts * capacity)
        plgpu.store(token_ref.at[slot], empty, mask=to_fill)
        return carry

    jax.lax.fori_loop(0, arith.ceil_div(capacity, fill_slots), fill, 0)


def capacity_slots_pallas(topk_ids, num_experts: int, capacity: int, interpret: bool):
    """Pallas impl (arguments as ``capacity_slots``)."""
    num_tokens, pairs_per_token = topk_ids.shape
    num_pairs = num_tokens * pairs_per_token
    experts_pad = arith.power_of_two_at_least(num_experts)
    block_pairs = max(16, min(128, _ONE_HOT_ELEMS // experts_pad))
    block_pairs = min(block_pairs, arith.power_of_two_at_least(num_pairs, 16))
    num_programs = arith.ceil_div(num_pairs, block_pairs)
    experts_per_program = arith.ceil_div(num_experts, num_programs)
    local_pad = arith.power_of_two_at_least(experts_per_program)
    fill_slots = min(arith.power_of_two_at_least(capacity), max(16, _FILL_ELEMS // local_pad))
    kernel = functools.partial(
        _routing_kernel, num_pairs=num_pairs, num_experts=num_experts, capacity=capacity,
        pairs_per_token=pairs_per_token, block_pairs=block_pairs, experts_pad=experts_pad,
        experts_per_program=experts_per_program, fill_slots=fill_slots,
    )  # fmt: skip
    i32 = jnp.int32
    position, counts, token = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_pairs,), i32),
            jax.ShapeDtypeStruct((num_experts,), i32),
            jax.ShapeDtypeStruct((num_experts * capacity,), i32),
        ),
        grid=(num_programs,),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
    )(topk_ids.reshape(-1).astype(i32))
    return CapacitySlots(
        position.reshape(topk_ids.shape), counts, token.reshape(num_experts, capacity)
    )


def capacity_slots(
    topk_ids: jax.Array, num_experts: int, capacity: int, *, impl: str | None = None
) -> CapacitySlots:
    """Each routed pair's capacity slot, the filled slots per expert and each slot's token.

    Args:
      topk_ids: ``[T, k]`` integer expert of each (token, choice) pair; an id outside
        ``[0, E)`` (e.g. -1 for padding) takes no slot.
      num_experts: E.
      capacity: C, the slots per expert (>= 0); a pair ranked at or past C takes none.
      impl: ``"pallas"`` (the kernel; the interpreter on the CPU), ``"xla"``
        (``capacity_slots_reference``), or None: the kernel on a GPU up to
        ``KERNEL_MAX_PAIRS`` pairs, else XLA.

    Returns:
      ``CapacitySlots``: positions ``[T, k]``, counts ``[E]``, tokens ``[E, C]``.

    Raises:
      ValueError: a bad shape, dtype, expert count or capacity, or an unknown impl.
      KernelUnavailableError: the impl cannot run here (``"triton"`` has no kernel).
    """
    if topk_ids.ndim != 2 or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be [T, k] integers, got {topk_ids.shape} {topk_ids.dtype}")
    if num_experts < 1 or capacity < 0:
        raise ValueError(
            f"num_experts must be >= 1 and capacity >= 0, got {num_experts}, {capacity}"
        )
    if impl is None and topk_ids.size > KERNEL_MAX_PAIRS:
        impl = "xla"
    impl = impls.resolve(impl, op="capacity_slots")
    if impl == "triton":
        raise impls.KernelUnavailableError("capacity_slots has no impl='triton'; use 'pallas'")
    if impl == "xla" or topk_ids.size == 0 or capacity == 0:
        return capacity_slots_reference(topk_ids, num_experts, capacity)
    return capacity_slots_pallas(topk_ids, num_experts, capacity, impls.backend() == "cpu")


def capacity_slots_reference(topk_ids, num_experts: int, capacity: int) -> CapacitySlots:
    """The plain jnp definition: a one-hot running count per expert, its column sums, and the
    pairs inverted into their slots (``slot_rows.invert_slots``)."""
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    hot = (ids[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    earlier = jnp.cumsum(hot, axis=0, dtype=jnp.int32) - hot
    position = jnp.sum(hot * earlier, axis=1)
    counts = jnp.minimum(jnp.sum(hot, axis=0), capacity).astype(jnp.int32)
    filled = (ids >= 0) & (ids < num_experts) & (position < capacity)
    slot = jnp.where(filled, ids * capacity + position, -1).astype(jnp.int32)
    pair = slot_rows.invert_slots(slot, num_experts * capacity)
    token = jnp.where(pair >= 0, pair // topk_ids.shape[1], -1)
    return CapacitySlots(
        position.reshape(topk_ids.shape), counts, token.reshape(num_experts, capacity)
    )
