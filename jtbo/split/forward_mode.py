"""Forward modes of one step, with SGLang's predicate semantics.

A step is an EXTEND (prefill, possibly with a cached prefix), a DECODE (one new token per
sequence), a MIXED chunked-prefill step (extend and decode sequences together), a
TARGET_VERIFY step of speculative decoding (``draft_token_num`` tokens per sequence checked by
the target model), a DRAFT_EXTEND step of the draft model, an IDLE step (a DP rank with no
sequences that still joins the collectives) or a PREBUILT step (a disaggregated decode worker
whose KV cache arrived ready-made).

The predicates do not partition the modes: as in SGLang, ``is_extend()`` is true for EXTEND,
MIXED, DRAFT_EXTEND *and* TARGET_VERIFY, because verifying ``k`` draft tokens per sequence has
the shape of a ``k``-token prefill. Code that means "a real prefill" must test the mode
itself (``mode in (EXTEND, MIXED)``), which is what the TBO split planner does.
"""

import enum


class ForwardMode(enum.IntEnum):
    """What one forward step computes; the integer values follow SGLang's declaration order.

    Members: EXTEND, DECODE, MIXED, IDLE, TARGET_VERIFY, DRAFT_EXTEND, PREBUILT.
    """

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6
    PREBUILT = 7

    def is_extend(self) -> bool:
        """True for EXTEND, MIXED, DRAFT_EXTEND and TARGET_VERIFY (multi-token sequences)."""
        return self in _EXTEND_LIKE

    def is_decode(self) -> bool:
        """True only for DECODE."""
        return self is ForwardMode.DECODE

    def is_mixed(self) -> bool:
        """True only for MIXED."""
        return self is ForwardMode.MIXED

    def is_idle(self) -> bool:
        """True only for IDLE."""
        return self is ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        """True only for TARGET_VERIFY."""
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        """True only for DRAFT_EXTEND."""
        return self is ForwardMode.DRAFT_EXTEND

    def is_prebuilt(self) -> bool:
        """True only for PREBUILT."""
        return self is ForwardMode.PREBUILT

    def is_decode_or_idle(self) -> bool:
        """True for DECODE and IDLE."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


_EXTEND_LIKE = frozenset(
    (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)
)
