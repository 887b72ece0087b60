"""``python -m jtbo.demo`` (``make demo``): the end-to-end model demo of ``jtbo.cli.demo``.

Serves random prompts through a tiny MoE model with two-batch overlap off and on and exits
non-zero if the two runs disagree. The host-planning demo is ``python -m jtbo.split.demo``.

The platform is chosen here, before anything imports jax (``jtbo.info.platform``): on a
machine without an NVIDIA GPU the demo runs on 8 virtual CPU devices, without the CUDA
plugin's attempt to start (the 8xH200 overlap report still compiles).
"""

import sys

from jtbo.info import platform

DEMO_CPU_DEVICES = 8

if __name__ == "__main__":
    platform.configure_platform(cpu_devices=DEMO_CPU_DEVICES)
    from jtbo.cli import demo

    sys.exit(demo.main())
