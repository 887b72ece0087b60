"""DP-attention collectives and expert-parallel dispatch/combine.

The step's TBO decision across DP ranks (SGLang's ``TboDPAttentionPreparer`` rules) is made by
the runner's planner on the host.

In-graph pieces work on local shards inside ``jax.shard_map`` over the ``("dp", "attn_tp")``
mesh (``make_mesh``) with ``check_vma=False``; host pieces are plain Python on small integers.
"""

from jtbo.collectives.context import (
    DpContext,
    create_dp_context,
    default_global_buffer_len,
    get_dp_local_info,
)
from jtbo.collectives.ep_config import EpDispatcher, create_ep_dispatcher
from jtbo.collectives.ep_dispatch import (
    CombineInFlight,
    DispatchInFlight,
    DispatchState,
    combine_a,
    combine_b,
    dispatch_a,
    dispatch_b,
)
from jtbo.collectives.ep_overflow import (
    CapacityOverflowError,
    next_capacity_bucket,
    resolve_overflow,
    total_overflow,
)
from jtbo.collectives.gather import dp_gather_replicate
from jtbo.collectives.mesh import (
    ATTN_TP_AXIS,
    DP_AXIS,
    TP_AXES,
    make_mesh,
)
from jtbo.collectives.padding import DpPaddingMode, select_dp_padding_mode
from jtbo.collectives.scatter import dp_reduce_scatter_tensor, dp_scatter

__all__ = [
    "ATTN_TP_AXIS",
    "DP_AXIS",
    "TP_AXES",
    "CapacityOverflowError",
    "CombineInFlight",
    "DispatchInFlight",
    "DispatchState",
    "DpContext",
    "DpPaddingMode",
    "EpDispatcher",
    "combine_a",
    "combine_b",
    "create_dp_context",
    "create_ep_dispatcher",
    "default_global_buffer_len",
    "dispatch_a",
    "dispatch_b",
    "dp_gather_replicate",
    "dp_reduce_scatter_tensor",
    "dp_scatter",
    "get_dp_local_info",
    "make_mesh",
    "next_capacity_bucket",
    "resolve_overflow",
    "select_dp_padding_mode",
    "total_overflow",
]
