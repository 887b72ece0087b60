"""Row windows of the copy ops: one bounds rule shared by every impl.

Every op here pairs row ``i`` of a *plain* buffer (indexed from row 0) with row
``offset + i`` of an *offset* buffer, for ``i`` in ``[0, size)``:

* ``dp_memcpy(offset_src=True)``: plain = ``dst``, offset side = ``src``;
* ``dp_memcpy(offset_src=False)``: plain = ``src``, offset side = ``dst``;
* ``slice_pad``: plain = the padded output, offset side = ``x``;
* ``merge_rows``: plain = each part, offset side = the merged output.

Out-of-range rule (identical in every impl: the xla impls and the Pallas kernels
call ``window_bounds``, the Triton kernels run a line-by-line transcription of it):
a pair is copied only when both rows exist. Rows are never shifted to make a range
fit (unlike ``lax.dynamic_slice``); what does not fit is dropped. A negative
``size`` copies nothing; a negative ``offset`` drops the pairs whose offset-side
row would be negative. The copied ``i`` always form one interval ``[lo, hi)``
(possibly empty, then ``lo == hi``). The kernels take the raw ``offset`` and
``size`` and compute the interval themselves, so a call is one launch with no XLA
arithmetic before it. ``offset`` is first clamped to ``[-plain_rows,
offset_rows]``: outside it no pair is valid, and the clamp keeps every later sum
inside int32 for any buffers under 2**30 rows.
"""

import jax
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 2**30


def as_row_scalar(value, name: str) -> jax.Array:
    """Returns ``value`` as a 0-d int32 array.

    Args:
      value: a Python int or an integer array of shape ``()`` or ``(1,)`` (traced is fine).
      name: the argument's name, for errors.

    Returns:
      A 0-d int32 array.

    Raises:
      ValueError: ``value`` is not integer or has another shape.
    """
    arr = jnp.asarray(value)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer scalar, got dtype {arr.dtype}")
    if arr.shape not in ((), (1,)):
        raise ValueError(f"{name} must have shape () or (1,), got {arr.shape}")
    return arr.reshape(()).astype(jnp.int32)


def window_bounds(offset, size, plain_rows: int, offset_rows: int):
    """The valid copy indices of one plain/offset buffer pair, as three int32 scalars.

    Plain ``jnp.maximum`` / ``jnp.minimum`` on scalars only, so the Pallas kernels call
    this very function on the scalars they load (one rule, no separate XLA launch).

    Args:
      offset: int32 scalar, row of the offset buffer paired with plain row 0.
      size: int32 scalar, number of pairs asked for.
      plain_rows: static row count of the plain buffer.
      offset_rows: static row count of the offset buffer.

    Returns:
      ``(offset, lo, hi)`` with ``offset`` clamped as the module says; pairs ``i`` in
      ``[lo, hi)`` are copied.
    """
    off = jnp.minimum(jnp.maximum(offset, -plain_rows), offset_rows)
    lo = jnp.maximum(0, -off)
    hi = jnp.minimum(jnp.minimum(jnp.maximum(size, 0), plain_rows), offset_rows - off)
    return off, lo, jnp.maximum(hi, lo)


def copy_window(offset, size, plain_rows: int, offset_rows: int) -> jax.Array:
    """``window_bounds`` stacked: int32 ``[3]`` ``(offset, lo, hi)`` (for the xla impls)."""
    return jnp.stack(window_bounds(offset, size, plain_rows, offset_rows)).astype(jnp.int32)


def check_rows(shape: tuple[int, ...], name: str) -> None:
    """Raises ValueError unless ``shape`` has a row axis within ``MAX_ROWS``."""
    if len(shape) < 1:
        raise ValueError(f"{name} needs a row axis (ndim >= 1), got shape {shape}")
    if shape[0] >= MAX_ROWS:
        raise ValueError(f"{name} has {shape[0]} rows; at most {MAX_ROWS - 1} are supported")


def check_pair(a: jax.Array, b: jax.Array, a_name: str, b_name: str) -> None:
    """Raises ValueError unless ``a`` and ``b`` share dtype and trailing (per-row) shape."""
    check_rows(a.shape, a_name)
    check_rows(b.shape, b_name)
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(
            f"{a_name} and {b_name} must share the trailing shape, "
            f"got {a.shape[1:]} and {b.shape[1:]}"
        )
    if a.dtype != b.dtype:
        raise ValueError(f"{a_name} and {b_name} must share a dtype, got {a.dtype} and {b.dtype}")


def check_static_rows(value, name: str) -> int:
    """Returns ``value`` as a non-negative Python int or raises ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be a static Python int, got {type(value).__name__}")
    if value < 0 or value >= MAX_ROWS:
        raise ValueError(f"{name} must be in [0, {MAX_ROWS}), got {value}")
    return int(value)


def row_elems(shape: tuple[int, ...]) -> int:
    """Elements per row: the product of the trailing dims."""
    return int(np.prod(shape[1:], dtype=np.int64))
