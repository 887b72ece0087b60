"""Parsing a scheduled module: windows, bytes, micro-batch attribution, sync collectives."""

from jtbo.analysis import hlo_schedule

_TEXT = """\
HloModule m, is_scheduled=true

%fused_body (p: f32[8,4]) -> f32[8,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %t = f32[8,4]{1,0} tanh(%p), metadata={op_name="jit(f)/tbo_b/attn_core/tanh"}
}

%wrapped (q: bf16[16,4]) -> bf16[16,4] {
  %q = bf16[16,4]{1,0} parameter(0)
  ROOT %a2a = bf16[16,4]{1,0} all-to-all(%q), dimensions={0}
}

ENTRY %main (x: f32[8,4], y: bf16[16,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0), metadata={op_name="x"}
  %y = bf16[16,4]{1,0} parameter(1)
  %ags = (f32[8,4]{1,0}, f32[64,4]{1,0}) all-gather-start(%x), metadata={op_name="tbo_a/ag"}
  %fusion.1 = f32[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_body
  %bc = f32[8,4]{1,0} bitcast(%fusion.1)
  %gemm = f32[8,4]{1,0} custom-call(%bc), metadata={op_name="tbo_a/dot"}
  %agd = f32[64,4]{1,0} all-gather-done(%ags), metadata={op_name="tbo_a/ag"}
  %as = ((bf16[16,4]{1,0}), bf16[16,4]{1,0}) async-start(%y), calls=%wrapped,\
  metadata={op_name="tbo_b/a2a"}
  %ad = bf16[16,4]{1,0} async-done(%as), metadata={op_name="tbo_b/a2a"}
  %ar = f32[8,4]{1,0} all-reduce(%fusion.1), to_apply=%fused_body, metadata={op_name="tbo_b/psum"}
  ROOT %out = (f32[8,4]{1,0}) tuple(%ar)
}
"""


def test_windows():
    windows = hlo_schedule.collective_windows(_TEXT)
    assert [(w.kind, w.is_async, w.micro_batch) for w in windows] == [
        ("all-gather", True, "tbo_a"),
        ("all-to-all", True, "tbo_b"),
        ("all-reduce", False, "tbo_b"),
    ]
    gather, a2a, reduce = windows
    assert gather.num_bytes == 64 * 4 * 4  # the larger buffer
    assert a2a.num_bytes == 16 * 4 * 2
    assert reduce.num_bytes == 8 * 4 * 4  # sizes from the operand's shape too
    # the fusion has no op_name: attributed through its body; the bitcast is not compute
    assert [(s.name, s.micro_batch) for s in gather.between] == [
        ("fusion.1", "tbo_b"),
        ("gemm", "tbo_a"),
    ]
    assert [s.name for s in gather.other_micro_batch_compute()] == ["fusion.1"]
    assert a2a.between == () and reduce.between == ()


def test_shape_bytes_and_mixed_attribution():
    assert hlo_schedule.shape_bytes("(bf16[2,3]{1,0}, f32[], s8[5])") == [12, 4, 5]
    computations = hlo_schedule.parse_module(_TEXT)
    gemm = next(i for i in computations["main"].instructions if i.name == "gemm")
    mixed = gemm.__class__(**{**gemm.__dict__, "op_name": "tbo_a/x/tbo_b/y"})
    assert hlo_schedule.micro_batch_of(mixed, computations) == "mixed"


_LOOP = """\
HloModule m, is_scheduled=true

%body (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %s = (f32[4]{0}, f32[4]{0}) all-reduce-start(%p), metadata={op_name="tbo_a/psum"}
  %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fb, metadata={op_name="tbo_b/mul"}
  ROOT %d = f32[4]{0} all-reduce-done(%s)
}

%fb (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %m = f32[4]{0} multiply(%q, %q)
}

%cond (c: f32[4]) -> pred[] {
  %c = f32[4]{0} parameter(0)
  ROOT %k = pred[] constant(false)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %w = f32[4]{0} while(%x), condition=%cond, body=%body
}
"""


def test_collectives_inside_while_bodies():
    (window,) = hlo_schedule.collective_windows(_LOOP)
    assert window.computation == "body" and window.is_async and window.num_bytes == 16
    assert [s.name for s in window.other_micro_batch_compute()] == ["f"]
