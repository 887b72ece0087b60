"""Bounded failure across processes: a process that fails or dies ends every other one in time.

A multi-process step is one SPMD program. A process waiting in one of its collectives (the
step exchange, the device step, the final gather of ``generate``) waits for every other
process; if one of them raised in host code instead (say in ``planning.assemble``, or in the
greedy loop between steps) or died, the collective never completes, and a collective stuck in
a compiled program cannot be interrupted from Python. jax's own coordination service ends a
process only after its heartbeat timeout (100 s by default), with a message that names no step,
and a process that raised would wait at jax's shutdown barrier (300 s by default) for peers
that are stuck.

So every process of a multi-process runner runs one ``FailureMonitor`` (``monitor``): a daemon
thread that talks to jax's coordination service (its key-value store, through the client
``jax.distributed`` already started):

* **errors are published**: the runner and the multi-process ``generate`` run their work in
  ``phase``s (a step's exchange, assemble, device step and read-back; the greedy loop; the
  final gather). An exception in a phase that is not raised alike on every process is written
  to the key ``jtbo/failure/<process>`` as "process P failed in PHASE of step S: ERROR" before
  it propagates. Refusals that every process raises alike (a refused batch, which the step
  exchange already turns into an error on every process, or a plan every process rejects)
  are not failures: the run goes on.
* **liveness**: every ``poll_s`` the thread increments its own counter ``jtbo/beat/<process>``
  and reads all keys under ``jtbo/``. A peer whose counter has not moved for ``timeout_s``
  (after it first beat) has died or hung.
* **a peer's failure ends this process in bounded time**: if the main thread is inside a
  collective phase, the thread writes "jtbo: process P failed in PHASE of step S ...; this
  process was waiting in PHASE' of step S'" to stderr and ends the process with
  ``os._exit(PEER_FAILED_EXIT_CODE)`` — the only way out of a collective that will never
  complete. Otherwise the main thread raises ``PeerFailedError`` (same message) when it next
  enters a phase, before any collective.
* **exit**: when a failure was seen (this process's or a peer's), an ``atexit`` hook ends the
  process with ``os._exit`` (``PEER_FAILED_EXIT_CODE`` after a peer's failure, 1 after its own)
  instead of leaving it to wait at jax's shutdown barrier for processes that left or are stuck.

A published error reaches the others within ``poll_s``; a death within ``timeout_s + poll_s``.
If process 0 itself dies, the coordination service dies with it and jax's client ends every
other process at once (SIGABRT, exit code 134, "Terminating process because the JAX
distributed service detected fatal errors"); that message names no step.
"""

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

PEER_FAILED_EXIT_CODE = 3
OWN_FAILURE_EXIT_CODE = 1
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_POLL_S = 0.5
_PREFIX = "jtbo/"
_FAILURE = _PREFIX + "failure/"
_BEAT = _PREFIX + "beat/"


class PeerFailedError(RuntimeError):
    """Another process of the run failed or stopped responding; the run cannot go on."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """Where the main thread is: a step number and a phase of it.

    Attributes:
      step: the runner's lockstep step number (its exchange count), or a function giving it
        (a phase spanning many steps, such as the greedy loop).
      name: the phase ("exchange", "assemble", "device step", "generate loop", ...).
      collective: whether the phase waits on other processes (a collective).
    """

    step: int | Callable[[], int]
    name: str
    collective: bool

    def describe(self) -> str:
        """E.g. "assemble of step 7"."""
        step = self.step() if callable(self.step) else self.step
        return f"{self.name} of step {step}"


class FailureMonitor:
    """One process's failure publisher and peer watchdog (see the module docstring).

    Attributes:
      process_index: this process.
      process_count: processes of the run.
      timeout_s: a peer whose beat has not moved for this long has failed.
      poll_s: seconds between beats / reads of the key-value store.
      failure: the first failure seen (a peer's message or this process's), or None.
    """

    def __init__(
        self,
        client,
        process_index: int,
        process_count: int,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
        exit_process: Callable[[int], None] = os._exit,
        clock: Callable[[], float] = time.monotonic,
    ):
        """Builds a monitor; ``start`` starts its thread.

        Args:
          client: jax's coordination-service client (``key_value_set``, ``key_value_dir_get``).
          process_index: this process.
          process_count: processes of the run.
          timeout_s: seconds without a peer's beat before it counts as failed.
          poll_s: seconds between polls.
          exit_process: ends the process (``os._exit``; tests inject a recorder).
          clock: monotonic seconds (tests inject one).

        Raises:
          ValueError: a timeout or poll interval that is not positive, or a timeout that is
            not longer than two poll intervals.
        """
        if not (poll_s > 0 and timeout_s > 2 * poll_s):
            raise ValueError(
                f"timeout_s={timeout_s} must exceed 2 * poll_s={poll_s} and poll_s must be > 0"
            )
        self._client = client
        self.process_index, self.process_count = process_index, process_count
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._exit, self._clock = exit_process, clock
        self.failure: str | None = None
        self._peer_failed = False
        self._current: Phase | None = None
        self._beats = 0
        self._seen: dict[str, tuple[str, float]] = {}  # peer beat key -> (value, first seen)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the watchdog thread (a daemon) and the ``atexit`` hook."""
        if self._thread is not None:
            return
        self._beat()  # now, so that a process killed before the first poll is still noticed
        self._thread = threading.Thread(target=self._run, name="jtbo-failure-monitor", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    def stop(self) -> None:
        """Stops the watchdog thread (waits at most one poll for it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s)

    @contextlib.contextmanager
    def phase(
        self,
        step: int | Callable[[], int],
        name: str,
        *,
        collective: bool,
        agreed: tuple[type, ...] = (),
    ) -> Iterator[None]:
        """Runs the body as one phase of a step (see the module docstring).

        Args:
          step: the lockstep step number, or a function giving the current one.
          name: the phase's name, used in messages.
          collective: whether the body waits on other processes.
          agreed: exception types the body raises alike on every process (not failures).

        Raises:
          PeerFailedError: on entry, when a peer has already failed.
        """
        self.check()
        outer, self._current = self._current, Phase(step, name, collective)
        try:
            yield
        except PeerFailedError:
            raise
        except agreed:
            raise
        except BaseException as error:
            if collective and self._peer_failure_within_timeout():
                raise PeerFailedError(
                    f"{self.failure}; process {self.process_index} stops after its collective "
                    f"failed ({type(error).__name__})"
                ) from error
            self.publish(f"{type(error).__name__}: {error}")
            raise
        finally:
            self._current = outer

    def _peer_failure_within_timeout(self) -> bool:
        """Waits up to ``timeout_s`` for the watchdog to see a peer's failure.

        A collective that fails on this process (gloo's lost connection, say) most likely
        failed because a peer died or left: name that peer rather than this process.
        """
        if self._thread is None:
            return self._peer_failed
        self._current = dataclasses.replace(self._current, collective=False)
        deadline = self._clock() + self.timeout_s + 2 * self.poll_s
        while not self._peer_failed and self._clock() < deadline:
            time.sleep(self.poll_s / 2)
        return self._peer_failed

    def check(self) -> None:
        """Raises ``PeerFailedError`` when a peer has failed (before entering a collective)."""
        if self._peer_failed:
            where = "" if self._current is None else f" (in {self._current.describe()})"
            raise PeerFailedError(f"{self.failure}; process {self.process_index} stops{where}")

    def publish(self, error: str) -> None:
        """Writes this process's failure in the current phase for the peers to see.

        Args:
          error: "Type: message" of the exception.
        """
        if self.failure is not None:  # published already (an outer phase), or a peer's
            return
        where = "?" if self._current is None else self._current.describe()
        text = f"process {self.process_index} failed in {where}: {error}"[:2000]
        self.failure = text
        try:
            self._client.key_value_set(f"{_FAILURE}{self.process_index}", text)
        except Exception as exc:  # noqa: BLE001 - published once; a second failure is reported
            print(f"jtbo: could not publish the failure ({exc}): {text}", file=sys.stderr)

    def poll_once(self) -> None:
        """One beat and one read of the peers' keys; acts on a peer's failure."""
        self._beat()
        entries = dict(self._client.key_value_dir_get(_PREFIX))
        failure = self._peer_failure(entries)
        if failure is not None and not self._peer_failed:
            self.failure, self._peer_failed = failure, True
        if self._peer_failed:
            current = self._current
            if current is not None and current.collective:
                print(
                    f"jtbo: {self.failure}; process {self.process_index} was waiting in "
                    f"{current.describe()} (a collective that cannot complete) and exits with "
                    f"code {PEER_FAILED_EXIT_CODE}",
                    file=sys.stderr,
                    flush=True,
                )
                self._exit(PEER_FAILED_EXIT_CODE)

    def _beat(self) -> None:
        self._beats += 1
        self._client.key_value_set(
            f"{_BEAT}{self.process_index}", str(self._beats), allow_overwrite=True
        )

    def _peer_failure(self, entries: dict[str, str]) -> str | None:
        """The first peer failure: a published error, else a peer whose beat stopped."""
        own = f"{_FAILURE}{self.process_index}"
        published = sorted(k for k in entries if k.startswith(_FAILURE) and k != own)
        if published:
            return entries[published[0]]
        now = self._clock()
        for key in sorted(k for k in entries if k.startswith(_BEAT)):
            if key == f"{_BEAT}{self.process_index}":
                continue
            value, since = self._seen.get(key, (None, now))
            if value != entries[key]:
                self._seen[key] = (entries[key], now)
            elif now - since > self.timeout_s:
                where = "" if self._current is None else f" during {self._current.describe()}"
                return (
                    f"process {key[len(_BEAT) :]} stopped responding{where}: no heartbeat for "
                    f"{now - since:.1f} s (timeout {self.timeout_s} s; it died or hangs)"
                )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the service is gone: nothing to watch
                if not self._stop.is_set():
                    print(f"jtbo: failure monitor stopped: {exc}", file=sys.stderr, flush=True)
                return

    def _at_exit(self) -> None:
        self.stop()
        if self.failure is None:
            return
        code = PEER_FAILED_EXIT_CODE if self._peer_failed else OWN_FAILURE_EXIT_CODE
        print(
            f"jtbo: {self.failure}; process {self.process_index} exits with code {code} without "
            "waiting at jax's shutdown barrier",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        self._exit(code)


_MONITOR: FailureMonitor | None = None


def monitor(timeout_s: float = DEFAULT_TIMEOUT_S) -> FailureMonitor:
    """This process's running monitor (started on first use) with the given timeout.

    Args:
      timeout_s: seconds without a peer's beat before it counts as failed (the latest
        runner's value applies to the process).

    Returns:
      The process-wide ``FailureMonitor``.

    Raises:
      RuntimeError: ``jax.distributed`` is not initialised.
    """
    global _MONITOR
    from jax._src import distributed  # noqa: PLC0415 - jax's coordination-service client

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("a multi-process runner needs jax.distributed.initialize first")
    if _MONITOR is None or _MONITOR._client is not client:
        _MONITOR = FailureMonitor(
            client, distributed.global_state.process_id, distributed.global_state.num_processes,
            timeout_s=timeout_s, poll_s=min(DEFAULT_POLL_S, timeout_s / 4),
        )  # fmt: skip
        _MONITOR.start()
    else:
        _MONITOR.timeout_s = timeout_s
    return _MONITOR


@contextlib.contextmanager
def no_phase(*_args, **_kwargs) -> Iterator[None]:
    """A phase that does nothing (a single-process runner has no peers)."""
    yield
