"""Kernel-time attribution: a synthetic trace and HLO with known answers."""
# ruff: noqa: E501 (HLO instructions are one line each, as XLA prints them)

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.analysis import hlo_schedule
from jtbo.bench import kernel_time

HLO = """HloModule jit_model_step_1, is_scheduled=true

%body.1 (p: f32[4]) -> f32[4] {
  %loop_add_fusion.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%f, metadata={op_name="jit(model_step_1)/tbo_a/L0.attn_core/while/body/add"}
}

ENTRY %main.1 (a: bf16[8,8]) -> bf16[8,8] {
  %gemm_fusion_dot.3 = bf16[8,8]{1,0} fusion(%a), kind=kCustom, calls=%g, metadata={op_name="jit(model_step_1)/tbo_a/L2.attn_prepare/dot_general"}
  %custom-call.7 = (bf16[8,8]{1,0}, s8[4]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(model_step_1)/tbo_b/L1.experts/dot_general"}
  %input_concatenate_fusion.1 = bf16[16,8]{1,0} fusion(%a), kind=kInput, calls=%c, metadata={op_name="params[\\'layers\\'][1][\\'moe\\'][\\'experts\\'][\\'w_gate\\'].value"}
  %custom-call.8 = (bf16[8,8]{1,0}, s8[4]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(model_step_1)/logits/dot_general"}
}
"""


def _trace(kernels):
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
    ]
    events = [
        {"ph": "X", "pid": 1, "ts": i, "dur": dur, "name": name,
         "args": {"hlo_module": "jit_model_step_1"}}
        for i, (name, dur) in enumerate(kernels)
    ]  # fmt: skip
    host = [{"ph": "X", "pid": 2, "ts": 0, "dur": 99.0, "name": "gemm_fusion_dot_3"}]
    return {"traceEvents": meta + events + host}


STEP = [
    ("gemm_fusion_dot_3", 10.0),
    ("loop_add_fusion_2", 1.5),
    ("loop_add_fusion_2", 2.5),
    ("nvjet_sm90_tss_128x64", 20.0),
    ("input_concatenate_fusion_1", 4.0),
    ("sm90_xmma_gemm_bf16", 6.0),
    ("memcpy32_post", 1.0),
]


def test_attribution_by_fusion_name_cublas_order_and_family():
    kernels = kernel_time.gpu_kernels(_trace(STEP * 2))
    assert len(kernels) == 14  # the host event is not a GPU kernel
    got = kernel_time.attribute(kernels, HLO, steps=2)
    assert got == {
        "attn_prepare": 10.0,
        "attn_core (loop)": 4.0,
        "experts": 20.0,
        "weight layers.moe.experts.w_gate": 4.0,
        "logits": 6.0,
        "memcpy32_post": 1.0,
    }


def test_largest_kernels_table_lists_kernels_with_their_operation_and_launches():
    kernels = kernel_time.gpu_kernels(_trace(STEP * 2))
    rows = kernel_time.largest_kernels_table(kernels, HLO, steps=2, top=3).splitlines()
    assert rows[2:] == [
        "| experts | nvjet_sm90_tss_128x64 | 20.0 | 1 |",
        "| attn_prepare | gemm_fusion_dot_3 | 10.0 | 1 |",
        "| logits | sm90_xmma_gemm_bf16 | 6.0 | 1 |",
    ]
    # The loop body's two launches of one fusion make one row of their sum.
    full = kernel_time.largest_kernels_table(kernels, HLO, steps=2, top=10)
    assert "| attn_core (loop) | loop_add_fusion_2 | 4.0 | 2 |" in full


def test_cublas_kernels_that_do_not_fit_the_order_are_unmatched():
    kernels = kernel_time.gpu_kernels(_trace(STEP + [("nvjet_extra", 3.0)]))
    got = kernel_time.attribute(kernels, HLO, steps=1)
    assert got["cuBLAS (unmatched)"] == 29.0 and "experts" not in got


def test_compare_table_orders_by_difference_and_totals():
    table = kernel_time.compare_table({"a": 10.0, "b": 5.0}, {"a": 11.0, "b": 9.0, "c": 1.0})
    rows = table.splitlines()
    assert rows[2].startswith("| b | 5.0 | 9.0 | +4.0 |")
    assert rows[-1] == "| **all kernels** | 15.0 | 21.0 | +6.0 |"


def test_main_reads_traces_and_the_dump_folder(tmp_path, capsys):
    dump = tmp_path / "hlo"
    dump.mkdir()
    (dump / "module_0007.jit_model_step_1.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    (dump / "module_0007.jit_model_step_1.before_optimizations.txt").write_text("HloModule x")
    for name, kernels in (("plain", STEP[:1]), ("tbo", STEP)):
        with gzip.open(tmp_path / f"{name}.trace.json.gz", "wt") as file:
            json.dump(_trace(kernels), file)
    kernel_time.main([
        "--plain", str(tmp_path / "plain.trace.json.gz"),
        "--tbo", str(tmp_path / "tbo.trace.json.gz"), "--hlo", str(dump),
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert "| experts | 0.0 | 20.0 | +20.0 |" in out
    assert "| **all kernels** | 10.0 | 45.0 | +35.0 |" in out
    with pytest.raises(ValueError, match="0 optimized-HLO dumps of 0 programs named jit_other"):
        kernel_time.hlo_dump_of(str(dump), "jit_other")


def test_hlo_dump_of_takes_one_program_dumped_twice_and_refuses_two(tmp_path):
    # A program loaded from the persistent cache is dumped again under its name, with other
    # metadata; another program of the same name is a different set of fusions.
    (tmp_path / "module_0007.jit_model_step_1.sm_9.0a_gpu_after_optimizations.txt").write_text(HLO)
    cached = HLO.replace("is_scheduled=true", "is_scheduled=true, loaded=1")
    (tmp_path / "module_0009.jit_model_step_1.after_optimizations.txt").write_text(cached)
    assert kernel_time.hlo_dump_of(str(tmp_path), "jit_model_step_1") == HLO
    other = HLO.replace("experts", "router")
    (tmp_path / "module_0011.jit_model_step_1.after_optimizations.txt").write_text(other)
    with pytest.raises(ValueError, match="3 optimized-HLO dumps of 2 programs"):
        kernel_time.hlo_dump_of(str(tmp_path), "jit_model_step_1")
    with pytest.raises(ValueError, match="no GPU kernels"):
        kernel_time.step_module([])


def _k(name, start, duration, device=1):
    return kernel_time.Kernel(name, "m", duration, device, start)


def test_hidden_communication_counts_nccl_time_under_other_kernels_per_device():
    kernels = [
        _k("ncclDevKernel_AllGather", 0.0, 10.0),  # half under the gemm
        _k("gemm_fusion_dot_1", 5.0, 10.0),
        _k("ncclDevKernel_AllToAll", 20.0, 4.0),  # under two touching kernels: all of it
        _k("loop_add_fusion", 19.0, 2.0),
        _k("loop_mul_fusion", 21.0, 5.0),
        _k("MemcpyD2D", 30.0, 5.0),  # a copy hides nothing
        _k("ncclDevKernel_AllReduce", 31.0, 2.0),
        _k("ncclDevKernel_AllGather", 0.0, 10.0, device=2),  # another GPU: its own compute
        _k("gemm_fusion_dot_1", 8.0, 1.0, device=2),
    ]
    assert kernel_time.hidden_communication(kernels) == (5.0 + 4.0 + 0.0 + 1.0, 26.0)
    assert kernel_time.hidden_communication(kernels[1:2]) == (0.0, 0.0)
    # The peer copy's transfers count as communication, staged through the host or not.
    staged = [
        _k("MemcpyD2H", 0.0, 4.0),  # all under the gemm
        _k("gemm_fusion_dot_1", 0.0, 6.0),
        _k("MemcpyH2D", 4.0, 4.0),  # half under it
        _k("MemcpyP2P", 20.0, 3.0),  # alone
    ]
    assert kernel_time.hidden_communication(staged) == (4.0 + 2.0, 11.0)


@settings(max_examples=50, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.booleans(), st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=12
    )
)
def test_hidden_communication_matches_a_unit_grid(spans):
    kernels = [
        _k("nccl_x" if comm else "fusion", float(start), float(length))
        for comm, start, length in spans
    ]
    busy = np.zeros(80, bool)
    for comm, start, length in spans:
        if not comm:
            busy[start : start + length] = True
    want_hidden = sum(busy[s : s + n].sum() for comm, s, n in spans if comm)
    want_total = sum(n for comm, _, n in spans if comm)
    assert kernel_time.hidden_communication(kernels) == (want_hidden, want_total)


def test_multi_gpu_attribution_is_the_mean_per_gpu_and_reads_shard_map_names():
    hlo = HLO.replace("jit(model_step_1)/tbo_a/L2", "jit(model_step_1)/shard_map/tbo_a/L2")
    kernels = [
        kernel_time.Kernel(name, "jit_model_step_1", dur * device, device, float(i))
        for device in (1, 2)
        for i, (name, dur) in enumerate(STEP)
    ]
    got = kernel_time.attribute(kernels, hlo, steps=1)
    # cuBLAS calls match in each GPU's own order; GPU 2 ran everything twice as long.
    assert got["attn_prepare"] == 15.0 and got["experts"] == 30.0 and got["logits"] == 9.0
    assert kernel_time.operation("jit(step)/shard_map", "loop_add_fusion_3") == "loop_add_fusion"
    # An operation the lockstep runs once for both micro-batches keeps its name.
    assert kernel_time.operation("jit(step)/tbo_joint/L1.experts/concatenate", "f") == "experts"


def test_busy_times_per_gpu_and_step():
    step = [
        ("gemm_fusion_dot_1", 0.0, 10.0),
        ("ncclDevKernel_AllToAll", 5.0, 10.0),  # 5 us under the gemm
        ("MemcpyD2D", 16.0, 2.0),  # neither compute nor communication
        ("loop_add_fusion", 18.0, 2.0),
    ]
    kernels = []
    for device, offset in ((1, 0.0), (1, 1000.0), (2, 0.0), (2, 1000.0)):
        scale = 1.0 if device == 1 else 2.0
        kernels += [
            _k(name, offset + start * scale, duration * scale, device)
            for name, start, duration in step
        ]
    got = kernel_time.busy_times(kernels, steps=2)
    assert got == kernel_time.BusyTimes(compute=18.0, communication=15.0, span=30.0)
    with pytest.raises(ValueError, match="cannot hold 3 steps"):
        kernel_time.busy_times(kernels[:2], steps=3)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_split_steps_cuts_at_the_idle_gaps_between_steps(sizes, seed):
    rng = np.random.default_rng(seed)
    kernels, start = [], 0.0
    for size in sizes:
        for _ in range(size):
            duration = float(rng.uniform(1, 5))
            kernels.append(_k("k", start, duration))
            start += duration + float(rng.uniform(0, 2))  # small gaps inside a step
        start += 100.0  # the host's turn between steps
    steps = kernel_time._split_steps(kernels, len(sizes))
    assert [len(step) for step in steps] == sizes


COLLECTIVES_HLO = """HloModule jit_model_step_2, is_scheduled=true

%body.2 (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %t = (s32[], f32[4]{0}) tuple(%p)
}

%cond.2 (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main.2 (a: bf16[132,66], b: bf16[40,64], c: f32[16], d: s32[2,2], e: s32[3]) -> bf16[132,66] {
  %a = bf16[132,66]{1,0} parameter(0)
  %b = bf16[40,64]{1,0} parameter(1)
  %c = f32[16]{0} parameter(2)
  %d = s32[2,2]{1,0} parameter(3)
  %e = s32[3]{0} parameter(4)
  %all-to-all-start.2 = ((bf16[132,66]{1,0}), bf16[132,66]{1,0}) all-to-all-start(%a), channel_id=1, dimensions={0}, metadata={op_name="jit(model_step_2)/shard_map/tbo_a/L0.dispatch_a/all_to_all"}
  %fusion.1 = bf16[40,64]{1,0} fusion(%b), kind=kLoop, calls=%body.2
  %all-to-all-done.2 = bf16[132,66]{1,0} all-to-all-done(%all-to-all-start.2)
  %all_to_all.27 = bf16[40,64]{1,0} all-to-all(%fusion.1), channel_id=1, dimensions={0}
  %all-gather-start = (f32[16]{0}, f32[64]{0}) all-gather-start(%c), dimensions={0}
  %all-gather-done = f32[64]{0} all-gather-done(%all-gather-start)
  %all-reduce-start = ((s32[2,2]{1,0}, s32[3]{0}), (s32[2,2]{1,0}, s32[3]{0})) all-reduce-start(%d, %e), to_apply=%cond.2
  %all-reduce-done = (s32[2,2]{1,0}, s32[3]{0}) all-reduce-done(%all-reduce-start)
  %w = (s32[], f32[4]{0}) while(%t0), condition=%cond.2, body=%body.2
  ROOT %r = bf16[132,66]{1,0} copy(%all-to-all-done.2)
}
"""


def test_collective_bytes_per_kind_from_per_device_shapes():
    got = kernel_time.collective_bytes(COLLECTIVES_HLO)
    assert got == {
        "all-to-all": [132 * 66 * 2, 40 * 64 * 2],  # async pair, then a synchronous one
        "all-gather": [64 * 4],  # the gathered result, the larger buffer
        "all-reduce": [(4 + 3) * 4],  # a combined all-reduce: its tuple summed
    }


def _peer_copy(name: str, target: str, operands: str, exchange: int) -> str:
    """One peer-copy custom call as XLA prints it, under its exchange's name scope."""
    return (
        f"  %{name} = bf16[40,64]{{1,0}} custom-call({operands}), "
        f'custom_call_target="jtbo_peer_all_to_all_{target}", custom_call_has_side_effect=true, '
        f'metadata={{op_name="jit(s)/shard_map/tbo_a/jtbo_peer_exchange_{exchange}/ffi_call"}}\n'
    )


def test_collective_bytes_counts_peer_copy_starts_by_their_send_buffer():
    # Two exchanges, waited in the other order; the wait of exchange 7 reads its receive
    # buffer through a copy, which no data-flow rule would follow: the scopes pair them.
    with_peer_copy = COLLECTIVES_HLO.replace(
        "  ROOT %r = bf16[132,66]{1,0} copy(%all-to-all-done.2)",
        _peer_copy("s7", "start", "%b", 7)
        + _peer_copy("s8", "start", "%b", 8)
        + "  %s7c = bf16[40,64]{1,0} copy(%s7)\n"
        + _peer_copy("w8", "wait", "%b, %s8", 8)
        + _peer_copy("w7", "wait", "%b, %s7c", 7)
        + "  ROOT %r = bf16[132,66]{1,0} copy(%all-to-all-done.2)",
    )
    got = kernel_time.collective_bytes(with_peer_copy)
    assert got[hlo_schedule.PEER_COPY_KIND] == [40 * 64 * 2] * 2  # each start once
    assert got["all-to-all"] == [132 * 66 * 2, 40 * 64 * 2]
    windows = [w for w in hlo_schedule.collective_windows(with_peer_copy)
               if w.kind == hlo_schedule.PEER_COPY_KIND]  # fmt: skip
    assert {(w.start, w.done) for w in windows} == {("s7", "w7"), ("s8", "w8")}


def test_a_peer_copy_wait_without_its_start_is_an_error():
    unpaired = COLLECTIVES_HLO.replace(
        "  ROOT %r = bf16[132,66]{1,0} copy(%all-to-all-done.2)",
        _peer_copy("w3", "wait", "%b, %b", 3) + "  ROOT %r = bf16[132,66]{1,0} copy(%a)",
    )
    with pytest.raises(ValueError, match="0 starts of exchange 3"):
        kernel_time.collective_bytes(unpaired)


def test_collective_bytes_refuses_a_collective_in_a_loop_body():
    in_loop = COLLECTIVES_HLO.replace(
        "  ROOT %t = (s32[], f32[4]{0}) tuple(%p)",
        "  %x = f32[4]{0} get-tuple-element(%p), index=1\n"
        "  %ar = f32[4]{0} all-reduce(%x), to_apply=%cond.2\n"
        "  ROOT %t = (s32[], f32[4]{0}) tuple(%p)",
    )
    with pytest.raises(ValueError, match="all-reduce ar runs in body.2"):
        kernel_time.collective_bytes(in_loop)


def test_largest_compute_kernels_per_gpu_and_step():
    kernels = [
        _k("loop_dynamic_update_slice_fusion", 0.0, 280.0),
        _k("loop_dynamic_update_slice_fusion", 300.0, 280.0, device=2),
        _k("gemm_fusion_dot_1", 0.0, 100.0),
        _k("gemm_fusion_dot_1", 0.0, 60.0, device=2),
        _k("input_reduce_fusion", 0.0, 30.0),
        _k("MemcpyP2P", 0.0, 900.0),  # communication
        _k("MemcpyD2D", 0.0, 900.0),  # a copy
        _k("ncclDevKernel_AllToAll", 0.0, 900.0),
    ]
    line = kernel_time.largest_compute_kernels(kernels, steps=2, top=2)
    # 2 GPUs x 2 steps: totals / 4, launches / 4.
    assert line == (
        "largest compute kernels per GPU and step: loop_dynamic_update_slice_fusion 0.14 ms "
        "x 0.5, gemm_fusion_dot_1 0.04 ms x 0.5"
    )
    assert kernel_time.largest_compute_kernels(kernels[5:], steps=1) == (
        "no compute kernels in the trace"
    )


def test_kernels_per_call_in_microseconds_largest_first_and_the_rest_summed():
    kernels = [
        _k("_gate_up_kernel", 0.0, 200.0),
        _k("_gate_up_kernel", 500.0, 210.0),
        _k("_down_kernel", 200.0, 90.0),
        _k("_down_kernel", 700.0, 100.0),
        _k("input_scatter_fusion", 300.0, 6.0),
        _k("loop_gather_fusion", 310.0, 4.0),
        _k("MemsetD32", 320.0, 50.0),  # not compute
    ]
    line = kernel_time.kernels_per_call(kernels, calls=2, top=2)
    assert line == (
        "kernels per call 305.0 us (span 400.0 us): _gate_up_kernel 205.0 us x 1, _down_kernel 95.0 us x 1, "
        "2 others 5.0 us"
    )
    assert kernel_time.kernels_per_call(kernels[6:], calls=1) == "no compute kernels in the trace"
