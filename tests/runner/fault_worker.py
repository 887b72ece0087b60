"""One process of the fault test: ``python -m tests.runner.fault_worker ID N PORT FAULT``.

Joins a ``jax.distributed`` run of ``N`` processes (gloo, ``TOTAL_DEVICES // N`` CPU devices
each) and runs greedy generation on a ``(4, 2)`` mesh over all of them. On process 1 it injects
``FAULT`` (``FAULTS``): a ``kill -9`` of itself in the first prefill or decode step, or an
exception in ``planning.assemble`` or in the greedy loop. With ``raise_generate_stay`` the
process catches its own error and stays alive for ``STAY_S`` (a caller that keeps the process
up: its peers cannot learn of the failure from a closed connection), then exits
``STAY_EXIT_CODE``. Prints ``generated`` and exits 0 when no fault fired; the test checks
that every process ends in time with the right message.
"""

import os
import signal
import sys
import time

from tests.runner import multihost_worker

PEER_TIMEOUT_S = 4.0
FAULT_PROCESS = 1
FAULTS = (
    "kill_prefill", "kill_decode", "raise_assemble", "raise_generate", "raise_generate_stay",
    "none",
)  # fmt: skip
STAY_S = 40.0
STAY_EXIT_CODE = 5


def _inject(fault: str) -> None:
    """Wraps ``planning.assemble`` or the serving loop's ``_Loop.apply`` to fire ``fault``."""
    from jtbo.runner import generate, planning  # noqa: PLC0415 - after jax is set up

    assemble, apply = planning.assemble, generate._Loop.apply
    calls = {"apply": 0}

    def faulty_assemble(local, ranks, decision, options, picked=None):
        modes = {item.batch.forward_mode.name for item in local}
        if (
            fault == "kill_prefill"
            and "EXTEND" in modes
            or (fault == "kill_decode" and "DECODE" in modes)
        ):
            print(f"fault at {time.time()}: kill -9 in a step of {sorted(modes)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "raise_assemble" and "DECODE" in modes:
            print(f"fault at {time.time()}: raise in assemble", flush=True)
            raise RuntimeError("injected fault in planning.assemble")
        return assemble(local, ranks, decision, options, picked)

    def faulty_apply(*args, **kwargs):
        calls["apply"] += 1
        if fault.startswith("raise_generate") and calls["apply"] == 3:
            print(f"fault at {time.time()}: raise in the greedy loop", flush=True)
            raise RuntimeError("injected fault in the greedy loop")
        return apply(*args, **kwargs)

    planning.assemble, generate._Loop.apply = faulty_assemble, faulty_apply


def main(argv: list[str]) -> None:
    """Runs one process (see the module docstring).

    Args:
      argv: ``[process_id, num_processes, port, fault]``.
    """
    process_id, num_processes, port, fault = int(argv[0]), int(argv[1]), argv[2], argv[3]
    multihost_scenario = multihost_worker.set_up(process_id, num_processes, port)
    if process_id == FAULT_PROCESS:
        _inject(fault)
    # The scenario's own bucket: these greedy programs are then the plain runner's of the
    # multi-host test, and a run compiles them once for both tests (its compilation cache).
    runner = multihost_scenario.make_runner(False, peer_timeout_s=PEER_TIMEOUT_S)
    prompts = multihost_scenario.prompts()[:4]
    # Only the faulting process stays. A survivor learns of the failure either inside a
    # collective (its monitor exits the process) or, between phases, as a PeerFailedError at its
    # next phase, which must reach the monitor's exit as well: caught here, it stayed instead.
    if fault.endswith("_stay") and process_id == FAULT_PROCESS:
        try:
            runner.generate(prompts, max_new_tokens=3, chunk_size=8)
        except RuntimeError as err:
            print(f"caught {err!r}; staying alive for {STAY_S} s", flush=True)
            time.sleep(STAY_S)
            os._exit(STAY_EXIT_CODE)
    results = runner.generate(prompts, max_new_tokens=3, chunk_size=8)
    print("generated", [r.token_ids for r in results], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
