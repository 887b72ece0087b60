"""``python -m jtbo.generate``: serve a Hugging Face MoE checkpoint (``jtbo.cli.generate``).

Example::

    python -m jtbo.generate --model DIR --prompt "Hello" --max-new-tokens 32 --tbo auto

The platform is chosen here, before jax starts (``jtbo.info.platform``): on a machine
without an NVIDIA GPU the command runs on ``dp * attn_tp`` virtual CPU devices.
"""

import sys

from jtbo.info import platform


def _configure_platform(argv: list[str]) -> None:
    from jtbo.cli import generate as generate_cli  # noqa: PLC0415 - imports jax: not before

    args, _ = generate_cli.parser().parse_known_args(argv)  # exits 2 on a bad flag
    platform.configure_platform(cpu_devices=(args.dp or 1) * args.attn_tp)


if __name__ == "__main__":
    _configure_platform(sys.argv[1:])
    from jtbo.cli import generate as generate_cli

    sys.exit(generate_cli.main())
