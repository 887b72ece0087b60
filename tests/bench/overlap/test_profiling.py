"""``--profile DIR``: traces of the comm-alone and both programs, and what a GPU trace says
about overlap."""

from jtbo.bench import overlap
from tests.bench.overlap import runs


def test_profile_writes_traces_of_the_comm_and_both_programs(tmp_path, capsys):
    overlap.main([*runs.TINY, "--collectives", "psum_scatter", "--profile", str(tmp_path)])
    out = capsys.readouterr().out
    for program in ("comm", "both"):
        folder = tmp_path / f"default_psum_scatter_{program}" / "process_0"
        assert list(folder.glob("**/*.trace.json.gz"))
        assert f"traces written to {folder}" in out  # CPU: no NCCL attribution


def test_nccl_lines_give_the_share_of_communication_under_compute():
    gpu = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}
    events = []
    for start in (0, 1000, 2000):  # PROFILE_RUNS runs: a 100 us NCCL kernel, half under a gemm
        events += [
            {"ph": "X", "pid": 1, "name": "ncclDevKernel_AllToAll", "ts": start, "dur": 100},
            {"ph": "X", "pid": 1, "name": "nvjet_gemm", "ts": start + 50, "dur": 200},
        ]
    lines = overlap.nccl_lines({"traceEvents": [gpu, *events]}, "probe")
    assert "communication 300.0 us, of it under compute 150.0 us (0.500)" in lines[0]
    assert "compute 0.20 ms, communication 0.10 ms, span 0.25 ms" in lines[1]
    assert lines[2] == "probe: largest compute kernels per GPU and step: nvjet_gemm 0.20 ms x 1"
