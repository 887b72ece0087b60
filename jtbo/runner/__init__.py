"""jtbo.runner: ``ModelRunner`` (serving a ``jtbo.models.MoEModel`` with DP attention, EP/TP MoE
and two-batch overlap), host step planning, token steps sampled on the devices
(``ModelRunner.dispatch`` / ``resolve``: ``RowSampling``, ``PendingStep``, ``StepTokens``) and
the pipelined ``generate`` loop over them, multi-process serving under ``jax.distributed``
(each process passes its own DP ranks' batches), the per-shape TBO decisions of
``TboOptions(enable_two_batch_overlap="auto")`` (``TboDecision``), and the host time of a
step's phases (``StepPhases``, ``ModelRunner.last_step_phases``)."""

from jtbo.runner.planning import PlanOptions, StepPlan, plan_step
from jtbo.runner.runner import ExpertCapacityError, ModelRunner
from jtbo.runner.step_exchange import ProcessFailedError, StepRejectedError
from jtbo.runner.step_phases import StepPhases
from jtbo.runner.tbo_auto import StepTimer, TboDecision, TboShape, wall_timer
from jtbo.runner.tbo_options import TboOptions
from jtbo.runner.token_step import PendingStep, RowSampling, StepTokens

__all__ = [
    "ExpertCapacityError",
    "ModelRunner",
    "PendingStep",
    "PlanOptions",
    "ProcessFailedError",
    "RowSampling",
    "StepPlan",
    "StepPhases",
    "StepRejectedError",
    "StepTimer",
    "StepTokens",
    "TboDecision",
    "TboOptions",
    "TboShape",
    "plan_step",
    "wall_timer",
]
