"""``python -m jtbo.bench overlap``: the run-time overlap probe on the CPU (8 devices).

In-process runs, the numpy references and the check that must reject a wrong program, pinned
and free windows computing the same chains, the settings parsers, and two subprocess runs:
``--variant`` (three variants, one failing on purpose, one in free windows) and
``--processes 2`` (2 processes x 2 CPU devices under ``jax.distributed``).
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.bench import overlap
from jtbo.overlap import xla_options

TINY = ["--bytes", "64KiB", "--matmul", "64", "--chain", "2", "--iters", "2",
        "--matmuls-per-window", "2"]  # fmt: skip


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| variant | collective | windows |"), lines
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def _assert_measured(row: list[str]) -> None:
    comm, compute, both, hidden, gbps = (float(cell) for cell in row[4:])
    assert min(comm, compute, both, gbps) > 0, row
    assert math.isfinite(hidden), row


def test_in_process_run_prints_a_row_per_collective(capsys):
    """End to end in the default, pinned windows (the check passes through the barriers)."""
    overlap.main(TINY)
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert [row[1] for row in rows] == list(overlap.COLLECTIVES)
    for row in rows:
        assert row[0] == "default" and row[2:4] == ["pinned", "64.0 KiB"], row
        _assert_measured(row)
    assert "8 x cpu (cpu)" in out and "windows pinned; matmuls/window: all_to_all 2" in out
    assert out.rstrip().splitlines()[-1] == "| " + " | ".join(rows[-1]) + " |"  # table last


def test_auto_balanced_matmul_count_runs(capsys):
    overlap.main(["--bytes", "64KiB", "--matmul", "128", "--chain", "1", "--iters", "1",
                  "--collectives", "all_to_all"])  # fmt: skip
    count = int(capsys.readouterr().out.split("matmuls/window: all_to_all ")[1].split()[0])
    assert 1 <= count <= overlap.MAX_MATMULS_PER_WINDOW


def test_a_wrong_collective_program_fails_the_check(monkeypatch):
    right = overlap.COLLECTIVES["all_to_all"]

    def misplaced(received, ndev):  # the blocks one place off, as a wrong split axis would
        return right.finish(jnp.roll(received, received.shape[0] // ndev, axis=0), ndev)

    wrong = dataclasses.replace(right, finish=misplaced)
    monkeypatch.setitem(overlap.COLLECTIVES, "all_to_all", wrong)
    with pytest.raises(RuntimeError, match="all_to_all: comm alone"):
        overlap.main([*TINY, "--collectives", "all_to_all"])


def test_a_wrong_matmul_chain_fails_the_check(monkeypatch):
    right = overlap._matmul_chain
    monkeypatch.setattr(overlap, "_matmul_chain", lambda y, w, count: right(y, w, count + 1))
    with pytest.raises(RuntimeError, match="all_gather: compute alone"):
        overlap.main([*TINY, "--collectives", "all_gather"])


def _both_outputs(name: str, windows: str) -> list[np.ndarray]:
    """The both program's two chain outputs for ``TINY`` sizes, run on the 8 CPU devices."""
    args = overlap._parser().parse_args([*TINY, "--collectives", name])
    mesh = jax.make_mesh((len(jax.devices()),), (overlap.PROBE_AXIS,),
                         axis_types=(jax.sharding.AxisType.Auto,))  # fmt: skip
    sizes = overlap.resolve_sizes(args, "cpu", mesh.size)
    probe_inputs = overlap.make_inputs(mesh, sizes, [name], args.seed)
    collective = overlap.COLLECTIVES[name]
    x = probe_inputs.comm[overlap._comm_input_rows(collective, sizes, mesh.size)]
    inputs = (x, probe_inputs.y, probe_inputs.w)
    runs = overlap._programs(collective, mesh, sizes.chain, sizes.matmuls_per_window, inputs,
                             {}, ["both"], windows)  # fmt: skip
    return [np.asarray(out) for out in runs["both"]()]


@pytest.mark.parametrize("name", list(overlap.COLLECTIVES))
def test_pinned_and_free_windows_compute_identical_chains(name):
    """The barriers are identities: the same ops in the same order, so bit for bit equal."""
    pinned, free = (_both_outputs(name, windows) for windows in ("pinned", "free"))
    for got, want in zip(pinned, free, strict=True):
        np.testing.assert_array_equal(got, want)


def test_pinned_windows_put_two_barriers_in_each_window():
    """Pinned: one barrier before each window's collective and matmuls, one after; free:
    none (XLA's scheduler decides)."""
    collective = overlap.COLLECTIVES["all_to_all"]
    x, y = jnp.ones((8, 4)), jnp.ones((4, 4))

    def barriers(windows: str) -> int:
        body = overlap.BOTH_BODIES[windows]
        jaxpr = jax.make_jaxpr(lambda x, y: body(x, y, y, collective, 3, 2, 8),
                               axis_env=[(overlap.PROBE_AXIS, 8)])(x, y)  # fmt: skip
        return str(jaxpr).count("optimization_barrier")

    assert barriers("pinned") == 6 and barriers("free") == 0


def test_profile_writes_traces_of_the_both_program(tmp_path, capsys):
    overlap.main([*TINY, "--collectives", "psum_scatter", "--profile", str(tmp_path)])
    folder = tmp_path / "default_psum_scatter" / "process_0"
    assert list(folder.glob("**/*.trace.json.gz"))
    assert f"traces written to {folder}" in capsys.readouterr().out  # CPU: no NCCL attribution


def test_nccl_lines_give_the_share_of_communication_under_compute():
    gpu = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}
    runs = []
    for start in (0, 1000, 2000):  # PROFILE_RUNS runs: a 100 us NCCL kernel, half under a gemm
        runs += [
            {"ph": "X", "pid": 1, "name": "ncclDevKernel_AllToAll", "ts": start, "dur": 100},
            {"ph": "X", "pid": 1, "name": "nvjet_gemm", "ts": start + 50, "dur": 200},
        ]
    lines = overlap.nccl_lines({"traceEvents": [gpu, *runs]}, "probe")
    assert "communication 300.0 us, of it under compute 150.0 us (0.500)" in lines[0]
    assert "compute 0.20 ms, communication 0.10 ms, span 0.25 ms" in lines[1]


def _a2a_inputs(ndev: int = 4, rows: int = 8) -> np.ndarray:
    return np.stack([overlap.device_block(7, 0, p, (rows, 3), np.float32) for p in range(ndev)])


def test_check_rejects_a_misplaced_block_and_passes_the_reference():
    collective = overlap.COLLECTIVES["all_to_all"]
    want = overlap.comm_reference(collective, _a2a_inputs(), 1, np.float32)
    overlap.check_close("ok", want.copy(), want, "bfloat16")
    misplaced = want.copy()
    misplaced[0, :2], misplaced[0, 2:4] = want[0, 2:4], want[0, :2]  # two blocks swapped
    with pytest.raises(RuntimeError, match="exceeds"):
        overlap.check_close("swapped", misplaced, want, "bfloat16")
    with pytest.raises(RuntimeError, match="shape"):
        overlap.check_close("short", want[:, :4], want, "bfloat16")


def test_references_move_blocks_as_the_collectives_do():
    x = _a2a_inputs(ndev=2, rows=4)  # device d, rows [block 0 (2 rows), block 1 (2 rows)]
    a2a = overlap.COLLECTIVES["all_to_all"].reference(x)
    np.testing.assert_array_equal(a2a[1, :2], -x[0, 2:])  # device 1 gets device 0's block 1
    np.testing.assert_array_equal(overlap.COLLECTIVES["all_to_all"].reference(a2a), x)
    scattered = overlap.COLLECTIVES["psum_scatter"].reference(x)
    np.testing.assert_allclose(scattered[1, :2], (x[0, 2:] + x[1, 2:]) / 2)
    gathered = overlap.COLLECTIVES["all_gather"].reference(x)
    np.testing.assert_allclose(gathered[0], x[0] / 3 + x[1] * 2 / 3, rtol=1e-6)


def test_device_block_columns_are_a_prefix_and_never_zero():
    wide = overlap.device_block(3, 0, 5, (6, overlap.COLUMNS), np.float32)
    narrow = overlap.device_block(3, 0, 5, (6, overlap.CHECK_COLUMNS), np.float32)
    np.testing.assert_array_equal(wide[:, : overlap.CHECK_COLUMNS], narrow)
    assert wide.min() >= 1 and wide.max() < 2


def test_bytes_not_divisible_by_the_devices_is_rejected_naming_the_values():
    with pytest.raises(ValueError, match=r"--bytes 3000 .* 3 devices .* 3072"):
        overlap.buffer_rows(3000, 3, 2)
    assert overlap.buffer_rows(3 * overlap.COLUMNS * 2 * 4, 3, 2) == 12
    with pytest.raises(ValueError, match="--bytes 1000"):
        overlap.main(["--bytes", "1000", "--iters", "1"])


def test_balanced_matmul_count_and_hidden_fraction():
    assert overlap.balanced_matmuls_per_window(1e-3, 1e-4) == 10
    assert overlap.balanced_matmuls_per_window(1e-5, 1e-3) == 1
    with pytest.raises(ValueError, match="raise --matmul"):
        overlap.balanced_matmuls_per_window(1.0, 1e-6)
    assert overlap.hidden_fraction(2.0, 3.0, 3.0) == 1.0  # the comm fully hidden
    assert overlap.hidden_fraction(2.0, 3.0, 5.0) == 0.0  # serial
    assert overlap.hidden_fraction(2.0, 3.0, 6.0) < 0  # interference
    with pytest.raises(ValueError):
        overlap.hidden_fraction(0.0, 1.0, 1.0)


_WORD = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True).filter(
    lambda word: xla_options._parse_value(word) == word  # not read back as bool / number
)
_XLA_VALUES = st.one_of(
    st.integers(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), _WORD
)
_XLA = st.lists(st.tuples(st.from_regex(r"xla_[a-z_]{1,12}", fullmatch=True), _XLA_VALUES),
                max_size=3, unique_by=lambda item: item[0])  # fmt: skip
_ENV = st.lists(
    st.tuples(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True),
              st.from_regex(r"[A-Za-z0-9_=:./ -]{0,12}", fullmatch=True).map(str.strip)),
    max_size=3, unique_by=lambda item: item[0],
)  # fmt: skip


@given(st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True), _XLA, _ENV,
       st.sampled_from([None, *overlap.WINDOW_MODES]))  # fmt: skip
def test_variant_spec_round_trips(name, xla, env, windows):
    variant = overlap.Variant(name, tuple(xla), tuple(env), windows)
    assert overlap.parse_variant(f"{name}={variant.spec()}") == variant


@pytest.mark.parametrize(
    "text", ["noequals", "=env:A=1", "a b=", "v=tpu:A=1", "v=env:A", "v=env:A=1,", "v=xla:=1",
             "v=env:A=1,env:A=2", "v=opt:windows=fast", "v=opt:chain=3", "v=opt:windows",
             "v=opt:windows=free,opt:windows=pinned"],
)  # fmt: skip
def test_malformed_variants_are_rejected(text):
    with pytest.raises(ValueError):
        overlap.parse_variant(text)


def test_variants_take_the_outside_settings_and_override_them():
    args = overlap._parser().parse_args([
        "--xla-option", "xla_a=1", "--env", "E=outer", "--variant", "plain=",
        "--variant", "mine=env:E=inner,xla:xla_b=true",
    ])  # fmt: skip
    plain, mine = overlap.variants_of(args)
    assert plain == overlap.Variant("plain", (("xla_a", 1),), (("E", "outer"),))
    assert mine == overlap.Variant("mine", (("xla_a", 1), ("xla_b", True)), (("E", "inner"),))
    with pytest.raises(ValueError, match="differ"):
        overlap.variants_of(overlap._parser().parse_args(["--variant", "a=", "--variant", "a="]))


def test_variants_run_in_subprocesses_and_a_failing_one_is_reported(capsys):
    """SUBPROCESSES, ~10 s: three children in turn: defaults; env + a compile option (its
    XLA_FLAGS reach the child's backend: 4 devices instead of the 8 this process has) + free
    windows; an unknown compile option, which must fail visibly."""
    with pytest.raises(SystemExit, match=r"1 of 3 variant\(s\) failed: \['bad'\]"):
        overlap.main([*TINY, "--collectives", "all_to_all,psum_scatter",
                      "--variant", "plain=",
                      "--variant", "knobs=env:CUDA_DEVICE_MAX_CONNECTIONS=1,"
                      "env:XLA_FLAGS=--xla_force_host_platform_device_count=4,"
                      "xla:xla_gpu_use_memcpy_local_p2p=true,opt:windows=free",
                      "--variant", "bad=xla:no_such_option=1"])  # fmt: skip
    out = capsys.readouterr().out
    rows = _table_rows(out)
    measured = [(row[0], row[1]) for row in rows if not row[1].startswith("FAILED")]
    assert measured == [(v, c) for v in ("plain", "knobs") for c in ("all_to_all", "psum_scatter")]
    assert [row[2] for row in rows[:4]] == ["pinned"] * 2 + ["free"] * 2  # --windows, opt:
    for row in rows[:4]:
        _assert_measured(row)
    assert rows[4][0] == "bad" and "No such compile option" in rows[4][1], rows[4]
    assert "variant knobs (xla:xla_gpu_use_memcpy_local_p2p=true,env:CUDA_DEVICE_MAX" in out
    assert re.search(r"variant knobs \(.*,opt:windows=free\): 4 x cpu.* windows free;", out)
    assert re.search(r"variant plain \(defaults\): 8 x cpu", out)
    assert "variant bad failed" in out  # with its stderr tail


def test_two_processes_under_jax_distributed(capsys):
    """SUBPROCESS, ~8 s: 2 processes x 2 CPU devices (gloo); process 0 reports the row."""
    overlap.main([*TINY, "--processes", "2", "--collectives", "all_to_all"])
    out = capsys.readouterr().out
    (row,) = _table_rows(out)
    assert row[:2] == ["default", "all_to_all"]
    _assert_measured(row)
    assert "4 x cpu (cpu), 2 process(es)" in out
