"""The arrays of a planned step, as the compiled step takes them: typed pytrees.

``PerRankInputs`` holds every DP rank's arrays stacked on a leading axis (``[dp, ...]`` on
the host; ``[1, ...]`` per rank inside the ``shard_map`` body, which squeezes the axis);
``ReplicatedInputs`` holds what every rank shares. Both are frozen dataclasses registered as
pytrees, so they flatten, pack (``jtbo.split.packing``) and shard like the dicts they replace.
An optional field is None where the step has no such input; a None field flattens to no
leaf and is part of the tree structure, so plans with and without it compile apart, as
before.
"""

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerRankInputs:
    """A step's per-rank arrays (``make_step`` describes how the step reads each).

    Attributes:
      input_ids: token ids, zero past each rank's tokens.
      positions: token positions, zero past each rank's tokens.
      num_tokens: real tokens of each rank.
      page_writes: the new tokens' page-table slots (``step_io.write_pages``); None: none.
      attn_metadata: the whole batch's attention metadata (plain steps); None with TBO.
      split_token_index: each rank's TBO token split; None without TBO.
      child_metadata: micro-batch A's and B's attention metadata; None without TBO.
      logit_rows: the rows whose logits the step computes; None: every row.
      token_source: rows of the previous step's token output that give input ids (-1: the
        plan's own id); None: every id from the plan.
      sampling: the sampling inputs of a sampling step (``jtbo.models.sampler``); None:
        greedy or logits.
    """

    input_ids: Any  # [dp, capacity] int32
    positions: Any  # [dp, capacity] int32
    num_tokens: Any  # [dp] int32
    page_writes: Any | None = None  # [dp, 3, capacity] int32
    attn_metadata: Any | None = None  # metadata pytree, leaves [dp, ...]
    split_token_index: Any | None = None  # [dp] int32
    child_metadata: tuple[Any, Any] | None = None  # (A, B) metadata pytrees, leaves [dp, ...]
    logit_rows: Any | None = None  # [dp, width] int32
    token_source: Any | None = None  # [dp, capacity] int32
    sampling: Any | None = None  # dict of [dp, rows] arrays


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplicatedInputs:
    """A step's replicated arrays: the DP contexts.

    Attributes:
      dp_context: the whole batch's DP context (``jtbo.collectives.context``).
      child_dp_contexts: micro-batch A's and B's DP contexts; None without TBO.
    """

    dp_context: Any  # DpContext pytree
    child_dp_contexts: tuple[Any, Any] | None = None  # (A, B) DpContext pytrees
