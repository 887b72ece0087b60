"""jtbo.overlap: operations, the staggered two-micro-batch executor, strategies, the XLA options
that keep micro-batches apart, and the overlap report (the layer loop that drives them is the
model's step, ``jtbo.models.step``)."""

from jtbo.overlap.hlo_schedule import CollectiveWindow, ComputeSlot, collective_windows
from jtbo.overlap.operations import (
    MICRO_BATCH_SCOPES,
    ExecutionOperation,
    InFlight,
    JointOperation,
    Operation,
    OperationState,
    YieldOperation,
    convert_operations_to_stages,
    execute_lockstep_operations,
    execute_operations,
    execute_overlapped_operations,
)
from jtbo.overlap.report import OverlapReport, coverage, format_report, overlap_report
from jtbo.overlap.row_joint import RowWiseOperation
from jtbo.overlap.strategy import LayerFamily, OperationsStrategy
from jtbo.overlap.xla_options import TBO_XLA_OPTIONS, TboXlaOptions, tbo_compiler_options

__all__ = [
    "MICRO_BATCH_SCOPES",
    "TBO_XLA_OPTIONS",
    "CollectiveWindow",
    "ComputeSlot",
    "ExecutionOperation",
    "InFlight",
    "JointOperation",
    "LayerFamily",
    "Operation",
    "OperationState",
    "RowWiseOperation",
    "OperationsStrategy",
    "OverlapReport",
    "TboXlaOptions",
    "YieldOperation",
    "collective_windows",
    "convert_operations_to_stages",
    "coverage",
    "execute_lockstep_operations",
    "execute_operations",
    "execute_overlapped_operations",
    "format_report",
    "overlap_report",
    "tbo_compiler_options",
]
