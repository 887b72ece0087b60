"""``python -m jtbo.bench tbo``: the synthetic decode context, the environment set before the
backend starts, the overlap table from synthetic kernels, and CPU smoke runs."""

import dataclasses
import gzip
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jtbo.bench import kernel_time, limits, tbo
from jtbo.models import config as config_lib
from jtbo.runner import kv_table


def test_decode_context_has_its_own_slots_never_the_padding_slot():
    seqs, context = 5, 7
    batch = tbo.decode_batch(seqs, context, vocab=64)
    table = np.zeros((seqs, context + 3), np.int32)
    kv_table.record(table, tbo.decode_prefix(batch), num_slots=seqs * context + 1)
    kv_table.record(table, batch, num_slots=seqs * context + 1)
    want = np.arange(seqs)[:, None] * context + 1 + np.arange(context)[None, :]
    np.testing.assert_array_equal(table[:, :context], want)
    assert len(np.unique(table[:, :context])) == seqs * context  # distinct, none is slot 0


def _environment(argv, environ, dump_dir=None):
    tbo.configure_environment(tbo._parser().parse_args(argv), environ, dump_dir)
    return environ


def test_link_host_disables_nccl_p2p_keeps_shm_and_nvls_off_and_stages_the_peer_copy():
    got = _environment(["--link", "host"], {"XLA_FLAGS": "--a=1"})
    assert got == {
        "XLA_FLAGS": "--a=1",
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
        "JTBO_PEER_COPY_VIA_HOST": "1",
    }
    nvlink = _environment([], {})  # the default
    assert nvlink["NCCL_P2P_DISABLE"] == nvlink["JTBO_PEER_COPY_VIA_HOST"] == "0"
    assert _environment([], {"NCCL_NVLS_ENABLE": "7"})["NCCL_NVLS_ENABLE"] == "7"  # setdefault


def test_env_and_xla_options_reach_the_environment_and_xla_flags(tmp_path):
    argv = ["--env", "NCCL_DEBUG=INFO", "--env", "X_Y=a=b", "--xla-option", "xla_foo_mb=17",
            "--xla-option", "xla_gpu_enable_latency_hiding_scheduler=True"]  # fmt: skip
    got = _environment(argv, {"XLA_FLAGS": "--keep=3"}, dump_dir=str(tmp_path))
    assert got["NCCL_DEBUG"] == "INFO" and got["X_Y"] == "a=b"
    assert got["XLA_FLAGS"].split() == [
        "--keep=3",
        "--xla_foo_mb=17",
        "--xla_gpu_enable_latency_hiding_scheduler=true",  # XLA's spelling of a bool
        f"--xla_dump_to={tmp_path}/hlo",
        "--xla_dump_hlo_module_re=model_step",
    ]
    assert "XLA_FLAGS" not in _environment([], {})  # nothing to add: left unset
    with pytest.raises(ValueError, match="clash with --link host"):
        _environment(["--link", "host", "--env", "NCCL_P2P_DISABLE=0"], {})
    with pytest.raises(SystemExit):
        tbo._parser().parse_args(["--env", "NO_EQUALS_SIGN"])
    with pytest.raises(SystemExit):
        tbo._parser().parse_args(["--profile", str(tmp_path), "--no-profile"])


def test_importing_the_bench_does_not_start_the_backend():
    code = (
        "import jtbo.bench.__main__, jtbo.bench.tbo\n"
        "from jax._src import xla_bridge\n"
        "print(xla_bridge.backends_are_initialized())"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr  # main sets NCCL / XLA variables first


def _kernel(name, start, duration, device):
    return kernel_time.Kernel(name, "jit_model_step_1", duration, device, start)


def test_overlap_row_of_an_nccl_kernel_half_under_compute():
    kernels = [
        _kernel("gemm_fusion_dot_1", 0.0, 50.0, 1),
        _kernel("ncclDevKernel_AllToAll", 0.0, 100.0, 1),  # 50 of its 100 us under the gemm
    ]
    collectives = {"all-to-all": [4000, 6000], "all-reduce": [16]}
    row = tbo.overlap_row("decode 8", "TBO", kernels, 1, 250e-6, collectives)
    assert row == tbo.OverlapRow(
        case="decode 8", column="TBO", hidden_share=0.5, compute_ms=0.05,
        communication_ms=0.1, step_ms=0.25, bytes_per_exchange=5000.0,
        gigabytes_per_second=10016 / 100 / 1e3,  # bytes per us / 1e3: GB/s
    )  # fmt: skip
    assert row.bound_ratio == pytest.approx(2.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlap_row_of_random_steps_on_two_gpus(seed):
    rng = np.random.default_rng(seed)
    kernels, compute, nccl, hidden = [], [], [], []
    for device in (1, 2):
        for step in range(3):
            offset = 1000.0 * step  # the host's turn between steps
            busy, length = rng.uniform(20, 60), rng.uniform(80, 120)
            under = rng.uniform(0, busy)  # the NCCL kernel starts `under` us before compute ends
            kernels += [
                _kernel("gemm_fusion_dot_1", offset, busy, device),
                _kernel("ncclDevKernel_AllToAll", offset + busy - under, length, device),
                _kernel("MemcpyD2D", offset + busy - under + length + 1, 5.0, device),
            ]
            compute.append(busy)
            nccl.append(length)
            hidden.append(under)
    sizes = [int(size) for size in rng.integers(1, 1 << 20, size=4)]
    row = tbo.overlap_row("prefill 64", "no TBO", kernels, 3, 0.002, {"all-to-all": sizes})
    assert row.hidden_share == pytest.approx(sum(hidden) / sum(nccl))
    assert row.compute_ms == pytest.approx(np.mean(compute) / 1e3)
    assert row.communication_ms == pytest.approx(np.mean(nccl) / 1e3)
    assert row.bytes_per_exchange == pytest.approx(np.mean(sizes))
    assert row.gigabytes_per_second == pytest.approx(sum(sizes) / np.mean(nccl) / 1e3)
    assert row.bound_ratio == pytest.approx(2.0 / max(np.mean(compute), np.mean(nccl)) * 1e3)


def test_overlap_table_rows_and_footnotes_without_communication():
    kernels = [_kernel("gemm_fusion_dot_1", 0.0, 40.0, 1)]  # one GPU: no NCCL, no exchange
    row = tbo.overlap_row("decode 8", "no TBO", kernels, 1, 50e-6, {})
    assert (row.hidden_share, row.bytes_per_exchange, row.gigabytes_per_second) == (None,) * 3
    lines = tbo.overlap_table([row]).splitlines()
    assert lines[2] == "| decode 8 | no TBO | - | 0.04 | 0.00 | 1.250 | - | - |"
    assert any("not the trace's span" in line for line in lines[3:])
    assert tbo._format_bytes(466 * (1 << 20)) == "466.0 MiB" and tbo._format_bytes(12) == "12 B"


HLO = """HloModule jit_model_step_{n}, is_scheduled=true

ENTRY %main (a: bf16[32,64]) -> bf16[32,64] {{
  %a = bf16[32,64]{{1,0}} parameter(0)
  %gemm_fusion_dot.1 = bf16[32,64]{{1,0}} fusion(%a), kind=kCustom, calls=%f, \
metadata={{op_name="jit(model_step_{n})/shard_map/tbo_a/L1.experts/dot_general"}}
  %all-to-all-start = ((bf16[32,64]{{1,0}}), bf16[32,64]{{1,0}}) all-to-all-start(%a), \
dimensions={{0}}
  %all-to-all-done = bf16[32,64]{{1,0}} all-to-all-done(%all-to-all-start)
  ROOT %r = bf16[32,64]{{1,0}} copy(%all-to-all-done)
}}
"""


def _write_trace(path, module, spans):
    """A ``*.trace.json.gz`` of GPU kernels ``(name, start, duration)`` on GPUs 1 and 2."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"/device:GPU:{pid}"}}
        for pid in (1, 2)
    ]
    events = [
        {"ph": "X", "pid": pid, "ts": start, "dur": duration, "name": name,
         "args": {"hlo_module": module}}
        for pid in (1, 2) for name, start, duration in spans
    ]  # fmt: skip
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": meta + events}, file)


def test_gpu_overlap_report_joins_traces_dumps_and_timings(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(3)
    (tmp_path / "hlo").mkdir()
    paths, under = [], []
    for n, column in ((1, "plain"), (2, "tbo")):
        (tmp_path / "hlo" / f"module_000{n}.jit_model_step_{n}.sm_9.0a_gpu_after_optimizations"
         ".txt").write_text(HLO.format(n=n))  # fmt: skip
        hidden = float(rng.uniform(5, 40))
        spans = [
            (name, 1000.0 * step + start, duration)
            for step in range(tbo.PROFILE_STEPS)
            for name, start, duration in (
                ("gemm_fusion_dot_1", 0.0, 40.0),
                ("ncclDevKernel_AllToAll", 40.0 - hidden, 100.0),
            )
        ]
        paths.append(str(tmp_path / f"{column}.trace.json.gz"))
        _write_trace(paths[-1], f"jit_model_step_{n}", spans)
        under.append(hidden / 100.0)
    monkeypatch.setattr(tbo, "_trace_case", lambda runner, batch, directory, name, logits: paths)
    cases = [("decode", 8, None)]
    tbo._report_overlap(None, cases, [(2e-4, 3e-4)], str(tmp_path), True, True, "last")
    out = capsys.readouterr().out
    assert "| experts | 40.0 | 40.0 | +0.0 |" in out  # --profile DIR: per operation too
    for column in ("no TBO", "TBO"):  # and each column's largest kernels
        largest = out.split(f"decode 8, {column}: the largest kernels")[1]
        assert largest.splitlines()[3:5] == [
            "| ncclDevKernel_AllToAll | ncclDevKernel_AllToAll | 100.0 | 1 |",
            "| experts | gemm_fusion_dot_1 | 40.0 | 1 |",
        ]
    rate = 32 * 64 * 2 / 100.0 / 1e3  # one all-to-all per step over 100 us of NCCL
    for column, share, step_ms in zip(("no TBO", "TBO"), under, (0.2, 0.3), strict=True):
        want = (f"| decode 8 | {column} | {share:.3f} | 0.04 | 0.10 | {step_ms / 0.1:.3f} "
                f"| 4.0 KiB | {rate:.2f} |")  # fmt: skip
        assert want in out, out


@pytest.fixture
def scratch_environment(monkeypatch, tmp_path):
    """Keeps main's environment changes (NCCL variables, XLA_FLAGS) inside the test and its
    default trace folder in ``tmp_path``."""
    # main appends to XLA_FLAGS; restored afterwards. Kept as conftest set it: a backend
    # that starts in one of these tests then has conftest's 8 CPU devices.
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    for name in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tbo.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    return tmp_path


# The three tiny runs below serve the same cases (prefill 64, decode 8, float32) on one xdist
# worker, in file order: the later two load the first one's programs from the run's
# compilation cache (tests/conftest.py) instead of compiling them again alongside it.
TINY_CASES = ["--tiny", "--prefill", "64", "--decode", "8", "--context", "8", "--iters", "1",
              "--dtype", "float32"]  # fmt: skip
same_programs = pytest.mark.xdist_group("bench/test_tbo.py")


@same_programs
def test_tiny_run_prints_every_case_with_agreement(scratch_environment, capsys):
    tbo.main(TINY_CASES)
    out = capsys.readouterr().out
    assert "link nvlink" in out.splitlines()[0]
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), out.splitlines()[1:]))
    lines = [line for line in lines if line.startswith("| ")]  # the timing table
    assert [line.split("|")[1].strip() for line in lines[1:]] == ["prefill 64", "decode 8"]
    for line in lines[1:]:
        median_row, same_token = line.split("|")[-3].split(" / ")
        assert float(median_row) < 1e-5 and float(same_token) == 1.0, line  # float32 on the CPU
        assert float(line.split("|")[-2]) > 0, line  # the numerics guard's time
    header = [cell.strip() for cell in lines[0].split("|")]
    assert header[6:9] == ["auto (ms)", "auto / min", "auto chose"]
    for line in lines[2:]:  # the auto runner's time, its ratio to the faster column, its choice
        cells = [cell.strip() for cell in line.split("|")]
        assert float(cells[6]) > 0 and float(cells[7]) > 0, line
        assert cells[8].split()[0] in ("TBO", "plain") and cells[8].endswith("x)"), line
    assert "overlap table: needs a GPU" in out  # the CPU trace has no NCCL kernels
    # The host phases of the plain and TBO step of each case: each phase took time and
    # together they are at most the step.
    phase_table = out.split(tbo.PHASE_HEADER[0])[1].split("\n\n")[0].strip().splitlines()[1:]
    assert [row.split("|")[1:3] for row in phase_table] == [
        [f" {case} ", f" {column} "]
        for case in ("prefill 64", "decode 8")
        for column in ("no TBO", "TBO")
    ]
    for row in phase_table:
        inputs, dispatch, counts, rest, step_ms = map(float, row.split("|")[3:8])
        assert min(inputs, dispatch, counts) > 0 and rest >= 0, row  # one timed step each
        # Each of the five cells is printed to 0.001 ms, so rounding alone may put the sum of
        # four up to 5 * 0.0005 ms away from the fifth.
        rounding = 5 * 0.5e-3 + 1e-9
        assert inputs + dispatch + counts + rest == pytest.approx(step_ms, abs=rounding), row
    # One 64-token prompt (two-chunk split) and 8 decode sequences: even splits, children of
    # half the bucket.
    rows = out.split("TBO micro-batch rows (child capacity of the bucket): ")[1].splitlines()[0]
    assert rows == "prefill 64: 32 of 64; decode 8: 4 of 8", rows
    fill = out.split("EP buffer fill")[1].splitlines()[0]
    assert "prefill 64: " in fill and "decode 8: " in fill, fill
    ratios = [
        float(x)
        for case in fill.split(";")
        for x in case.split(":")[-1].replace(",", "/").split("/")
    ]
    assert len(ratios) == 8 and all(0 < r <= 1 for r in ratios), fill  # 2 cases x 2 micro-batches
    # The physical limits: the tiny MLA model's prefill FLOPs of one 64-token prompt, and the
    # decode step's weight and KV bytes (float32), each against the plain step.
    config = config_lib.MoEConfig.tiny_mla()
    for case, work in (
        ("prefill 64", f"{limits.prefill_flops(config, [64]) / 1e12:.2f} TFLOP at "),
        ("decode 8", f"{limits.decode_bytes(config, 8 * 8, 1, 4) / 1e9:.2f} GB at "),
    ):
        line = out.split(f"physical limit, {case}: ")[1].splitlines()[0]
        assert line.startswith(work) and line.endswith("x"), line
        assert float(line.split("= ")[-1][:-1]) > 0, line
        assert "; device step " in line, line  # the token program enqueued back to back
    assert not list(scratch_environment.glob("**/*.trace.json.gz"))  # no traces for nothing
    assert tbo.os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_skewed_prefill_through_sum_len_gathers(scratch_environment, capsys):
    # Ranks of 64 and 16 tokens through the "none" backend's DP gather, forced SUM_LEN: the
    # table lists both ranks' tokens, TBO's logits agree, the gather holds 80 rows, not 128.
    tbo.main(["--tiny", "--devices", "2", "--moe-a2a-backend", "none", "--prefill", "64",
              "--prompt-len", "16", "--decode", "--prefill-skew", "0.25", "--dp-padding",
              "sum_len", "--iters", "1", "--dtype", "float32", "--no-profile"])  # fmt: skip
    out = capsys.readouterr().out
    assert "MoE none, DP padding sum_len, prefill skew 0.25" in out.splitlines()[0]
    (line,) = [line for line in out.splitlines() if line.startswith("| prefill 64 | 64/16 |")]
    cells = [cell.strip() for cell in line.split("|")]
    assert cells[2] == "64/16" and float(cells[-3].split(" / ")[0]) < 1e-5, line
    assert "DP gather of the plain step (mode, buffer rows): prefill 64: SUM_LEN 80" in out
    with pytest.raises(SystemExit):
        tbo._parser().parse_args(["--prefill-skew", "0"])


@same_programs
def test_profile_traces_plain_and_tbo_steps_of_every_case(scratch_environment, capsys):
    tmp_path = scratch_environment
    tbo.main([*TINY_CASES, "--profile", str(tmp_path), "--link", "host"])
    for case in ("prefill_64", "decode_8"):
        for kind in ("plain", "tbo"):
            assert list((tmp_path / f"{case}_{kind}").glob("**/*.trace.json.gz")), (case, kind)
    assert "--xla_dump_to" in tbo.os.environ["XLA_FLAGS"]
    assert tbo.os.environ["NCCL_P2P_DISABLE"] == "1"
    out = capsys.readouterr().out
    assert "link host" in out.splitlines()[0] and "overlap table: needs a GPU" in out


@same_programs
def test_no_profile_sets_no_dump_and_prints_no_overlap_line(scratch_environment, capsys):
    # Also writes the runners' EP peak loads (--ep-routing-stats; the file does not exist yet,
    # so the capacities follow the factor rule): one entry per dispatch size run.
    stats = scratch_environment / "routing.json"
    tbo.main([*TINY_CASES, "--no-profile", "--ep-routing-stats", str(stats)])
    out = capsys.readouterr().out
    assert "overlap table" not in out and f"-> {stats}" in out
    assert "--xla_dump_to" not in tbo.os.environ["XLA_FLAGS"]
    content = json.loads(stats.read_text())
    rows = [entry["rows"] for entry in content["peaks"]]
    assert rows == sorted(set(rows)) and 64 in rows and 8 in rows, content


def test_attention_kind_picks_the_preset_and_kv_bytes_per_token():
    parse = tbo._parser().parse_args
    mla = tbo.bench_config(parse([]))
    assert mla == config_lib.MoEConfig.deepseek_v3_reduced() and mla.attention_kind == "mla"
    gqa = tbo.bench_config(parse(["--attention-kind", "gqa"]))
    assert gqa == config_lib.MoEConfig.deepseek_v3_gqa_reduced()
    assert tbo.bench_config(parse(["--tiny"])) == config_lib.MoEConfig.tiny_mla()
    assert (
        tbo.bench_config(parse(["--tiny", "--attention-kind", "gqa"]))
        == config_lib.MoEConfig.tiny()
    )
    # V3's latent: 512 + 64 values per token and layer; GQA: 2 x 8 heads x 128.
    assert tbo._kv_bytes(mla, "bfloat16").endswith(f"{4 * 576 * 2} bytes/token")
    assert tbo._kv_bytes(gqa, "bfloat16").endswith(f"{4 * 2 * 8 * 128 * 2} bytes/token")


HF_CONFIGS = Path(__file__).resolve().parents[2] / "tools" / "hf_configs"


def test_hf_config_takes_the_published_dimensions_cut_to_num_layers():
    parse = tbo._parser().parse_args
    path = HF_CONFIGS / "qwen3_30b_a3b.json"
    raw = json.loads(path.read_text())
    config = tbo.bench_config(parse(["--hf-config", str(path), "--num-layers", "3"]))
    assert config.num_layers == 3 and config.num_experts == raw["num_local_experts"] == 128
    assert config.moe_intermediate_size == raw["moe_intermediate_size"]
    assert config.hidden_size == raw["hidden_size"] and config.attention_kind == "gqa"
    whole = tbo.bench_config(parse(["--hf-config", str(path)]))
    assert whole.num_layers == raw["num_hidden_layers"]
    lite = tbo.bench_config(
        parse(["--hf-config", str(HF_CONFIGS / "deepseek_v2_lite.json"), "--num-layers", "2"])
    )
    assert lite.attention_kind == "mla" and lite.num_experts == 64 and lite.num_layers == 2
    fp8 = ["--hf-config", str(path), "--expert-dtype", "float8_e4m3fn"]
    assert tbo.bench_config(parse(fp8)).expert_dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-layers", "2"], "--num-layers applies to --hf-config only"),
        (["--tiny"], "--tiny does not apply"),
        (["--attention-kind", "gqa"], "--attention-kind does not apply"),
    ],
)
def test_hf_config_flags_that_do_not_fit_are_usage_errors(argv, message, capsys):
    if argv[0] != "--num-layers":
        argv = ["--hf-config", str(HF_CONFIGS / "qwen3_30b_a3b.json"), *argv]
    with pytest.raises(SystemExit) as exit_info:
        tbo.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_expert_dtype_gives_the_preset_fp8_experts():
    parse = tbo._parser().parse_args
    fp8 = tbo.bench_config(parse(["--tiny", "--expert-dtype", "float8_e4m3fn"]))
    assert fp8 == dataclasses.replace(config_lib.MoEConfig.tiny_mla(), expert_dtype="float8_e4m3fn")
    assert tbo.bench_config(parse(["--expert-dtype", "bfloat16"])).expert_dtype is None
    with pytest.raises(ValueError, match="expert_dtype='bfloat16'"):
        tbo.bench_config(parse(["--expert-dtype", "bfloat16", "--dtype", "float32"]))
