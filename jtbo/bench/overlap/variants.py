"""``--variant NAME=SPEC``: named sets of compile options, environment variables and probe
options, parsed and put on top of the ``--xla-option`` / ``--env`` given outside."""

import argparse
import dataclasses
import re

from jtbo.bench.overlap import programs as programs_lib
from jtbo.overlap import xla_options

OptionValue = str | int | bool | float


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of compile options, environment variables and probe options, run in its
    own process."""

    name: str
    xla: tuple[tuple[str, OptionValue], ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    windows: str | None = None  # WINDOW_MODES; None: --windows

    def spec(self) -> str:
        """The SPEC that ``parse_variant`` reads back into this variant ("" for defaults)."""
        items = [f"xla:{key}={format_option_value(value)}" for key, value in self.xla]
        items += [f"env:{key}={value}" for key, value in self.env]
        return ",".join(items + ([f"opt:windows={self.windows}"] if self.windows else []))


def format_option_value(value: OptionValue) -> str:
    """Writes a compile option value so that ``parse_option`` reads the same value back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def parse_env(text: str) -> tuple[str, str]:
    """Parses ``KEY=VALUE`` into an environment variable.

    Raises:
      ValueError: no ``=``, or a key that is empty or holds whitespace.
    """
    key, sep, value = text.partition("=")
    if not sep or not key or re.search(r"\s", key):
        raise ValueError(f"environment setting must be KEY=VALUE, got {text!r}")
    return key, value


def parse_probe_option(text: str) -> tuple[str, str]:
    """Parses a variant's ``opt:`` item: ``windows=free`` or ``windows=pinned``.

    Raises:
      ValueError: another key (``windows`` is the only probe option) or mode.
    """
    modes = programs_lib.WINDOW_MODES
    key, sep, value = text.partition("=")
    if not sep or key != "windows" or value not in modes:
        raise ValueError(f"probe option must be windows={'|'.join(modes)}, got {text!r}")
    return key, value


_ITEM_PARSERS = {"xla": xla_options.parse_option, "env": parse_env, "opt": parse_probe_option}
"""A SPEC item's prefix -> the parser of what follows it."""


def parse_variant(text: str) -> Variant:
    """Parses ``NAME=SPEC`` (SPEC: comma-separated ``xla:K=V`` / ``env:K=V`` /
    ``opt:windows=MODE``, may be empty).

    Args:
      text: e.g. ``"p2p_off=env:NCCL_P2P_DISABLE=1,xla:xla_gpu_use_memcpy_local_p2p=false"``.

    Returns:
      The variant; values cannot hold commas.

    Raises:
      ValueError: no ``=``, a name other than letters, digits and ``_.-``, an item without a
        ``xla:`` / ``env:`` / ``opt:`` prefix or ``=``, an empty item, an unknown probe
        option, or a key given twice.
    """
    name, sep, spec = text.partition("=")
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"variant must be NAME=SPEC with NAME of [A-Za-z0-9_.-], got {text!r}")
    settings = {kind: {} for kind in _ITEM_PARSERS}
    for item in spec.split(",") if spec else []:
        kind, colon, setting = item.strip().partition(":")
        if not colon or kind not in _ITEM_PARSERS:
            raise ValueError(f"variant {name!r}: item {item!r} must start with xla:, env: or opt:")
        key, value = _ITEM_PARSERS[kind](setting)
        if key in settings[kind]:
            raise ValueError(f"variant {name!r} sets {kind}:{key} twice")
        settings[kind][key] = value
    xla, env, opt = (settings[kind] for kind in ("xla", "env", "opt"))
    return Variant(name, tuple(xla.items()), tuple(env.items()), opt.get("windows"))


def _with_base(variant: Variant, xla: dict, env: dict) -> Variant:
    """The variant on top of the settings given outside it (the variant's own win)."""
    return dataclasses.replace(
        variant, xla=tuple({**xla, **dict(variant.xla)}.items()),
        env=tuple({**env, **dict(variant.env)}.items()),
    )  # fmt: skip


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """The variants a command line asks for, ``--xla-option`` / ``--env`` applied to each.

    Raises:
      ValueError: a malformed ``--variant`` or two variants of one name.
    """
    xla = dict(xla_options.parse_option(text) for text in args.xla_option)
    env = dict(parse_env(text) for text in args.env)
    given = [parse_variant(text) for text in args.variant] or [Variant("default")]
    names = [variant.name for variant in given]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names must differ, got {names}")
    return [_with_base(variant, xla, env) for variant in given]
