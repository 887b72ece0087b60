"""jtbo.runner: ``ModelRunner`` (serving a ``jtbo.models.MoEModel`` with DP attention, EP/TP MoE
and two-batch overlap), host step planning, and the greedy ``generate`` loop."""

from jtbo.runner.planning import PlanOptions, StepPlan, plan_step
from jtbo.runner.runner import ExpertCapacityError, ModelRunner

__all__ = [
    "ExpertCapacityError",
    "ModelRunner",
    "PlanOptions",
    "StepPlan",
    "plan_step",
]
