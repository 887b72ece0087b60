"""``python -m jtbo.info``: the report to paste into a bug report.

Reports the environment as it is: it sets no ``JAX_PLATFORMS`` or ``XLA_FLAGS`` itself.
"""

import sys

from jtbo.info import report


def main() -> int:
    """Prints the summary line and every section; returns 0."""
    print(report.summary_line())
    print(report.render(report.sections()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
