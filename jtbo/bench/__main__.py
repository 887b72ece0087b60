"""Runs one benchmark: ``python -m jtbo.bench NAME [flags]``.

Each benchmark is a module ``jtbo.bench.NAME`` with ``main(argv: list[str]) -> None``.
"""

import importlib
import pkgutil
import sys

import jtbo.bench


def _available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(jtbo.bench.__path__) if m.name != "__main__")


def main(argv: list[str]) -> None:
    """Dispatches to the benchmark named by ``argv[0]``.

    Raises:
      SystemExit: no or an unknown benchmark name.
    """
    names = _available()
    if not argv or argv[0] not in names:
        raise SystemExit(f"usage: python -m jtbo.bench {{{','.join(names)}}} [flags]")
    importlib.import_module(f"jtbo.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
