"""``python -m jtbo.demo`` (``make demo``): the end-to-end model demo of ``jtbo.runner.demo``.

Serves random prompts through a tiny MoE model with two-batch overlap off and on and exits
non-zero if the two runs disagree. The host-planning demo is ``python -m jtbo.split.demo``.

The environment is set here, before anything imports jax: on a machine without an NVIDIA
GPU the demo runs on 8 virtual CPU devices, and ``JAX_PLATFORMS=cpu`` keeps the CUDA plugin
of the ``aot`` extra from failing to initialise (the 8xH200 overlap report still compiles).
"""

import os
import sys


def _configure_cpu_if_no_gpu() -> None:
    if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidiactl"):
        os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()


if __name__ == "__main__":
    _configure_cpu_if_no_gpu()
    from jtbo.runner import demo

    sys.exit(demo.main())
