"""jtbo under ``jax.distributed``: 2 processes x 4 CPU devices == 1 process x 8 devices.

Two child processes (``multihost_worker``) join a ``jax.distributed`` run on localhost with gloo
CPU collectives and serve ``multihost_scenario`` (a forward script and greedy generation, TBO
off and on) over a ``(4, 2)`` mesh spanning both; each passes only its own DP ranks' batches.
Meanwhile this test process serves the same scenario alone on its 8 devices (the XLA flags
conftest set are those of ``multihost_worker.xla_flags(1)``). Together the two processes'
outputs must equal the single process's; then the refusal cases must have raised on both
processes, and "auto" runners whose processes time the programs differently must have made one
choice. Every child is killed in a ``finally``, on timeout or on any failure.
"""

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import chex
import numpy as np
import pytest

from tests.runner import multihost_scenario, multihost_worker

NUM_PROCESSES = 2
# About 60 s alone on a 2-core machine with the auto-TBO scenario; 150 s ran out when other
# test processes shared the cores.
TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[2]
# The same program, with gloo instead of in-process all-reduces: summation order may differ.
TOL = dict(atol=5e-5, rtol=5e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(process_id: int, num_processes: int, port: int, out: Path, log: Path):
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = multihost_worker.xla_flags(num_processes)
    args = [str(process_id), str(num_processes), str(port), str(out)]
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.runner.multihost_worker", *args],
            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-40:])


def _wait(procs, logs, deadline) -> None:
    for name, proc, log in zip(("process 0", "process 1"), procs, logs, strict=True):
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} ran past {TIMEOUT_S} s:\n{_tail(log)}")
        if code != 0:
            pytest.fail(f"{name} exited with {code}:\n{_tail(log)}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(per-process results, single-process results); the children always end."""
    tmp = tmp_path_factory.mktemp("multihost")
    port, deadline = _free_port(), time.monotonic() + TIMEOUT_S
    outs = [tmp / f"out{i}.pkl" for i in range(NUM_PROCESSES)]
    logs = [tmp / f"log{i}.txt" for i in range(NUM_PROCESSES)]
    procs = []
    try:
        for i in range(NUM_PROCESSES):
            procs.append(_start(i, NUM_PROCESSES, port, outs[i], logs[i]))
        single = multihost_scenario.run(1)  # the single-process reference, here meanwhile
        _wait(procs, logs, deadline)
        results = [pickle.loads(out.read_bytes()) for out in outs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return results, single


def test_each_process_drives_the_dp_ranks_its_devices_hold(runs):
    per_process, _ = runs
    assert [p["local_dp_ranks"] for p in per_process] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("tbo", [False, True])
def test_logits_and_tokens_equal_the_single_process_run(runs, tbo):
    per_process, single = runs
    want = {k: v for k, v in single.items() if k.startswith(f"{tbo}/logits/")}
    got = {}
    for process_id, results in enumerate(per_process):
        for key, value in results.items():
            if key.startswith(f"{tbo}/logits/"):
                rank = int(key.rsplit("/", 1)[1])
                assert rank in results["local_dp_ranks"], (process_id, key)  # own ranks only
                got[key] = value
    assert sorted(got) == sorted(want) and len(want) >= 10
    chex.assert_trees_all_close(got, want, **TOL)
    for results in per_process:  # every process returns every prompt's result
        assert results[f"{tbo}/tokens"] == single[f"{tbo}/tokens"]
        assert results[f"{tbo}/errors"] == single[f"{tbo}/errors"]
        assert results[f"{tbo}/tbo_steps"] == single[f"{tbo}/tbo_steps"]
    tokens = single[f"{tbo}/tokens"]
    assert sum(len(t) == multihost_scenario.NEW_TOKENS for t in tokens) == len(tokens) - 1
    assert (single[f"{tbo}/tbo_steps"] > 0) == tbo


def test_sampling_streaming_and_step_logs_work_alike_across_processes(runs):
    # One generate loop: sampled tokens, log-probabilities and refusals on every process equal
    # the single process's; each process streams exactly its own ranks' prompts, in the
    # single process's order; the processes' step logs together hold the single run's tokens.
    per_process, single = runs
    owner = {i: (i % multihost_scenario.DP) // 2 for i in range(len(single["sampled/tokens"]))}
    served = [i for i, error in enumerate(single["sampled/errors"]) if error is None]
    assert len(served) == len(owner) - 1
    for process_id, results in enumerate(per_process):
        assert results["sampled/tokens"] == single["sampled/tokens"]
        assert results["sampled/errors"] == single["sampled/errors"]
        got = [np.asarray(p, np.float64) for p in results["sampled/logprobs"] if p is not None]
        want = [np.asarray(p, np.float64) for p in single["sampled/logprobs"] if p is not None]
        chex.assert_trees_all_close(got, want, **TOL)
        mine = [(i, t) for i, t in single["sampled/streamed"] if owner[i] == process_id]
        assert results["sampled/streamed"] == mine and mine
    total = sum(sum(results["sampled/step_tokens"]) for results in per_process)
    assert total == sum(single["sampled/step_tokens"]) > 0
    greedy = single["True/tokens"]
    assert single["sampled/tokens"] != greedy  # the draws are not the argmax


def test_tbo_on_and_off_generate_the_same_tokens(runs):
    per_process, _ = runs
    assert per_process[0]["True/tokens"] == per_process[0]["False/tokens"]


def test_a_refused_batch_raises_on_every_process(runs):
    (first, second), _ = runs
    a, b = first["refusals"], second["refusals"]
    # Process 1 refused its own batches; process 0 learns why instead of hanging.
    assert b["count"].startswith("ValueError: got 1 batches for the 2 DP ranks (2, 3)")
    assert a["count"].startswith("StepRejectedError: another process refused the step: process 1")
    assert "got 1 batches" in a["count"]
    assert b["vocabulary"].startswith("ValueError: rank 2: token ids span [1, 500]")
    assert "process 1: ValueError: rank 2: token ids span" in a["vocabulary"]
    # A bucket overflow is found by every process's own planning from the exchanged counts.
    assert a["bucket"] == b["bucket"] == "ValueError: num_tokens=40 exceeds the largest bucket 32"
    for out in (a, b):
        assert out["setup"].startswith("StepRejectedError: processes disagree on fingerprint")
    # Both processes keep serving; rank 0 and rank 2 ran the same 3-token prompt.
    assert a["after"].shape == (3, 128) and np.isfinite(a["after"]).all()
    np.testing.assert_array_equal(a["after"], b["after"])


def test_auto_runners_of_every_process_make_the_same_choice(runs):
    (first, second), single = runs
    # Agreed from both processes' timings (multihost_scenario.AUTO_TIMINGS): the max of each.
    want = [("EXTEND", 32, False, 10.0, 9.9), ("DECODE", 32, True, 10.0, 9.5)]
    assert first["auto/decisions"] == second["auto/decisions"] == want
    assert first["auto/tbo_steps"] == second["auto/tbo_steps"] == 2  # the two decode steps
    for results in (first, second):  # extend ran plain, decode TBO: each fixed mode's logits
        for key, value in results.items():
            if key.startswith("auto/logits/"):
                step = int(key.split("/")[2])
                fixed = single[f"{step >= 2}/logits/{key.split('/', 2)[2]}"]
                chex.assert_trees_all_close(value, fixed, **TOL)
