"""Integer rounding shared by the host planners and the collectives' buffer sizes.

Both helpers are exact on Python integers and on numpy or jax integer arrays (no float round
trip), so they hold for counts of any size, on the host and inside traced code.
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
