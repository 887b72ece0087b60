"""Token buckets: the static token capacities a step is padded to for jit.

jit compiles per shape, so the runner pads a step's token rows to a bucketed capacity and the
real sizes travel as data (the runner's planning: the token capacity is the smallest bucket
holding the busiest DP rank's tokens). A program compiled for a bucket then serves every step
that fits it - the JAX counterpart of SGLang's CUDA-graph capture at a padded batch size.
``default_token_buckets`` gives powers of two, so a step pads to at most twice its tokens.
"""

from collections.abc import Sequence


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
