"""``python -m jtbo.generate``: serve a Hugging Face MoE checkpoint (``jtbo.runner.generate_cli``).

Example::

    python -m jtbo.generate --model DIR --prompt "Hello" --max-new-tokens 32 --tbo auto

The environment is set here, before jax starts: on a machine without an NVIDIA GPU the
command runs on ``dp * attn_tp`` virtual CPU devices (``JAX_PLATFORMS=cpu`` also keeps the
CUDA plugin of the ``aot`` extra from failing to initialise).
"""

import os
import sys


def _configure_cpu_if_no_gpu(argv: list[str]) -> None:
    if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["JAX_PLATFORMS"] = "cpu"
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return
    from jtbo.runner import generate_cli

    args, _ = generate_cli.parser().parse_known_args(argv)
    devices = (args.dp or 1) * args.attn_tp
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"


if __name__ == "__main__":
    _configure_cpu_if_no_gpu(sys.argv[1:])
    from jtbo.runner import generate_cli

    sys.exit(generate_cli.main())
