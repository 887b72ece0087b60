"""Argument types shared by the benches' command lines: a bad value stops argparse (exit 2,
one line naming the flag) before anything compiles."""

import argparse


def positive_int(text: str) -> int:
    """An integer flag that must be >= 1.

    Args:
      text: the flag's value as typed.

    Returns:
      The integer.

    Raises:
      argparse.ArgumentTypeError: not an integer >= 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
