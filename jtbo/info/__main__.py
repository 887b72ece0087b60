"""``python -m jtbo.info``: the report to paste into a bug report.

Reports the environment as it is, with one choice made first (``jtbo.info.platform``): where
``JAX_PLATFORMS`` is unset and no NVIDIA GPU is present it runs on the CPU, so the CUDA
plugin of the ``aot`` extra prints no traceback; the second line of the output says so.
"""

import sys

from jtbo.info import platform, report


def main(choice: platform.PlatformChoice) -> int:
    """Prints the summary line, the platform ``choice`` and every section; returns 0."""
    print(report.summary_line())
    print(f"jax platform: {choice.platform or '(jax picks)'} ({choice.reason})")
    print(report.render(report.sections()))
    return 0


if __name__ == "__main__":
    sys.exit(main(platform.configure_platform()))
