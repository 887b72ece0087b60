"""jtbo.overlap: operations, the staggered two-micro-batch executor, strategies and the XLA
options that keep micro-batches apart (a model's step drives them through its layer loop; a
report read from the compiled schedule says how much communication ran beside compute)."""

from jtbo.overlap.operations import (
    MICRO_BATCH_SCOPES,
    ExecutionOperation,
    InFlight,
    IssuingOperation,
    JointOperation,
    Operation,
    OperationState,
    YieldOperation,
    convert_operations_to_stages,
    execute_lockstep_operations,
    execute_operations,
    execute_overlapped_operations,
)
from jtbo.overlap.row_joint import RowWiseOperation
from jtbo.overlap.strategy import LayerFamily, OperationsStrategy
from jtbo.overlap.xla_options import TBO_XLA_OPTIONS, TboXlaOptions, tbo_compiler_options

__all__ = [
    "MICRO_BATCH_SCOPES",
    "TBO_XLA_OPTIONS",
    "ExecutionOperation",
    "InFlight",
    "IssuingOperation",
    "JointOperation",
    "LayerFamily",
    "Operation",
    "OperationState",
    "RowWiseOperation",
    "OperationsStrategy",
    "TboXlaOptions",
    "YieldOperation",
    "convert_operations_to_stages",
    "execute_lockstep_operations",
    "execute_operations",
    "execute_overlapped_operations",
    "tbo_compiler_options",
]
