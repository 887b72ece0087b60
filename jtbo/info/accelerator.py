"""Which accelerator set-up to install: an NVIDIA GPU, found with ``nvidia-smi -L``, or the CPU.

Imports nothing beyond the standard library (no jax, not even jtbo's dependencies), so the
Makefile runs it from the source tree before anything is installed::

    python -m jtbo.info.accelerator --gpu auto --print extras   # test,aot[,cuda12]

``--gpu 1`` / ``--gpu 0`` force the choice (``make demo GPU=1``).
"""

import argparse
import dataclasses
import shutil
import subprocess
import sys

BASE_EXTRAS = ("test", "aot")  # installed on every machine (aot: 8xH200 compiles on the CPU)
GPU_EXTRAS = ("cuda12",)  # added where an NVIDIA GPU is found or forced
_SMI_TIMEOUT_S = 20  # nvidia-smi can be slow while the driver initialises


@dataclasses.dataclass(frozen=True)
class Detection:
    """The accelerator chosen and why."""

    accelerator: str  # "gpu" or "cpu"
    reason: str  # e.g. "nvidia-smi -L lists 8 GPUs" or "forced by GPU=0"


def _nvidia_smi_gpus() -> tuple[list[str], str]:
    """Runs ``nvidia-smi -L``.

    Returns:
      The lines naming a GPU (empty when none), and a description of what happened.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH"
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return [], f"nvidia-smi -L failed: {err}"
    if out.returncode != 0:
        return [], f"nvidia-smi -L exited {out.returncode}: {out.stderr.strip()[:200]}"
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return gpus, f"nvidia-smi -L lists {len(gpus)} GPU(s)"


def detect_accelerator(gpu: str = "auto") -> Detection:
    """Chooses the GPU or the CPU set-up.

    Args:
      gpu: ``"auto"`` (detect with ``nvidia-smi -L``), ``"1"`` (force GPU) or ``"0"`` (CPU).

    Returns:
      The choice and its reason; "gpu" only when forced or ``nvidia-smi -L`` succeeds and
      lists at least one GPU.

    Raises:
      ValueError: ``gpu`` is none of the three.
    """
    if gpu in ("0", "1"):
        return Detection("gpu" if gpu == "1" else "cpu", f"forced by GPU={gpu}")
    if gpu != "auto":
        raise ValueError(f"gpu must be 'auto', '1' or '0', got {gpu!r}")
    gpus, reason = _nvidia_smi_gpus()
    return Detection("gpu" if gpus else "cpu", reason)


def install_extras(accelerator: str) -> tuple[str, ...]:
    """The ``pip install '.[...]'`` extras for ``accelerator`` ("gpu" or "cpu").

    Raises:
      ValueError: an unknown accelerator.
    """
    if accelerator not in ("gpu", "cpu"):
        raise ValueError(f"accelerator must be 'gpu' or 'cpu', got {accelerator!r}")
    return BASE_EXTRAS + (GPU_EXTRAS if accelerator == "gpu" else ())


def main(argv: list[str] | None = None) -> int:
    """Prints the accelerator, the extras or the reason for the Makefile; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m jtbo.info.accelerator")
    parser.add_argument("--gpu", default="auto", choices=("auto", "1", "0"))
    parser.add_argument("--print", dest="what", default="accelerator",
                        choices=("accelerator", "extras", "reason"))  # fmt: skip
    args = parser.parse_args(argv)
    detection = detect_accelerator(args.gpu)
    values = {
        "accelerator": detection.accelerator,
        "extras": ",".join(install_extras(detection.accelerator)),
        "reason": detection.reason,
    }
    print(values[args.what])
    return 0


if __name__ == "__main__":
    sys.exit(main())
