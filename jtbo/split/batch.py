"""Batch pytrees: ``ForwardBatch`` (one DP rank's step) and ``SpecVerifyInput`` (EAGLE verify).

Both are frozen dataclasses registered with ``jax.tree_util.register_dataclass``, so they pass
through ``jit`` / ``shard_map`` as pytrees. The split between *static* fields (part of the
treedef) and *data* fields (leaves) follows one rule: a static field selects a compiled program
(the forward mode, a shape such as ``batch_size`` or ``tbo_padded_len``, the DP padding mode);
anything that changes from step to step at a fixed shape is data, so that one compile serves
many steps. Per-step scalars (``tbo_split_seq_index``, ``num_token_non_padded``, the parent
token range) are therefore data: plain Python ints on the host, traced int32 scalars under jit.

On the host the array fields hold numpy arrays (lists are converted on construction). A host
batch (every leaf a numpy array or an int) is checked when it is built: every inconsistency is
a ``ValueError`` that names the field and the numbers, so a bad batch can never be split
silently wrong. Under jit (leaves are tracers or jax arrays) nothing is checked or derived; the
treedef already carries what host construction derived.

Token counts: ``len(input_ids)`` is the number of token rows (a static capacity once padded);
``num_token_non_padded`` (None = all rows are real) is how many of them are real tokens. Padded
sequences have zero lengths.
"""

import copy
import dataclasses
from typing import Any

import jax
import numpy as np

from jtbo.split import forward_mode as forward_mode_lib

ForwardMode = forward_mode_lib.ForwardMode
ArrayLike = Any  # np.ndarray on the host, jax.Array / tracer under jit

# Fields whose leading axis is the token axis, and fields with one row per sequence.
TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")
SEQ_FIELDS = ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens")
SEQ_DERIVED_FIELDS = ("extend_start_loc",)
LENGTH_FIELDS = ("seq_lens", "extend_seq_lens", "extend_prefix_lens")
SPEC_TOKEN_FIELDS = ("draft_token", "positions")
SPEC_SEQ_FIELDS = (
    "retrieve_index",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "retrieve_cum_len",
    "seq_lens",
)
# Modes whose tokens are ragged prefill chunks described by ``extend_seq_lens``.
RAGGED_EXTEND_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND)


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata=dict(static=True), **kwargs)


def _as_host_array(value: Any, dtype: Any) -> Any:
    """Lists/tuples become numpy arrays; anything else (numpy, jax, tracers, None) is kept.

    A list of non-integers (floats, NaN) keeps its own dtype, so that ``validate`` names the
    field instead of numpy failing (or truncating) in the cast.
    """
    if isinstance(value, list | tuple):
        array = np.asarray(value)
        if array.size and array.dtype.kind not in "biu":
            return array
        return array.astype(dtype)
    return value


def _check_dtypes(owner: str, fields: tuple[str, ...], obj: Any, kinds: str = "iu") -> None:
    """Host arrays of index / length fields must be integers (``kinds``: numpy dtype kinds)."""
    for name in fields:
        value = getattr(obj, name)
        if not isinstance(value, np.ndarray) or value.dtype.kind in kinds or value.size == 0:
            continue  # an empty array holds no wrong value (np.zeros(0) is float64)
        detail = ""
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            bad = int(np.flatnonzero(~np.isfinite(value.reshape(-1)))[0])
            detail = f"; non-finite value {value.reshape(-1)[bad]} at index {bad}"
        raise ValueError(
            f"{owner}.{name} has dtype {value.dtype}, expected "
            f"{'bool or ' if 'b' in kinds else ''}integers{detail}"
        )


def _rows(name: str, value: Any) -> int:
    shape = value.shape if hasattr(value, "shape") else np.shape(value)
    if not shape:
        raise ValueError(f"{name} must have a leading axis, got a scalar")
    return int(shape[0])


def _check_rows(owner: str, fields: tuple[str, ...], obj: Any, expected: int, what: str) -> None:
    for name in fields:
        value = getattr(obj, name)
        if value is not None and _rows(name, value) != expected:
            raise ValueError(
                f"{owner}.{name} has {_rows(name, value)} rows, expected {expected} ({what})"
            )


def _check_non_negative(owner: str, fields: tuple[str, ...], obj: Any) -> None:
    for name in fields:
        value = getattr(obj, name)
        if value is None:
            continue
        value = np.asarray(value)
        if value.size and (low := int(value.min())) < 0:
            raise ValueError(f"{owner}.{name} has a negative length: min {low}")


def custom_mask_offsets(seq_lens: np.ndarray, draft_token_num: int) -> np.ndarray:
    """Start offset of every sequence's block in a flat EAGLE custom mask, plus the total.

    Sequence ``i`` owns ``(seq_lens[i] + draft_token_num) * draft_token_num`` mask entries
    (each draft token sees the prefix and the draft tree).

    Args:
      seq_lens: [batch_size] prefix lengths of the verified sequences.
      draft_token_num: draft tokens per sequence.

    Returns:
      [batch_size + 1] int64 exclusive prefix sums; the last entry is the mask length.
    """
    sizes = (np.asarray(seq_lens, dtype=np.int64) + draft_token_num) * draft_token_num
    offsets = np.zeros(sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecVerifyInput:
    """EAGLE target-verify input (SGLang ``EagleVerifyInput``), split with its batch.

    Attributes:
      draft_token: [num_tokens] draft token ids, ``draft_token_num`` per sequence.
      positions: [num_tokens] positions of the draft tokens.
      custom_mask: [mask_len] flat bool mask; sequence i owns
        ``(seq_lens[i] + draft_token_num) * draft_token_num`` entries, in sequence order.
      retrieve_index: [batch_size, draft_token_num] tree node -> token row.
      retrieve_next_token: [batch_size, draft_token_num] first child of each tree node.
      retrieve_next_sibling: [batch_size, draft_token_num] next sibling of each tree node.
      retrieve_cum_len: [batch_size] per-sequence cumulative accepted length.
      seq_lens: [batch_size] prefix lengths (SGLang ``seq_lens_cpu``), used for mask offsets.
      draft_token_num: static; draft tokens verified per sequence.
    """

    draft_token: ArrayLike | None = None  # [num_tokens]
    positions: ArrayLike | None = None  # [num_tokens]
    custom_mask: ArrayLike | None = None  # [mask_len]
    retrieve_index: ArrayLike | None = None  # [batch_size, draft_token_num]
    retrieve_next_token: ArrayLike | None = None  # [batch_size, draft_token_num]
    retrieve_next_sibling: ArrayLike | None = None  # [batch_size, draft_token_num]
    retrieve_cum_len: ArrayLike | None = None  # [batch_size]
    seq_lens: ArrayLike | None = None  # [batch_size]
    draft_token_num: int = _static()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name != "draft_token_num":
                dtype = bool if field.name == "custom_mask" else np.int32
                value = _as_host_array(getattr(self, field.name), dtype)
                object.__setattr__(self, field.name, value)

    def check_dtypes(self) -> None:
        """Checks that host index fields hold integers and the mask bools or integers.

        Raises:
          ValueError: naming the field, its dtype and its first non-finite value, if any.
        """
        _check_dtypes("spec_info", (*SPEC_TOKEN_FIELDS, *SPEC_SEQ_FIELDS), self)
        _check_dtypes("spec_info", ("custom_mask",), self, kinds="biu")

    def validate(self, *, num_tokens: int, batch_size: int, padded: bool = False) -> None:
        """Checks dtypes and sizes against the owning batch.

        Args:
          num_tokens: token rows of the owning batch.
          batch_size: sequences of the owning batch.
          padded: the batch is in static-capacity form, where the custom mask may carry
            trailing padding entries (at least, rather than exactly, the needed length).

        Raises:
          ValueError: a size does not match; names the field and the numbers.
        """
        if self.draft_token_num < 1:
            raise ValueError(f"spec_info.draft_token_num must be >= 1, got {self.draft_token_num}")
        self.check_dtypes()
        _check_rows("spec_info", SPEC_TOKEN_FIELDS, self, num_tokens, "token rows of the batch")
        _check_rows("spec_info", SPEC_SEQ_FIELDS, self, batch_size, "batch_size")
        _check_non_negative("spec_info", ("seq_lens",), self)
        if self.custom_mask is not None and self.seq_lens is not None:
            expected = int(custom_mask_offsets(self.seq_lens, self.draft_token_num)[-1])
            got = _rows("custom_mask", self.custom_mask)
            if got < expected or (got != expected and not padded):
                raise ValueError(
                    f"spec_info.custom_mask has {got} entries, expected "
                    f"{'at least ' if padded else ''}sum((seq_lens + draft_token_num) * "
                    f"draft_token_num) = {expected} (draft_token_num={self.draft_token_num})"
                )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardBatch:
    """One DP rank's forward step (SGLang ``ForwardBatch`` field names).

    Construct with keywords; unset fields are None. On the host, ``extend_start_loc`` (exclusive
    prefix sum of ``extend_seq_lens``) and ``extend_num_tokens`` (token rows, ragged extend modes
    only) are derived when not given, and the batch is validated (see ``validate``).

    Attributes:
      forward_mode: static; the step's ``ForwardMode``.
      batch_size: static; sequences (rows of the per-sequence fields).
      input_ids: [num_tokens] token ids.
      positions: [num_tokens] token positions.
      out_cache_loc: [num_tokens] KV-pool slot each new token's K/V is written to.
      req_pool_indices: [batch_size] row of each request in the ``req_to_token`` table.
      seq_lens: [batch_size] length of each sequence including this step's new tokens; for
        TARGET_VERIFY (as in SGLang) the committed length without the draft tokens.
      extend_seq_lens: [batch_size] new tokens per sequence (ragged extend modes).
      extend_prefix_lens: [batch_size] cached prefix per sequence (ragged extend modes).
      extend_start_loc: [batch_size] first token row of each sequence in this batch.
      extend_num_tokens: static; token rows of a ragged extend batch (None otherwise).
      spec_info: EAGLE verify input (TARGET_VERIFY), or None.
      tbo_split_seq_index: data; where TBO splits the sequences, None when TBO is off.
      global_num_tokens: [dp_size] token count of every DP rank this step.
      global_dp_buffer_len: static; rows of the DP gather buffer.
      dp_padding_mode: static; the DP padding mode chosen for this step (opaque here).
      global_forward_mode: static; the mode all DP ranks agreed on (chooses the TBO strategy).
      tbo_parent_token_range: data; a TBO child's ``(start, end)`` token rows in its parent.
      tbo_padded_len: static; a TBO child's token rows rounded up to ``attn_tp_size``.
      num_token_non_padded: data; real tokens among the rows (None = all rows are real).
    """

    forward_mode: ForwardMode = _static()
    batch_size: int = _static()
    input_ids: ArrayLike | None = None  # [num_tokens]
    positions: ArrayLike | None = None  # [num_tokens]
    out_cache_loc: ArrayLike | None = None  # [num_tokens]
    req_pool_indices: ArrayLike | None = None  # [batch_size]
    seq_lens: ArrayLike | None = None  # [batch_size]
    extend_seq_lens: ArrayLike | None = None  # [batch_size]
    extend_prefix_lens: ArrayLike | None = None  # [batch_size]
    extend_start_loc: ArrayLike | None = None  # [batch_size]
    extend_num_tokens: int | None = _static(default=None)
    spec_info: SpecVerifyInput | None = None
    tbo_split_seq_index: int | None = None  # [] int
    global_num_tokens: ArrayLike | None = None  # [dp_size]
    global_dp_buffer_len: int | None = _static(default=None)
    dp_padding_mode: Any = _static(default=None)
    global_forward_mode: ForwardMode | None = _static(default=None)
    tbo_parent_token_range: tuple[int, int] | None = None  # ([] int, [] int)
    tbo_padded_len: int | None = _static(default=None)
    num_token_non_padded: int | None = None  # [] int

    def __post_init__(self) -> None:
        for name in (*TOKEN_FIELDS, *SEQ_FIELDS, *SEQ_DERIVED_FIELDS, "global_num_tokens"):
            object.__setattr__(self, name, _as_host_array(getattr(self, name), np.int32))
        if self.extend_start_loc is None and isinstance(self.extend_seq_lens, np.ndarray):
            object.__setattr__(self, "extend_start_loc", exclusive_cumsum(self.extend_seq_lens))
        if (
            self.extend_num_tokens is None
            and self.forward_mode in RAGGED_EXTEND_MODES
            and isinstance(self.input_ids, np.ndarray)
        ):
            object.__setattr__(self, "extend_num_tokens", int(self.input_ids.shape[0]))
        if _is_host(self):
            self.validate()

    @property
    def num_tokens(self) -> int:
        """Token rows (``len(input_ids)``)."""
        return int(np.shape(self.input_ids)[0])

    @property
    def num_valid_tokens(self) -> int:
        """Real (non-padded) tokens: ``num_token_non_padded``, or all rows when it is None."""
        if self.num_token_non_padded is None:
            return self.num_tokens
        return int(self.num_token_non_padded)

    def validate(self) -> None:
        """Checks that the host batch is consistent.

        Raises:
          ValueError: naming the field and the numbers, for a missing ``input_ids``, arrays of
            the wrong length, negative lengths, token counts that do not add up for the mode,
            a split index outside ``[0, batch_size]`` or spec-info sizes that do not match.
        """
        if not isinstance(self.forward_mode, ForwardMode):
            raise ValueError(f"forward_mode must be a ForwardMode, got {self.forward_mode!r}")
        if self.input_ids is None:
            raise ValueError("input_ids is required (it defines the token rows)")
        if self.batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {self.batch_size}")
        _check_dtypes("ForwardBatch", (*TOKEN_FIELDS, *SEQ_FIELDS, *SEQ_DERIVED_FIELDS), self)
        if self.spec_info is not None:
            self.spec_info.check_dtypes()
        n = _rows("input_ids", self.input_ids)
        _check_rows("ForwardBatch", TOKEN_FIELDS, self, n, "len(input_ids)")
        _check_rows("ForwardBatch", SEQ_FIELDS + SEQ_DERIVED_FIELDS, self, self.batch_size,
                    "batch_size")  # fmt: skip
        _check_non_negative("ForwardBatch", LENGTH_FIELDS, self)
        _validate_counts(self, n)
        _validate_extend(self, n)
        _validate_tbo(self, n)
        if self.spec_info is not None:
            self.spec_info.validate(
                num_tokens=n,
                batch_size=self.batch_size,
                padded=self.num_token_non_padded is not None,
            )


def replace_derived(batch: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` without the host checks, for batches that jtbo.split derives.

    ``split_batch`` builds children from an already validated parent with code whose output
    the tests validate; skipping a second round of checks keeps host planning within its
    per-step budget. Anything built from user input goes through the constructor instead.

    Args:
      batch: a ``ForwardBatch`` or ``SpecVerifyInput``.
      **changes: new values of existing fields.

    Returns:
      A shallow copy with ``changes`` applied; ``batch`` is unchanged.

    Raises:
      ValueError: a name that is not a field.
    """
    unknown = set(changes) - set(batch.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{type(batch).__name__} has no fields {sorted(unknown)}")
    new = copy.copy(batch)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def _is_host(tree: Any) -> bool:
    """True when there are leaves and each is a host value (numpy or int), not a jax.Array.

    A tree without leaves is not checked: ``jax.tree.map`` to None (or to specs) rebuilds
    batches whose fields are not data at all.
    """
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(isinstance(x, np.ndarray | np.generic | int) for x in leaves)


def exclusive_cumsum(lengths: np.ndarray) -> np.ndarray:
    """[0, l0, l0+l1, ...] without the total, as int32: each sequence's first token row.

    Args:
      lengths: [batch_size] non-negative lengths.

    Returns:
      [batch_size] int32 start offsets.
    """
    out = np.zeros(np.shape(lengths)[0], dtype=np.int32)
    if out.shape[0] > 1:
        np.cumsum(lengths[:-1], out=out[1:])
    return out


def _validate_counts(batch: ForwardBatch, n: int) -> None:
    valid = batch.num_valid_tokens
    if not 0 <= valid <= n:
        raise ValueError(f"num_token_non_padded={valid} must lie in [0, len(input_ids)={n}]")
    mode = batch.forward_mode
    if mode.is_decode() and n != batch.batch_size:
        raise ValueError(
            f"DECODE needs len(input_ids) == batch_size, got {n} != {batch.batch_size}"
        )
    if mode.is_target_verify():
        if batch.spec_info is None:
            raise ValueError("TARGET_VERIFY needs spec_info (draft_token_num)")
        per_seq = batch.spec_info.draft_token_num
        if n != batch.batch_size * per_seq:
            raise ValueError(
                f"TARGET_VERIFY needs len(input_ids) == batch_size * draft_token_num, got "
                f"{n} != {batch.batch_size} * {per_seq}"
            )
        # As in SGLang, a verify step's seq_lens are the committed lengths (without the draft
        # tokens), the same numbers the mask offsets are computed from.
        spec_lens = batch.spec_info.seq_lens
        if (
            spec_lens is not None
            and batch.seq_lens is not None
            and np.shape(spec_lens) == np.shape(batch.seq_lens)
            and (np.asarray(spec_lens) != np.asarray(batch.seq_lens)).any()
        ):
            raise ValueError(
                f"TARGET_VERIFY needs seq_lens == spec_info.seq_lens, got "
                f"{np.asarray(batch.seq_lens).tolist()} != {np.asarray(spec_lens).tolist()}"
            )
    if mode.is_idle() and valid != 0:
        raise ValueError(f"IDLE has no real tokens, got {valid} (num_token_non_padded/input_ids)")
    if batch.global_num_tokens is not None:
        if np.ndim(batch.global_num_tokens) != 1:
            raise ValueError(
                f"global_num_tokens must be 1-D, got {np.shape(batch.global_num_tokens)}"
            )
        _check_non_negative("ForwardBatch", ("global_num_tokens",), batch)


def _validate_extend(batch: ForwardBatch, n: int) -> None:
    ragged = batch.forward_mode in RAGGED_EXTEND_MODES
    if ragged and batch.extend_num_tokens is not None and batch.extend_num_tokens != n:
        raise ValueError(f"extend_num_tokens={batch.extend_num_tokens} != len(input_ids)={n}")
    if batch.extend_seq_lens is None:
        return
    lens = np.asarray(batch.extend_seq_lens)
    ends = np.cumsum(lens, dtype=np.int64)  # [batch_size] one past each sequence's last row
    total = int(ends[-1]) if ends.size else 0
    if ragged and total != batch.num_valid_tokens:
        raise ValueError(
            f"sum(extend_seq_lens)={total} != {batch.num_valid_tokens} real tokens "
            f"(len(input_ids)={n}, num_token_non_padded={batch.num_token_non_padded})"
        )
    loc = batch.extend_start_loc
    if loc is not None and ends.size and (loc[0] != 0 or (loc[1:] != ends[:-1]).any()):
        raise ValueError(
            f"extend_start_loc={np.asarray(loc).tolist()} is not the exclusive prefix sum of "
            f"extend_seq_lens ({exclusive_cumsum(lens).tolist()})"
        )
    if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        _validate_seq_lens(batch, lens)


def _validate_seq_lens(batch: ForwardBatch, lens: np.ndarray) -> None:
    """seq_lens = extend_prefix_lens + extend_seq_lens, row by row (a real prefill)."""
    seq_lens, prefix = batch.seq_lens, batch.extend_prefix_lens
    if seq_lens is None or prefix is None:
        return
    mismatch = np.asarray(seq_lens) - np.asarray(prefix) != lens
    if mismatch.any():
        i = int(np.flatnonzero(mismatch)[0])
        raise ValueError(
            f"seq_lens[{i}]={int(seq_lens[i])} != extend_prefix_lens[{i}] + "
            f"extend_seq_lens[{i}] = {int(prefix[i]) + int(lens[i])}"
        )


def _validate_tbo(batch: ForwardBatch, n: int) -> None:
    split = batch.tbo_split_seq_index
    if split is not None and not 0 <= int(split) <= batch.batch_size:
        raise ValueError(f"tbo_split_seq_index={split} outside [0, batch_size={batch.batch_size}]")
    token_range = batch.tbo_parent_token_range
    if token_range is not None:
        start, end = (int(v) for v in token_range)
        if not 0 <= start <= end or end - start > n:
            raise ValueError(
                f"tbo_parent_token_range=({start}, {end}) must satisfy 0 <= start <= end and "
                f"end - start <= len(input_ids)={n}"
            )
    if batch.tbo_padded_len is not None and batch.tbo_padded_len < 0:
        raise ValueError(f"tbo_padded_len must be >= 0, got {batch.tbo_padded_len}")
