"""The correctness check: it must pass the references and reject a wrong program."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.bench import overlap
from jtbo.bench.overlap import programs
from tests.bench.overlap import runs


def test_a_wrong_collective_program_fails_the_check(monkeypatch):
    right = overlap.COLLECTIVES["all_to_all"]

    def misplaced(received, sent, ndev):  # the blocks one place off, as a wrong split axis would
        return right.finish(jnp.roll(received, received.shape[0] // ndev, axis=0), sent, ndev)

    wrong = dataclasses.replace(right, finish=misplaced)
    monkeypatch.setitem(overlap.COLLECTIVES, "all_to_all", wrong)
    with pytest.raises(RuntimeError, match="all_to_all: comm alone"):
        overlap.main([*runs.TINY, "--collectives", "all_to_all"])


def test_a_wrong_matmul_chain_fails_the_check(monkeypatch):
    right = programs.matmul_chain
    monkeypatch.setattr(programs, "matmul_chain", lambda y, w, count: right(y, w, count + 1))
    with pytest.raises(RuntimeError, match="all_gather: compute alone"):
        overlap.main([*runs.TINY, "--collectives", "all_gather"])


def test_check_rejects_a_misplaced_block_and_passes_the_reference():
    x = np.stack([overlap.device_block(7, 0, p, (8, 3), np.float32) for p in range(4)])
    want = overlap.comm_reference(overlap.COLLECTIVES["all_to_all"], x, 1, np.float32)
    overlap.check_close("ok", want.copy(), want, "bfloat16")
    misplaced = want.copy()
    misplaced[0, :2], misplaced[0, 2:4] = want[0, 2:4], want[0, :2]  # two blocks swapped
    with pytest.raises(RuntimeError, match="exceeds"):
        overlap.check_close("swapped", misplaced, want, "bfloat16")
    with pytest.raises(RuntimeError, match="shape"):
        overlap.check_close("short", want[:, :4], want, "bfloat16")
