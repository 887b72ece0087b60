"""``enable_two_batch_overlap="auto"``: per step shape, run TBO only where it was measured to pay.

TBO hides collectives behind the other micro-batch's compute, and costs something where there
is little to hide (one device, decode steps bound by reading the weights). Which side wins
depends on the step's shape, so an "auto" runner decides per **shape**: the pair of compiled
programs that a TBO-able step selects between. A shape is the step's token capacity (the bucket,
``StepPlan.capacity``) and its agreed TBO mode (``StepDecision.mode``: EXTEND, MIXED, DECODE or
TARGET_VERIFY); that is the part of ``step.StepKey`` the plain and the TBO program of one step
share (the plain program's key has mode EXTEND and no child capacity; its attention layout
follows from the mode). Verify steps of different draft sizes share one decision, and so do
the TBO programs of a bucket's child capacities (``planning.child_capacities``): the first
step's split picks the one that is timed.

The algorithm, on the first step of a shape whose plan can run TBO (every DP rank agreed):

1. plan the step both ways (``planning.without_tbo`` gives the plain plan);
2. run each program once as a warm-up (compiles it), then ``trials`` times each, taking turns
   (plain, TBO, plain, ...: a drift of the machine moves both alike), each run timed by the
   ``StepTimer`` (default ``wall_timer``: device-synchronised wall time of the runner's run of
   the plan: input upload, program, EP re-runs);
3. take each program's median; with several processes gather every process's medians and take
   the max per program (``agree_timings``: a step lasts until its slowest process is done, and
   every process then decides from the same numbers, so none compiles or runs another program);
4. keep TBO only if ``tbo_ms <= (1 - margin) * plain_ms`` (``choose_tbo``). The margin (default
   2 %) is about the run-to-run spread of a step's median on one GPU: TBO must win by more than
   noise, since it also costs a second program in memory and its numbers round differently;
5. the runner then runs the chosen program once more: that run is the step's result.

Exactness: a step writes the K/V of its own tokens (``out_cache_loc``) in every layer before
any of its tokens reads them, and reads nothing else that a step writes (the padding slot 0 is
never attended: ``kv_table.check_context``). Re-running a plan from the cache a trial left
behind therefore rewrites every slot the trials wrote, the chosen program's values replacing
the other's, and returns what one run of the chosen program returns: the step's logits and the
runner's KV cache are those of a runner fixed to the chosen mode (tests check it bit for bit).

With ``tbo_auto_source="model"`` the runner times nothing: a predictor (``ModelTimer``, e.g.
the step model's plain and TBO times from a measured cost table, docs/tbo.md) gives each new
shape's two times, and step 4 decides from them (source "model"); nothing runs twice.

Later steps of a decided shape run the chosen program without timing. A ``tbo_plan`` file
(``tbo_plan_file``) decides shapes up front: shapes it lists are never timed; shapes it does
not list are timed as above.
"""

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jtbo.runner import planning

ForwardMode = planning.ForwardMode
AUTO = "auto"
DEFAULT_TRIALS = 3
DEFAULT_MARGIN = 0.02
SOURCES = ("timed", "model")


@dataclasses.dataclass(frozen=True)
class TboShape:
    """What one auto decision covers: the plain / TBO program pair of a step.

    Attributes:
      capacity: token rows per DP rank (the step's bucket).
      mode: the agreed TBO mode (EXTEND, MIXED, DECODE or TARGET_VERIFY).
    """

    capacity: int  # token rows per DP rank: the bucket, rounded to attn_tp (and draft size)
    mode: ForwardMode  # the agreed TBO mode of the step's busy ranks

    def describe(self) -> str:
        """E.g. ``"decode bucket 8"``."""
        return f"{self.mode.name.lower()} bucket {self.capacity}"


@dataclasses.dataclass(frozen=True)
class TboDecision:
    """Whether steps of one shape run TBO, and the measurements behind it.

    Attributes:
      shape: the step shape.
      use_tbo: whether its steps run two-batch overlap.
      plain_ms: median step time of the plain program, milliseconds.
      tbo_ms: median step time of the TBO program, milliseconds.
      margin: TBO was kept only if ``tbo_ms <= (1 - margin) * plain_ms``.
      source: "timed" (measured by this runner), "model" (predicted, ``ModelTimer``) or
        "plan" (read from a ``tbo_plan`` file).
    """

    shape: TboShape  # the plain / TBO program pair decided
    use_tbo: bool  # True: run the TBO program
    plain_ms: float  # median plain step, ms (max over processes)
    tbo_ms: float  # median TBO step, ms (max over processes)
    margin: float  # the margin the choice was made with
    source: str  # "timed", "model" or "plan"

    @property
    def ratio(self) -> float:
        """TBO time over plain time (inf when the plain time is 0)."""
        return self.tbo_ms / self.plain_ms if self.plain_ms else float("inf")

    def describe(self) -> str:
        """E.g. ``"decode bucket 8 plain (TBO 1.31x plain)"``."""
        choice = "TBO" if self.use_tbo else "plain"
        return f"{self.shape.describe()} {choice} (TBO {self.ratio:.2f}x plain)"


StepTimer = Callable[[TboShape, bool, Callable[[], Any]], float]
"""``timer(shape, use_tbo, run) -> milliseconds``: calls ``run()`` (one run of the step's plain
or TBO program; returns its device logits) once and returns how long it took."""


StepPredictor = Callable[[TboShape], tuple[float, float]]
"""``predictor(shape) -> (plain_ms, tbo_ms)``: a shape's two step times, predicted."""


@dataclasses.dataclass(frozen=True)
class ModelTimer:
    """The timer of ``tbo_auto_source="model"``: ``TboAuto`` asks ``predictor`` for a new
    shape's times and runs neither program.

    Attributes:
      predictor: maps a shape to its predicted ``(plain_ms, tbo_ms)``.
    """

    predictor: StepPredictor  # shape -> (plain_ms, tbo_ms)

    def __call__(self, shape: TboShape, use_tbo: bool, run: Callable[[], Any]) -> float:
        """The predicted time of one program (``run`` is not called)."""
        del run
        return float(self.predictor(shape)[int(use_tbo)])


def wall_timer(shape: TboShape, use_tbo: bool, run: Callable[[], Any]) -> float:
    """Device-synchronised wall time of one run, in milliseconds (the default ``StepTimer``).

    Args:
      shape: the step shape (unused: every shape is timed alike).
      use_tbo: which program ``run`` runs (unused).
      run: runs the step once and returns its device arrays.

    Returns:
      Milliseconds from the call until the results are ready on the devices.
    """
    del shape, use_tbo
    start = time.perf_counter()
    jax.block_until_ready(run())
    return (time.perf_counter() - start) * 1e3


def parse_switch(value: Any) -> tuple[bool, bool]:
    """``enable_two_batch_overlap`` as ``(plans may split, auto)``.

    Args:
      value: True, False or "auto".

    Returns:
      ``(True, False)`` for True, ``(False, False)`` for False, ``(True, True)`` for "auto".

    Raises:
      ValueError: any other value (named).
    """
    if isinstance(value, bool):
        return value, False
    if isinstance(value, str) and value == AUTO:
        return True, True
    raise ValueError(f"enable_two_batch_overlap must be True, False or 'auto', got {value!r}")


def check_settings(trials: int, margin: float) -> None:
    """Refuses auto settings that cannot time or decide.

    Raises:
      ValueError: ``trials`` not a positive int, or ``margin`` outside ``[0, 1)``.
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"tbo_auto_trials must be an int >= 1, got {trials!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"tbo_auto_margin must be in [0, 1), got {margin!r}")


def shape_of(decision: planning.StepDecision) -> TboShape | None:
    """The shape of a step whose plan runs TBO, or None when it cannot run TBO anyway."""
    if decision.child_capacity is None:
        return None
    return TboShape(decision.capacity, decision.mode)


def choose_tbo(plain_ms: float, tbo_ms: float, margin: float) -> bool:
    """Whether TBO is kept: ``tbo_ms <= (1 - margin) * plain_ms``."""
    return tbo_ms <= (1 - margin) * plain_ms


def time_programs(
    shape: TboShape,
    run_plain: Callable[[], Any],
    run_tbo: Callable[[], Any],
    timer: StepTimer,
    trials: int,
) -> tuple[float, float]:
    """Median milliseconds of each program (module docstring, step 2).

    Args:
      shape: the shape timed (passed to ``timer``).
      run_plain: one run of the plain program.
      run_tbo: one run of the TBO program.
      timer: times one run.
      trials: timed runs per program, after one untimed warm-up each.

    Returns:
      ``(plain_ms, tbo_ms)``.
    """
    jax.block_until_ready(run_plain())
    jax.block_until_ready(run_tbo())
    plain, tbo = [], []
    for _ in range(trials):
        plain.append(timer(shape, False, run_plain))
        tbo.append(timer(shape, True, run_tbo))
    return statistics.median(plain), statistics.median(tbo)


def gather_timings(plain_ms: float, tbo_ms: float) -> np.ndarray:
    """Every process's ``(plain_ms, tbo_ms)``: ``[processes, 2]`` float64, alike everywhere.

    The float64 bits travel as int32 pairs (jax without x64 would round them to float32, which
    can move a timing across the margin). Every process of a multi-process run must call it
    for the same shape at the same step.
    """
    local = np.asarray([plain_ms, tbo_ms], np.float64)
    if jax.process_count() == 1:
        return local[None]
    words = np.asarray(multihost_utils.process_allgather(local.view(np.int32)), np.int32)
    return words.reshape(jax.process_count(), -1).view(np.float64)


def agree_timings(gathered: np.ndarray) -> tuple[float, float]:
    """The timings every process decides from: the max over processes of each program.

    Args:
      gathered: ``[processes, 2]`` (plain, TBO) milliseconds, from ``gather_timings``.

    Returns:
      ``(plain_ms, tbo_ms)``.

    Raises:
      ValueError: ``gathered`` is not ``[processes >= 1, 2]``.
    """
    gathered = np.asarray(gathered)
    if gathered.ndim != 2 or gathered.shape[0] < 1 or gathered.shape[1] != 2:
        raise ValueError(f"gathered timings must be [processes, 2], got shape {gathered.shape}")
    plain, tbo = gathered.max(axis=0).tolist()
    return float(plain), float(tbo)


class TboAuto:
    """An "auto" runner's decisions: looked up per shape, made by timing on first sight."""

    def __init__(
        self, trials: int, margin: float, timer: StepTimer, known: Sequence[TboDecision] = ()
    ):
        """Args: trials, margin: see the module docstring; timer: times one run; known:
        decisions made up front (a ``tbo_plan`` file).

        Raises:
          ValueError: bad ``trials`` / ``margin`` (``check_settings``).
        """
        check_settings(trials, margin)
        self.trials, self.margin, self.timer = trials, margin, timer
        self._decisions = {decision.shape: decision for decision in known}

    def decision(self, shape: TboShape) -> TboDecision | None:
        """The shape's decision, or None before it was decided."""
        return self._decisions.get(shape)

    def decisions(self) -> tuple[TboDecision, ...]:
        """Every decision, by mode and then capacity."""
        order = sorted(self._decisions, key=lambda shape: (shape.mode, shape.capacity))
        return tuple(self._decisions[shape] for shape in order)

    def decide(
        self, shape: TboShape, run_plain: Callable[[], Any], run_tbo: Callable[[], Any]
    ) -> TboDecision:
        """Times both programs of a new shape (or asks a ``ModelTimer``'s predictor), agrees
        across processes, records the choice.

        Returns:
          The new ``TboDecision``.
        """
        if isinstance(self.timer, ModelTimer):  # alike on every process: nothing to gather
            plain_ms, tbo_ms = (float(t) for t in self.timer.predictor(shape))
            source = "model"
        else:
            local = time_programs(shape, run_plain, run_tbo, self.timer, self.trials)
            plain_ms, tbo_ms = agree_timings(gather_timings(*local))
            source = "timed"
        use_tbo = choose_tbo(plain_ms, tbo_ms, self.margin)
        made = TboDecision(shape, use_tbo, plain_ms, tbo_ms, self.margin, source)
        self._decisions[shape] = made
        return made


def steps_summary(
    num_steps: int, num_tbo_steps: int, switch: bool | str, decisions: Sequence[TboDecision]
) -> str:
    """How many steps ran TBO and why, for people.

    Args:
      num_steps: device steps run.
      num_tbo_steps: those run with TBO.
      switch: the runner's ``enable_two_batch_overlap``.
      decisions: an "auto" runner's decisions.

    Returns:
      E.g. ``"TBO on 12 of 20 steps: decode bucket 8 plain (TBO 1.31x plain), extend bucket
      64 TBO (TBO 0.97x plain)"``; a fixed switch is named instead of decisions.
    """
    head = f"TBO on {num_tbo_steps} of {num_steps} steps"
    if switch != AUTO:
        return f"{head} (enable_two_batch_overlap={switch})"
    if not decisions:
        return f"{head}: auto, no TBO-able shape seen yet"
    return f"{head}: " + ", ".join(decision.describe() for decision in decisions)
