"""README.md's quickstart, the first Python block, runs as written: saved as a script in a
temporary folder and run there by this interpreter, as a user would (no ``JAX_PLATFORMS`` and
no device count in ``XLA_FLAGS``: the block's own ``jtbo.configure_platform`` chooses the
platform; ``readme_quickstart``)."""

import sys

import pytest

from jtbo.info import platform
from tests import readme_quickstart


def test_the_quickstart_runs_as_written_from_another_folder(tmp_path):
    if platform.nvidia_gpu_present():
        pytest.skip("the quickstart's 8-device mesh runs on the CPU or on 8 GPUs")
    results, _ = readme_quickstart.run(sys.executable, tmp_path)
    assert [len(tokens) for tokens in results] == [16, 16]
    assert all(isinstance(token, int) for tokens in results for token in tokens)
