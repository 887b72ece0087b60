"""Integer rounding shared by the host planners, the collectives' buffer sizes and the kernels'
launch shapes.

``ceil_div`` and ``round_up`` are exact on Python integers and on numpy or jax integer arrays
(no float round trip), so they hold for counts of any size, on the host and inside traced
code; ``power_of_two_at_least`` takes Python integers (static sizes).
"""


def ceil_div(a, b):
    """``ceil(a / b)`` in integer arithmetic (``-(-a // b)``); ``b`` must be positive.

    Args:
      a: an integer, or a numpy or jax integer array.
      b: a positive integer (or array broadcastable with ``a``).

    Returns:
      The smallest integer ``q`` with ``q * b >= a``, elementwise for arrays.
    """
    return -(-a // b)


def round_up(a, multiple):
    """``a`` rounded up to a multiple of ``multiple`` (0 stays 0); ``multiple`` must be positive.

    Args:
      a: an integer or numpy integer array.
      multiple: a positive integer.

    Returns:
      The smallest multiple of ``multiple`` that is ``>= a``, elementwise for arrays.
    """
    return ceil_div(a, multiple) * multiple


def power_of_two_at_least(value: int, floor: int = 1) -> int:
    """The smallest power of two that is ``>= value`` and ``>= floor``.

    Args:
      value: a Python integer (any sign).
      floor: a power of two, the least result.

    Returns:
      ``max(floor, 2 ** ceil(log2(value)))``, in integer arithmetic.
    """
    return max(floor, 1 << max(value - 1, 0).bit_length())
