"""``TboOptions``: a runner's two-batch-overlap options, in one frozen object.

They act at three places: the planner (``enable_two_batch_overlap``, the split threshold and
the child buckets: ``planning.PlanOptions``), the compiled step (the barrier fields:
``layer_ops.ParallelConfig``) and the "auto" decisions (trials, margin, timer and plan file:
``tbo_auto.TboAuto``). ``ModelRunner(tbo=TboOptions(...))`` hands each field to its place;
the names are the runner's former keyword arguments (SGLang's where it has one).
"""

import dataclasses
import os

from jtbo import split
from jtbo.runner import tbo_auto


@dataclasses.dataclass(frozen=True)
class TboOptions:
    """Whether and how a ``ModelRunner`` splits steps into two overlapped micro-batches.

    Attributes:
      enable_two_batch_overlap: True: split eligible steps into two overlapped micro-batches;
        False: never; "auto": per step shape (bucket, agreed mode), only where TBO was
        measured to be faster by ``tbo_auto_margin`` (``jtbo.runner.tbo_auto``).
      tbo_token_distribution_threshold: SGLang's split threshold, in [0, 0.5]
        (``jtbo.split.plan``).
      tbo_child_buckets: static micro-batch capacities per token bucket, >= 1
        (``split.child_capacities``): a TBO step takes the smallest that holds its split, so
        an even split pads each micro-batch to half the bucket and not to the most uneven
        split's bound; each capacity a step uses is one more compile of the TBO program.
      tbo_round_barriers: pin each TBO round with optimization barriers that leave the
        in-flight collective results out (``layer_ops.ParallelConfig.tbo_round_barriers``).
      tbo_issue_barriers: on multi-device meshes, pin both micro-batches before every
        collective-issuing operation so each exchange window holds the other micro-batch's
        next stage (``layer_ops.ParallelConfig.tbo_issue_barriers``); None: on where
        ``attn_tp_size == 1``.
      tbo_auto_trials: "auto": timed runs of each program of a new shape (after one warm-up
        run each; the median counts).
      tbo_auto_margin: "auto": TBO is kept only if ``tbo_ms <= (1 - margin) * plain_ms``.
      tbo_timer: "auto": times one run (``tbo_auto.StepTimer``); None: ``tbo_auto.wall_timer``
        (device-synchronised wall time). Tests inject timings.
      tbo_plan: "auto": a plan file (``ModelRunner.save_tbo_plan``, ``tbo_plan_file``); its
        shapes are decided without timing, shapes it does not list are still timed on first
        sight.
      tbo_auto_source: "auto": "timed" (the default: time both programs of each new shape)
        or "model" (decide from ``tbo_predictor`` without running either; the runner's
        timer becomes ``tbo_auto.ModelTimer(tbo_predictor)``).
      tbo_predictor: "model": ``shape -> (plain_ms, tbo_ms)`` (``tbo_auto.StepPredictor``),
        e.g. the step model's ``auto_predictor`` (docs/tbo.md).
    """

    enable_two_batch_overlap: bool | str = False
    tbo_token_distribution_threshold: float = split.plan.DEFAULT_THRESHOLD
    tbo_child_buckets: int = split.DEFAULT_CHILD_BUCKETS
    tbo_round_barriers: bool = False
    tbo_issue_barriers: bool | None = None
    tbo_auto_trials: int = tbo_auto.DEFAULT_TRIALS
    tbo_auto_margin: float = tbo_auto.DEFAULT_MARGIN
    tbo_timer: tbo_auto.StepTimer | None = None
    tbo_plan: str | os.PathLike | None = None
    tbo_auto_source: str = "timed"
    tbo_predictor: tbo_auto.StepPredictor | None = None

    def __post_init__(self):
        """Checks every field.

        Raises:
          ValueError: an ``enable_two_batch_overlap`` other than True / False / "auto", a
            threshold outside [0, 0.5], ``tbo_child_buckets < 1``, bad auto settings, or a
            timer or plan file without "auto", an unknown ``tbo_auto_source``, or "model"
            without a predictor or with a timer of its own (names the field).
        """
        tbo_auto.parse_switch(self.enable_two_batch_overlap)
        split.plan.check_threshold(self.tbo_token_distribution_threshold)
        split.activations.check_child_buckets(self.tbo_child_buckets, "tbo_child_buckets")
        tbo_auto.check_settings(self.tbo_auto_trials, self.tbo_auto_margin)
        if not self.auto and (self.tbo_plan is not None or self.tbo_timer is not None):
            raise ValueError(
                "tbo_plan and tbo_timer need enable_two_batch_overlap='auto', got "
                f"{self.enable_two_batch_overlap!r}"
            )
        self._check_source()

    def _check_source(self) -> None:
        """``tbo_auto_source`` / ``tbo_predictor``; "model" installs the ``ModelTimer``."""
        if self.tbo_auto_source not in tbo_auto.SOURCES:
            raise ValueError(
                f"tbo_auto_source must be one of {tbo_auto.SOURCES}, got {self.tbo_auto_source!r}"
            )
        if self.tbo_auto_source == "timed":
            if self.tbo_predictor is not None:
                raise ValueError("tbo_predictor needs tbo_auto_source='model'")
            return
        if self.tbo_predictor is None or not self.auto:
            raise ValueError("tbo_auto_source='model' needs 'auto' and a tbo_predictor")
        if self.tbo_timer is None:
            object.__setattr__(self, "tbo_timer", tbo_auto.ModelTimer(self.tbo_predictor))
        elif not isinstance(self.tbo_timer, tbo_auto.ModelTimer):
            raise ValueError("tbo_auto_source='model' takes no tbo_timer of its own")

    @property
    def enabled(self) -> bool:
        """Whether plans may split (True or "auto")."""
        return tbo_auto.parse_switch(self.enable_two_batch_overlap)[0]

    @property
    def auto(self) -> bool:
        """Whether TBO is decided per step shape ("auto")."""
        return tbo_auto.parse_switch(self.enable_two_batch_overlap)[1]
