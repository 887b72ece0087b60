"""README.md's quickstart (its first Python block), run as a user runs it: saved as a script in
a folder outside the checkout and run there by a given interpreter, without ``JAX_PLATFORMS``
and without a device count in ``XLA_FLAGS`` (the block's own ``jtbo.configure_platform``
chooses the platform and the CPU devices). ``XLA_FLAGS`` holds only the compile-speed flags
every test process runs with (``tests.xla_flags.FAST_COMPILE_FLAGS``): they change how much
XLA optimizes the CPU machine code, not what the script computes. The README test runs it with
the checkout's interpreter, the wheel test with the fresh venv's; their step programs are the
same, so the run's compilation cache compiles them once."""

import ast
import os
import pathlib
import re
import subprocess

from tests import xla_flags

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def script_text() -> str:
    """The first ```python block of README.md."""
    match = re.search(r"^```python\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def run(python: pathlib.Path | str, folder: pathlib.Path, epilogue: str = ""):
    """Runs the quickstart, then ``epilogue`` (more lines of the same script), with
    ``python`` in ``folder``.

    Returns:
      ``(the quickstart's results: one list of token ids per prompt, stdout)``; asserts that the
      script exited 0 without a traceback.
    """
    script = folder / "quickstart.py"
    script.write_text(script_text() + epilogue)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["XLA_FLAGS"] = xla_flags.FAST_COMPILE_FLAGS
    env.pop("PYTHONPATH", None)  # the checkout must not be on the path
    done = subprocess.run([str(python), str(script)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    printed = [line for line in done.stdout.splitlines() if line.startswith("[")]
    return ast.literal_eval(printed[-1]), done.stdout
