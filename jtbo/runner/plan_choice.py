"""Assembling an agreed step's plan, in the program an "auto" runner chose for its shape.

A runner with TBO on or off assembles the agreed step as it is (``planning.assemble``). An
"auto" runner first looks the step's shape up (``tbo_auto.shape_of``); a shape seen for the
first time has both its programs timed on this very step's inputs (``tbo_auto.TboAuto.decide``)
before the step is assembled in the chosen one. The trial runs change only the KV slots this
step writes; the real run that follows rewrites each of them before reading it, so the step's
result is exactly one run of the chosen program's.
"""

from jtbo.runner import planning, runner_config, step_agreement, tbo_auto


class PlanChooser:
    """Plans agreed steps, deciding each new shape's program when "auto" (module docstring).

    Attributes:
      auto: the "auto" decisions (``tbo_auto.TboAuto``), or None for TBO on or off.
    """

    def __init__(
        self, config: runner_config.RunnerConfig, agreement: step_agreement.StepAgreement, run
    ):
        """Args: config: the runner's; agreement: its phases; run: ``plan -> result``, one
        synchronous run of a plan (the timing runs)."""
        self.config, self.agreement, self.run = config, agreement, run
        self.auto = None
        if config.auto:
            settings = config.tbo_auto
            self.auto = tbo_auto.TboAuto(
                settings.trials, settings.margin, settings.timer, settings.known
            )

    def decisions(self) -> tuple[tbo_auto.TboDecision, ...]:
        """Every shape's decision so far (empty for TBO on or off)."""
        return () if self.auto is None else self.auto.decisions()

    def choose(self, local, decision, step: int, picked, finish=None, run=None):
        """Assembles the step (with "auto": in the shape's chosen mode, timing a new shape).

        Args:
          local: this process's ranks' summaries.
          decision: the agreed ``planning.StepDecision``.
          step: the step number.
          picked: per local rank, the token rows whose logits the step computes, or None.
          finish: ``plan -> plan``, a caller's inputs added to an assembled plan.
          run: one synchronous run of a plan (default: the chooser's).

        Returns:
          The ``planning.StepPlan``.
        """
        shape = None if self.auto is None else tbo_auto.shape_of(decision)
        if shape is not None:
            known = self.auto.decision(shape)
            if known is None:
                known = self._decide_shape(shape, local, decision, step, picked, finish, run)
            decision = decision if known.use_tbo else planning.without_tbo(decision)
        with self.agreement.phase(step, "assemble", collective=False):
            plan = self._assemble(local, decision, picked)
            return plan if finish is None else finish(plan)

    def _assemble(self, local, decision, picked) -> planning.StepPlan:
        return planning.assemble(
            local, self.config.local_dp_ranks, decision, self.config.plan, picked
        )

    def _decide_shape(
        self, shape, local, decision, step: int, picked, finish=None, run=None
    ) -> tbo_auto.TboDecision:
        """Times both programs of a new shape on this step's inputs and logits rows."""
        finish = finish or (lambda plan: plan)
        run = run or self.run
        with self.agreement.phase(step, "assemble", collective=False):
            tbo_plan = finish(self._assemble(local, decision, picked))
            plain = finish(self._assemble(local, planning.without_tbo(decision), picked))
        with self.agreement.phase(step, "timing TBO", collective=True):
            return self.auto.decide(shape, lambda: run(plain), lambda: run(tbo_plan))
