"""Static-capacity form of a batch for jit, and the token buckets that pick the capacity.

jit compiles per shape, so a step's arrays are zero-padded to a bucketed capacity and the real
sizes travel as data: ``num_token_non_padded`` (real token rows, traced under jit) and
zero-length padding sequences. A program compiled for a ``(token_capacity, seq_capacity)``
bucket then serves every step that fits it - the JAX counterpart of SGLang's CUDA-graph
capture at a padded batch size.

Padding rows: token fields are 0 (token id 0, position 0, KV slot 0: the attention layer must
mask rows past ``num_token_non_padded``); padding sequences have zero lengths, so
``extend_start_loc`` stays the exclusive prefix sum of ``extend_seq_lens``. A DECODE batch
holds one token per sequence and a TARGET_VERIFY batch ``draft_token_num`` per sequence even
when padded, so their two capacities must agree. Statics that vary per step at a fixed shape
(``tbo_padded_len``) are set to the capacity so the treedef does not change.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jtbo.split import batch as batch_lib


def default_token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Powers of two below ``max_tokens``, then ``max_tokens`` itself.

    Args:
      max_tokens: the largest token count a step may have, >= 1.

    Returns:
      Sorted capacities; every count in ``[1, max_tokens]`` has a bucket at most twice as big.

    Raises:
      ValueError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets = []
    size = 1
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    return (*buckets, max_tokens)


def token_bucket(num_tokens: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``num_tokens``.

    Args:
      num_tokens: rows to hold, >= 0.
      buckets: strictly increasing positive capacities.

    Returns:
      The first bucket ``>= num_tokens``.

    Raises:
      ValueError: unsorted / non-positive buckets, a negative count, or a count above the
        largest bucket.
    """
    if not buckets or any(b <= a for a, b in zip(buckets, buckets[1:], strict=False)):
        raise ValueError(f"buckets must be non-empty and strictly increasing, got {buckets}")
    if buckets[0] < 1:
        raise ValueError(f"buckets must be positive, got {buckets}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    for bucket in buckets:
        if bucket >= num_tokens:
            return int(bucket)
    raise ValueError(f"num_tokens={num_tokens} exceeds the largest bucket {buckets[-1]}")


def _pad_rows(value: Any, rows: int) -> Any:
    if value is None:
        return None
    value = np.asarray(value)
    out = np.zeros((rows, *value.shape[1:]), dtype=value.dtype)
    out[: value.shape[0]] = value
    return out


def _check_capacities(batch: batch_lib.ForwardBatch, token_capacity: int, seq_capacity: int):
    if token_capacity < batch.num_tokens:
        raise ValueError(f"token_capacity={token_capacity} < len(input_ids)={batch.num_tokens}")
    if seq_capacity < batch.batch_size:
        raise ValueError(f"seq_capacity={seq_capacity} < batch_size={batch.batch_size}")
    per_seq = 1 if batch.forward_mode.is_decode() else None
    if batch.forward_mode.is_target_verify():
        per_seq = batch.spec_info.draft_token_num
    if per_seq is not None and token_capacity != seq_capacity * per_seq:
        raise ValueError(
            f"{batch.forward_mode.name} needs token_capacity == seq_capacity * {per_seq}, got "
            f"{token_capacity} != {seq_capacity} * {per_seq}"
        )


def _pad_spec_info(spec, token_capacity: int, seq_capacity: int, mask_capacity: int | None):
    if spec is None:
        return None
    fields = {name: _pad_rows(getattr(spec, name), token_capacity)
              for name in batch_lib.SPEC_TOKEN_FIELDS}  # fmt: skip
    fields.update(
        {name: _pad_rows(getattr(spec, name), seq_capacity) for name in batch_lib.SPEC_SEQ_FIELDS}
    )
    mask = spec.custom_mask
    if mask is not None:
        # Padding sequences have seq_len 0, so each owns draft_token_num**2 mask entries.
        needed = int(batch_lib.custom_mask_offsets(fields["seq_lens"], spec.draft_token_num)[-1])
        if mask_capacity is None or mask_capacity < needed:
            raise ValueError(f"spec_info.custom_mask needs mask_capacity >= {needed} after "
                             f"padding, got {mask_capacity}")  # fmt: skip
        fields["custom_mask"] = _pad_rows(mask, mask_capacity)
    return dataclasses.replace(spec, **fields)


def pad_batch(
    batch: batch_lib.ForwardBatch,
    *,
    token_capacity: int,
    seq_capacity: int,
    mask_capacity: int | None = None,
) -> batch_lib.ForwardBatch:
    """The batch zero-padded to static capacities, real counts kept (module docstring).

    Args:
      batch: a host batch (a parent or a TBO child).
      token_capacity: token rows after padding (>= ``len(input_ids)``).
      seq_capacity: sequences after padding (>= ``batch_size``).
      mask_capacity: entries of a padded EAGLE custom mask (needed only when it is set).

    Returns:
      A new batch with ``batch_size == seq_capacity`` and ``token_capacity`` token rows,
      ``num_token_non_padded`` = the real tokens, and ``tbo_padded_len`` (when set) =
      ``token_capacity``; ``tbo_parent_token_range`` and ``tbo_split_seq_index`` are kept.

    Raises:
      ValueError: a capacity that is too small or that does not match the mode.
    """
    batch.validate()
    _check_capacities(batch, token_capacity, seq_capacity)
    fields = {name: _pad_rows(getattr(batch, name), token_capacity)
              for name in batch_lib.TOKEN_FIELDS}  # fmt: skip
    fields.update({name: _pad_rows(getattr(batch, name), seq_capacity)
                   for name in batch_lib.SEQ_FIELDS})  # fmt: skip
    if batch.extend_start_loc is not None:
        lens = fields["extend_seq_lens"]
        fields["extend_start_loc"] = (
            batch_lib.exclusive_cumsum(lens)
            if lens is not None
            else _pad_rows(batch.extend_start_loc, seq_capacity)
        )
    ragged = batch.forward_mode in batch_lib.RAGGED_EXTEND_MODES
    return dataclasses.replace(
        batch,
        **fields,
        batch_size=seq_capacity,
        extend_num_tokens=token_capacity if ragged else None,
        spec_info=_pad_spec_info(batch.spec_info, token_capacity, seq_capacity, mask_capacity),
        num_token_non_padded=batch.num_valid_tokens,
        tbo_padded_len=None if batch.tbo_padded_len is None else token_capacity,
    )
