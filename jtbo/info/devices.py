"""The devices jax sees, with their kind and memory, and the platform in one phrase."""

import collections

import jax

_GIB = 1024**3


def _memory(device) -> str:
    """``device``'s memory from ``memory_stats()``, or why it is not reported."""
    stats = device.memory_stats()
    if not stats:
        return "memory: not reported by this backend"
    limit = stats.get("bytes_limit")
    used = stats.get("bytes_in_use", 0)
    total = f"{limit / _GIB:.1f} GiB" if limit else "limit unknown"
    return f"memory: {total}, {used / _GIB:.2f} GiB in use"


def device_lines() -> list[str]:
    """One line per device: id, platform, kind, process and memory.

    Raises:
      RuntimeError: jax cannot start a backend (the caller reports it).
    """
    return [
        f"{d.id}: {d.platform} {d.device_kind!r} process {d.process_index}; {_memory(d)}"
        for d in jax.devices()
    ]


def platform_phrase() -> str:
    """``"cpu x8"`` or ``"gpu x2 (NVIDIA H200)"``: the default backend's devices."""
    devices = jax.devices()
    kinds = collections.Counter(d.device_kind for d in devices)
    phrase = f"{jax.default_backend()} x{len(devices)}"
    if devices[0].platform == "cpu":
        return phrase
    return f"{phrase} ({', '.join(kinds)})"
