"""Every process agreeing on a step before any device work, and bounded failure meanwhile.

Each step starts with an exchange (``step_exchange``): every process reports its runner's
fingerprint (``RunnerConfig.fingerprint_parts``), its DP ranks' plan-defining integers and the
error that refused its batches, if any; every process then decides the same step from the same
reports (``planning.decide``), or raises the same error. With several processes a failure
monitor (``failure``) runs beside: each phase of a step says whether it waits on other
processes, and a process that fails or stops answering ends every other in bounded time instead
of leaving them in a collective. A single process exchanges with itself and has no monitor.
"""

import contextlib

import numpy as np

from jtbo.runner import failure, last_rows, planning, runner_config, step_exchange


class StepAgreement:
    """The step counter, the fingerprint and the failure monitor of one runner.

    Attributes:
      exchanges: steps agreed so far (refused ones included: every process took part).
    """

    def __init__(self, config: runner_config.RunnerConfig, fingerprint: int):
        self.config, self.fingerprint = config, fingerprint
        self.exchanges = 0
        self._monitor = failure.monitor(config.peer_timeout_s) if config.multiprocess else None

    def phase(self, step, name: str, *, collective: bool, agreed: tuple[type, ...] = ()):
        """A ``failure.FailureMonitor`` phase (several processes), else a no-op context.

        Args:
          step: the step number (or a function returning it).
          name: the phase's name in messages.
          collective: whether the body waits on other processes.
          agreed: exceptions raised alike on every process (not a failure of this one).
        """
        if self._monitor is None:
            return contextlib.nullcontext()
        return self._monitor.phase(step, name, collective=collective, agreed=agreed)

    def agree(self, prepare, batches, last: bool, check=None):
        """Validates this process's batches and agrees on the step with every process.

        ``check()`` validates a caller's other inputs in the same place, so that a refusal
        raises on every process before any device work.

        Args:
          prepare: ``batches -> local summaries`` (``HostTable.prepare``).
          batches: this process's ranks' batches.
          last: whether the step computes each sequence's last row only.
          check: the caller's further checks, or None.

        Returns:
          ``(step number, local summaries, decision, picked rows or None)``.

        Raises:
          ValueError, step_exchange.StepRejectedError: a batch refused here or elsewhere.
        """
        step = self.exchanges
        local, error, picked = [], None, None
        try:
            if check is not None:  # before prepare records the batches' positions
                check()
            local = prepare(batches)
            if last:  # a bad batch is refused on every process, before any device work
                picked = [np.zeros(0, np.int32) if b is None else last_rows.last_rows(b)
                          for b in batches]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - re-raised on every process by the exchange
            error = exc
        ranks = self.config.local_dp_ranks
        summaries = {r: item.summary for r, item in zip(ranks, local, strict=False)}
        report = step_exchange.LocalReport(step, self.fingerprint, summaries, error)
        self.exchanges += 1  # counts refused steps too: every process took part in them
        # Raised alike on every process (a refused batch, a plan no rank can run): no failure.
        agreed = (ValueError, step_exchange.ProcessFailedError, type(error or ValueError()))
        with self.phase(step, "exchange", collective=True, agreed=agreed):
            reports = step_exchange.exchange(report, self.config.dp_rank_owners)
            decision = planning.decide(reports, self.config.plan)
        return step, local, decision, picked
