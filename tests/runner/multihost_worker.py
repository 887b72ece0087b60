"""One process of the multi-host test: ``python -m tests.runner.multihost_worker ID N PORT OUT``.

Sets up its own 4-device CPU platform and gloo collectives before jax loads, joins the
``jax.distributed`` run at ``127.0.0.1:PORT`` as process ``ID`` of ``N``, runs the scenario
(``multihost_scenario``: TBO off and on, then the refusal cases) and pickles its results to
``OUT``.
"""

import os
import pickle
import sys

LOCAL_DEVICES = 4


def main(argv: list[str]) -> None:
    """Runs the scenario as one process of a ``jax.distributed`` run (see the module docstring).

    Args:
      argv: ``[process_id, num_processes, port, out_path]``.
    """
    process_id, num_processes, port, out_path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    import jax  # noqa: PLC0415 - only after the environment above is set

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )
    from tests.runner import multihost_scenario  # noqa: PLC0415 - imports jax-using modules

    results, plain = multihost_scenario.serve(False)
    results.update(multihost_scenario.serve(True)[0])
    results["refusals"] = multihost_scenario.refusals(plain)
    with open(out_path, "wb") as f:
        pickle.dump(results, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
