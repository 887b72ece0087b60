"""jtbo.core: what every layer shares and that depends on nothing of jtbo's.

* ``arith``: ``ceil_div`` / ``round_up`` / ``power_of_two_at_least``, the integer rounding the
  planners, the collectives' buffers and the kernels' launch shapes share.
"""

from jtbo.core.arith import ceil_div, power_of_two_at_least, round_up

__all__ = ["ceil_div", "power_of_two_at_least", "round_up"]
