"""jtbo.runner: ``ModelRunner`` (serving a ``jtbo.models.MoEModel`` with DP attention, EP/TP MoE
and two-batch overlap), host step planning, the greedy ``generate`` loop, and multi-process
serving under ``jax.distributed`` (each process passes its own DP ranks' batches)."""

from jtbo.runner.planning import PlanOptions, StepPlan, plan_step
from jtbo.runner.runner import ExpertCapacityError, ModelRunner
from jtbo.runner.step_exchange import ProcessFailedError, StepRejectedError

__all__ = [
    "ExpertCapacityError",
    "ModelRunner",
    "PlanOptions",
    "ProcessFailedError",
    "StepPlan",
    "StepRejectedError",
    "plan_step",
]
