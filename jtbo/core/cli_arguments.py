"""Argument types shared by jtbo's command lines (``python -m jtbo.generate``, the benches): a
bad value stops argparse (exit 2, one line naming the flag) before anything loads or compiles."""

import argparse
import pathlib


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """An integer flag that must be >= 1.

    Args:
      text: the flag's value as typed.

    Returns:
      The integer.

    Raises:
      argparse.ArgumentTypeError: not an integer >= 1.
    """
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer flag that must be >= 0 (a depth where 0 turns a feature off).

    Raises:
      argparse.ArgumentTypeError: not an integer >= 0.
    """
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def non_negative_float(text: str) -> float:
    """A number flag that must be >= 0 (a temperature, a timeout).

    Raises:
      argparse.ArgumentTypeError: not a number >= 0.
    """
    value = _float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number flag in (0, 1] (a top-p mass).

    Raises:
      argparse.ArgumentTypeError: not a number in (0, 1].
    """
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def existing_directory(text: str) -> pathlib.Path:
    """A path flag that must name a directory.

    Raises:
      argparse.ArgumentTypeError: no directory at that path.
    """
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return path


def existing_file(text: str) -> pathlib.Path:
    """A path flag that must name a readable file.

    Raises:
      argparse.ArgumentTypeError: no file at that path.
    """
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return path


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, without the usage
    block (``--help`` still prints it): ``PROG: error: MESSAGE (--help lists the flags)``."""

    def error(self, message: str):
        """Prints the one line and exits 2, as argparse's own errors do."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")
