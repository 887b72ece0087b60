"""ForwardMode predicates follow SGLang (is_extend covers TARGET_VERIFY and DRAFT_EXTEND)."""

import pytest

from jtbo.split import ForwardMode

EXTEND_LIKE = {
    ForwardMode.EXTEND,
    ForwardMode.MIXED,
    ForwardMode.DRAFT_EXTEND,
    ForwardMode.TARGET_VERIFY,
}


@pytest.mark.parametrize("mode", list(ForwardMode))
def test_predicates(mode):
    assert mode.is_extend() == (mode in EXTEND_LIKE)
    assert mode.is_decode() == (mode is ForwardMode.DECODE)
    assert mode.is_target_verify() == (mode is ForwardMode.TARGET_VERIFY)
    assert mode.is_idle() == (mode is ForwardMode.IDLE)
    assert mode.is_prebuilt() == (mode is ForwardMode.PREBUILT)
    assert mode.is_mixed() == (mode is ForwardMode.MIXED)
    assert mode.is_draft_extend() == (mode is ForwardMode.DRAFT_EXTEND)
    assert mode.is_decode_or_idle() == (mode in (ForwardMode.DECODE, ForwardMode.IDLE))


def test_members_and_sglang_values():
    assert {m.name for m in ForwardMode} == {
        "EXTEND",
        "MIXED",
        "DECODE",
        "TARGET_VERIFY",
        "IDLE",
        "PREBUILT",
        "DRAFT_EXTEND",
    }
    assert (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE) == (
        1,
        2,
        3,
        4,
    )
