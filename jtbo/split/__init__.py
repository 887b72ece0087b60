"""jtbo.split: host planning of the TBO split and pure split/merge of batch pytrees.

* ``plan``: SGLang's split planning on host integers (balanced / two-chunk / decode halves).
* ``batch``: ``ForwardBatch`` / ``SpecVerifyInput`` pytrees, validated on the host.
* ``children``: ``split_batch``, the pure split of a host batch into TBO children.
* ``buckets``: the token buckets a step's rows are padded to for jit.
* ``activations``: in-graph split/merge of activations at a traced token index (and rows of
  the merged parent read straight from the children).
"""

from jtbo.split.activations import (
    DEFAULT_CHILD_BUCKETS,
    child_capacities,
    child_capacity,
    merge_outputs,
    plan_fits_capacity,
    split_inputs,
    take_merged_rows,
)
from jtbo.split.batch import ForwardBatch, SpecVerifyInput
from jtbo.split.buckets import default_token_buckets, token_bucket
from jtbo.split.children import plan_tbo_split, split_batch
from jtbo.split.forward_mode import ForwardMode
from jtbo.split.plan import (
    compute_split_seq_index,
    compute_split_token_index,
    compute_tbo_children_num_token_non_padded,
    get_token_num_per_seq,
    plan_extend_split,
)

__all__ = [
    "DEFAULT_CHILD_BUCKETS",
    "ForwardBatch",
    "ForwardMode",
    "SpecVerifyInput",
    "child_capacities",
    "child_capacity",
    "compute_split_seq_index",
    "compute_split_token_index",
    "compute_tbo_children_num_token_non_padded",
    "default_token_buckets",
    "get_token_num_per_seq",
    "merge_outputs",
    "plan_extend_split",
    "plan_fits_capacity",
    "plan_tbo_split",
    "split_batch",
    "split_inputs",
    "take_merged_rows",
    "token_bucket",
]
