"""Command-line flags derived from a frozen dataclass of a benchmark's options.

Each field is made with ``option``, which keeps its argparse settings (help, argument type,
choices, ...) in the field's metadata; ``add_arguments`` adds one ``--field-name`` flag per
field with the field's default, and ``from_namespace`` reads the parsed flags back into the
dataclass. A flag's settings live beside its field, so the options read as one table.
"""

import argparse
import dataclasses
from typing import Any

_ARGPARSE = "argparse"  # the metadata key of a field's argparse settings


def option(default: Any = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is also a command-line flag.

    Args:
      default: the field's and the flag's default (a list is copied for each instance).
      **argparse_kwargs: ``ArgumentParser.add_argument`` settings (``help``, ``type``,
        ``choices``, ``nargs``, ``action``, ``metavar``), only those given.

    Returns:
      The ``dataclasses.field``.
    """
    metadata = {_ARGPARSE: argparse_kwargs}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def add_arguments(parser: argparse.ArgumentParser, options_class: type) -> None:
    """Adds one ``--name`` flag per field of ``options_class`` (in field order).

    Args:
      parser: the parser (or argument group) to add to.
      options_class: a dataclass whose fields were made with ``option``.

    Raises:
      ValueError: a field not made with ``option``.
    """
    for field in dataclasses.fields(options_class):
        if _ARGPARSE not in field.metadata:
            raise ValueError(f"{options_class.__name__}.{field.name} is not an option()")
        flag = "--" + field.name.replace("_", "-")
        parser.add_argument(flag, default=_default(field), **field.metadata[_ARGPARSE])


def from_namespace(options_class: type, namespace: argparse.Namespace) -> Any:
    """The options of a parsed command line.

    Args:
      options_class: the dataclass whose flags ``add_arguments`` added.
      namespace: the parsed flags (other attributes are ignored).

    Returns:
      An ``options_class`` of the flags' values.
    """
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(options_class)}
    return options_class(**values)
