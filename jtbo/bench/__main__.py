"""Runs one benchmark: ``python -m jtbo.bench NAME [flags]``; ``--help`` lists them.

Each benchmark is a module ``jtbo.bench.NAME`` with ``main(argv: list[str]) -> None``. The
platform is chosen first (``jtbo.info.platform``: the CPU where no NVIDIA GPU is present);
the first line printed is ``jtbo.info.summary_line()``. A bench module that sets
``CONFIGURES_JAX = True`` sets XLA / NCCL variables or jax options in its ``main`` before the
backend starts, so its summary line names no devices (starting the backend here would fix
them too early).
"""

import importlib
import pkgutil
import sys

import jtbo.bench
from jtbo.info import platform, report

EXIT_USAGE = 2  # no or an unknown benchmark name


def _available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(jtbo.bench.__path__) if m.name != "__main__")


def _usage(names: list[str]) -> str:
    lines = [f"usage: python -m jtbo.bench {{{','.join(names)}}} [flags]", "", "benchmarks:"]
    lines += [f"  {name}" for name in names]
    lines.append("`python -m jtbo.bench NAME --help` lists a benchmark's flags.")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Dispatches to the benchmark named by ``argv[0]``.

    Args:
      argv: the benchmark's name and its flags, or ``--help`` / ``-h``.

    Returns:
      0 after the benchmark or ``--help``; ``EXIT_USAGE`` (usage on stderr) for no or an
      unknown name.
    """
    names = _available()
    if argv and argv[0] in ("-h", "--help"):
        print(_usage(names))
        return 0
    if not argv or argv[0] not in names:
        print(_usage(names), file=sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(f"jtbo.bench.{argv[0]}")
    print(report.summary_line(start_backend=not getattr(module, "CONFIGURES_JAX", False)))
    module.main(argv[1:])
    return 0


if __name__ == "__main__":
    platform.configure_platform()  # the CPU where no NVIDIA GPU is present, without a traceback
    sys.exit(main(sys.argv[1:]))
