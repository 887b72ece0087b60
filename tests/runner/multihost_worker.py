"""One process of the multi-host test: ``python -m tests.runner.multihost_worker ID N PORT OUT``.

Sets up its own CPU platform (``TOTAL_DEVICES // N`` devices) before jax loads; with ``N > 1``
it joins the ``jax.distributed`` run at ``127.0.0.1:PORT`` as process ``ID`` with gloo CPU
collectives. It serves ``multihost_scenario`` (TBO off and on; with ``N > 1`` then the refusal
cases and an "auto" runner whose processes time differently) and pickles its results to
``OUT``. ``N = 1`` is the single-process reference run, with the same XLA flags as the
processes it is compared with.
"""

import inspect
import os
import pickle
import sys

from tests import gc_policy
from tests import xla_flags as test_xla_flags

TOTAL_DEVICES = 8


def xla_flags(num_processes: int) -> str:
    """The ``XLA_FLAGS`` of one of ``num_processes`` processes sharing ``TOTAL_DEVICES``."""
    count = TOTAL_DEVICES // num_processes
    return test_xla_flags.with_fast_compile(f"--xla_force_host_platform_device_count={count}")


# The arguments of jax's private cache writer that ``cache_every_process`` wraps; another
# jax whose writer differs is left alone (its process 1 then compiles as before).
_CACHE_WRITE_ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]


def cache_every_process() -> None:
    """Lets a process other than 0 write the programs it compiles to the persistent cache.

    jax writes cache entries from process 0 only (against write contention on shared file
    systems). A program of one process's own devices (a model's initializers, say) has a key
    of that process (``share_compiles``), so process 1 compiled it again in each run of the
    fault test. With its own entries written, a later runner or process 1 of a later run
    loads them, as process 0 does. Call after ``jax.distributed.initialize``.
    """
    import jax  # noqa: PLC0415 - only after the worker set the environment up
    from jax._src import compilation_cache, compiler, distributed  # noqa: PLC0415

    write = getattr(compiler, "_cache_write", None)
    if write is None or list(inspect.signature(write).parameters) != _CACHE_WRITE_ARGS:
        return
    if distributed.global_state.process_id == 0:  # jax writes process 0's entries itself
        return

    def write_own(cache_key, compile_time_secs, module_name, backend, executable):
        if compile_time_secs < jax.config.jax_persistent_cache_min_compile_time_secs:
            return  # jax's own threshold, as for process 0
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs)
        )

    compiler._cache_write = write_own


_HASH_DEVICES_ARGS = ["hash_obj", "accelerators"]
# The longest a process waits for process 0's executable (as long as the tests' runs).
SHARE_TIMEOUT_MS = 300_000


def share_compiles() -> None:
    """Process 0 compiles each program that spans the processes; the others load its executable.

    Every input of a program's persistent-cache key is alike on all processes of a run but the
    CPU topology's fingerprint, which differs per process, so each process compiled the same
    program itself. Keyed instead by the global devices it runs on (each one's id, process and
    kind), a program spanning the processes has one key on all of them, and jax's
    ``jax_share_binary_between_hosts`` has process 0 compile it and hand the executable to the
    others through the run's key-value store (the same program, compiled once). A program of one
    process's devices keeps a key of that process. Call after ``jax.distributed.initialize``;
    a jax whose key function differs is left alone (each process then compiles, as before).
    """
    import jax  # noqa: PLC0415 - only after the worker set the environment up
    from jax._src import cache_key  # noqa: PLC0415

    hash_topology = getattr(cache_key, "_hash_accelerator_config", None)
    if (
        hash_topology is None
        or list(inspect.signature(hash_topology).parameters) != _HASH_DEVICES_ARGS
        or not hasattr(jax.config, "jax_share_binary_between_hosts")
    ):
        return

    def hash_devices(hash_obj, accelerators):
        for device in accelerators.flat:
            hash_obj.update(f"{device.id}/{device.process_index}/{device.device_kind};".encode())

    cache_key._hash_accelerator_config = hash_devices
    jax.config.update("jax_share_binary_between_hosts", True)
    jax.config.update("jax_share_binary_between_hosts_timeout_ms", SHARE_TIMEOUT_MS)


def set_up(process_id: int, num_processes: int, port: str):
    """Sets up this process before jax loads: its CPU platform (``xla_flags``), and with
    ``num_processes > 1`` the ``jax.distributed`` run at ``127.0.0.1:port`` with gloo CPU
    collectives (``cache_every_process``, ``share_compiles``); then imports the scenario and
    takes the test processes' collector settings (``gc_policy``).

    Returns:
      The ``multihost_scenario`` module.
    """
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = xla_flags(num_processes)
    import jax  # noqa: PLC0415 - only after the environment above is set

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=num_processes,
            process_id=process_id,
        )
        cache_every_process()
        share_compiles()
    from tests.runner import multihost_scenario  # noqa: PLC0415 - imports jax-using modules

    gc_policy.collect_less()
    gc_policy.freeze_imported()
    return multihost_scenario


def main(argv: list[str]) -> None:
    """Runs the scenario as one process (see the module docstring).

    Args:
      argv: ``[process_id, num_processes, port, out_path]``.
    """
    process_id, num_processes, port, out_path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    scenario = set_up(process_id, num_processes, port)
    results = scenario.run(num_processes)
    with open(out_path, "wb") as f:
        pickle.dump(results, f)
    if num_processes > 1:
        import jax  # noqa: PLC0415 - loaded by set_up, after the environment

        jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
