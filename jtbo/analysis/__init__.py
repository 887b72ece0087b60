"""jtbo.analysis: what a compiled step does, read from its HLO (above the runner it describes).

* ``hlo_schedule``: a scheduled HLO module's collectives and what XLA placed between each
  one's start and done (``collective_windows``).
* ``schedule_costs``: the compute and bytes of those windows, priced for a GPU target.
* ``report``: the overlap report (``overlap_report``, ``coverage``): the share of collective
  bytes that ran beside the other micro-batch's compute.
* ``report_cli``: ``python -m jtbo.analysis.report_cli``, the report of the model's own step.
* ``aot_report``: the runner's own step compiled for an 8xH200 (or any) target on a CPU, and
  its overlap report (``model_overlap_report``).
* ``step_model``: the TBO step model, plain and TBO step times at any EP size and link from a
  per-operation cost table measured on one GPU (``step_costs``: the table; ``step_ops``: each
  operation's cost; ``step_exchange``: the EP exchange's link, topologies and bytes;
  ``step_schedule``: the compute stream and link timeline).
"""

from jtbo.analysis.hlo_schedule import CollectiveWindow, ComputeSlot, collective_windows
from jtbo.analysis.report import OverlapReport, coverage, format_report, overlap_report

__all__ = [
    "CollectiveWindow",
    "ComputeSlot",
    "OverlapReport",
    "collective_windows",
    "coverage",
    "format_report",
    "overlap_report",
]
