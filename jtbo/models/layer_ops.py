"""A decoder layer's forward as jtbo operations with SGLang's strategy names.

Every operation is ``op(state, **inputs) -> outputs | None`` over a per-micro-batch
``layer_state.LayerState``, which declares every entry the operations set and pop;
``jtbo.overlap.strategy`` arranges them with yields, so the same code runs through
``execute_operations`` (one batch) and ``execute_overlapped_operations`` (two micro-batches).
The bodies run inside the step's ``shard_map`` over ``("dp", "attn_tp")`` and see local
shards.

Layout of activations: every layer keeps ``hidden_states`` and ``residual`` in SGLang's
TP_ATTN_FULL scatter mode (each attn_tp device holds all rows of its DP rank), with the residual
add fused into the next norm as SGLang does (``residual += hidden; hidden = norm(residual)``).

* ``attn_*``: Q/K/V of the local heads, RoPE, paged attention through the KV cache (the
  backend named by ``ParallelConfig.attention_backend``, ``jtbo.attention.backend``);
  ``comm_prepare_mlp`` sums the row-parallel output projection
  over ``attn_tp`` (all-reduce) before the post-attention norm.
* MoE: ``gate`` / ``select_experts`` route the rows; the exchange (``dispatch_a`` ..
  ``combine_b``) is ``jtbo.models.moe_exchange``: expert parallel through the micro-batch's
  ``jtbo.collectives`` EP dispatcher (``"ep"``), or DP gather + reduce-scatter (``"none"``).

Context entries each micro-batch provides (read-only in its state; a
``layer_state.MicroBatchContext``): ``attn_metadata``,
``dp_context``, ``num_tokens`` (its real rows), ``micro_batch`` (0 = A or the whole batch,
1 = B), ``ep_dispatcher`` (its EP dispatcher, None without EP) and ``step_box`` (the KV cache,
threaded through micro-batch A's then B's attention of each layer, and the overflow counts).
"""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jtbo.attention import backend as attn_backend_lib
from jtbo.collectives import ep_config, ep_overflow
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.models import moe_exchange, router
from jtbo.overlap import operations, row_joint

MOE_BACKENDS = ("ep", "none")
MOE_RUNNER_BACKENDS = ("auto", "xla", "pallas", "mosaic")


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How the MoE layers exchange tokens and run their experts (SGLang's ``--moe-*`` options).

    Attributes:
      moe_a2a_backend: "ep" (expert parallel, all-to-all) or "none" (DP gather + experts
        sharded on their hidden width + reduce-scatter).
      moe_runner_backend: impl of the routed experts' FFN (SGLang's ``--moe-runner-backend``):
        "xla" (batched matmul over every capacity slot), "pallas" (grouped GEMM over the
        filled slots only; ``jtbo.kernels.grouped_gemm``), "mosaic" (the same on Hopper's
        TMA and wgmma, ``jtbo.kernels.grouped_gemm_mosaic``) or "auto" (per compiled step,
        the fastest for its rows: ``grouped_gemm.auto_impl``); None: resolved by the runner
        to "auto" where a kernel tiles the model, else "xla"
        (for the platform; a ``ParallelConfig`` needs it resolved).
      moe_runner_backend_tbo: impl of the routed experts' FFN in TBO steps; None:
        ``moe_runner_backend``. (On a one-device mesh a TBO step runs both micro-batches'
        experts as one call either way, ``jtbo.models.step._run_tbo``.)
      ep_capacity_factor: "ep" slots per peer and per local expert as a multiple of the
        balanced load (``collectives.create_ep_dispatcher``); None takes the worst case, which
        never overflows.
      ep_capacity_headroom: where the runner has measured peak loads for a dispatch size
        (``ep_dispatchers.DispatcherTable.use_measured_peaks``), "ep" slots are this multiple
        of those peaks instead of ``ep_capacity_factor`` times the balanced load.
      ep_overflow_policy: what the host does when a step overflowed: "raise" (name the capacity
        to raise) or "rerun" (re-run with the next capacity bucket); ``collectives.ep_overflow``.
      ep_exchange: "dense" (fixed-slot all-to-all; overlappable), "ragged" (GPU only) or
        "peer_copy" (fixed slots by peer copies on a side stream, one process;
        ``collectives.peer_copy``).
      ep_exchange_tbo: the exchange of TBO steps, where it runs beside the other
        micro-batch's compute; None: ``ep_exchange``. E.g. ``ep_exchange="dense",
        ep_exchange_tbo="peer_copy"``: NCCL where nothing overlaps it, copy engines where
        something does.
      ep_dedup: exchange one row per (token, destination device) with the token's local
        expert ids and weights (``collectives.ep_dedup``, DeepEP's dispatch; the default)
        instead of one per (token, expert) assignment (False); combine then sums each
        device's experts before sending. Why it is the default: docs/benchmarks/, "EP
        exchange volume with dedup dispatch".
      ep_slot_alignment: EP capacities are rounded up to a multiple of this (8 suits GPU
        GEMMs; 1 keeps the factor exact).
    """

    moe_a2a_backend: Literal["ep", "none"] = "ep"
    moe_runner_backend: str | None = None
    moe_runner_backend_tbo: str | None = None
    ep_capacity_factor: float | None = None
    ep_overflow_policy: str = "raise"
    ep_capacity_headroom: float = 1.25
    ep_exchange: str = "dense"
    ep_exchange_tbo: str | None = None
    ep_dedup: bool = True
    ep_slot_alignment: int = 1

    def exchange(self, tbo: bool) -> str:
        """The EP exchange of plain (``tbo=False``) or TBO steps."""
        return self.ep_exchange_tbo if tbo and self.ep_exchange_tbo else self.ep_exchange

    def __post_init__(self):
        """Checks every field.

        Raises:
          ValueError: a field outside its choices or range (named, with the expected values).
        """
        if self.ep_capacity_factor is not None and self.ep_capacity_factor <= 0:
            raise ValueError(f"ep_capacity_factor={self.ep_capacity_factor} must be > 0")
        if not self.ep_capacity_headroom >= 1:
            raise ValueError(f"ep_capacity_headroom={self.ep_capacity_headroom} must be >= 1")
        if self.moe_a2a_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_a2a_backend={self.moe_a2a_backend!r}: expected {MOE_BACKENDS}")
        if self.ep_overflow_policy not in ep_overflow.POLICIES:
            raise ValueError(
                f"ep_overflow_policy={self.ep_overflow_policy!r}: expected {ep_overflow.POLICIES}"
            )
        if self.ep_exchange not in ep_config.EXCHANGES:
            raise ValueError(f"ep_exchange={self.ep_exchange!r}: expected {ep_config.EXCHANGES}")
        if self.ep_exchange_tbo not in (None, *ep_config.EXCHANGES):
            raise ValueError(
                f"ep_exchange_tbo={self.ep_exchange_tbo!r}: expected None or one of "
                f"{ep_config.EXCHANGES}"
            )
        if self.ep_slot_alignment < 1:
            raise ValueError(f"ep_slot_alignment={self.ep_slot_alignment} must be >= 1")
        for name in ("moe_runner_backend", "moe_runner_backend_tbo"):
            if getattr(self, name) not in (None, *MOE_RUNNER_BACKENDS):
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: expected None or one of {MOE_RUNNER_BACKENDS}"
                )

    def tbo_runner_backend(self) -> str:
        """The experts' impl of a TBO step: ``moe_runner_backend_tbo``, else
        ``moe_runner_backend`` (which must be resolved)."""
        return self.moe_runner_backend_tbo or self.moe_runner_backend


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a layer runs over the ``("dp", "attn_tp")`` mesh (static: part of the compile).

    Built by ``for_mesh``, which reads the mesh-derived field off the mesh; the other fields
    are the caller's options with every platform default resolved.

    Attributes:
      attn_tp_size: devices per DP rank (the mesh's ``"attn_tp"`` size).
      moe: the MoE exchange and experts, ``moe_runner_backend`` resolved (not None).
      attention_backend: the attention forward, a key of
        ``jtbo.attention.backend.ATTENTION_BACKENDS`` ("native", "pallas" or "triton"); each
        micro-batch runs it at its own metadata's capacity.
      tbo_round_barriers: pin the TBO executor's rounds with optimization barriers. Off by
        default: the barriers keep the scheduler from moving work across rounds, and the
        model's decode step covers less of its collective bytes with them than without.
      tbo_issue_barriers: on multi-device meshes, pin both micro-batches' live arrays before
        every collective-issuing (``*_a``) operation (``jtbo.models.step._run_tbo``). None
        (default): on where attention has no tensor parallelism (``attn_tp_size == 1``): they
        order only the ``*_a`` exchanges, not ``attn_tp`` collectives (measurements:
        docs/benchmarks/, "Run-time overlap on two H200s").
    """

    attn_tp_size: int
    moe: MoEOptions
    attention_backend: str = "native"
    tbo_round_barriers: bool = False
    tbo_issue_barriers: bool | None = None

    @classmethod
    def for_mesh(
        cls,
        mesh: jax.sharding.Mesh,
        *,
        moe: MoEOptions,
        attention_backend: str = "native",
        tbo_round_barriers: bool = False,
        tbo_issue_barriers: bool | None = None,
    ) -> "ParallelConfig":
        """The config of a layer on ``mesh``: ``attn_tp_size`` is read off the mesh.

        Args:
          mesh: a mesh with axes ``("dp", "attn_tp")``.
          moe: the MoE options, ``moe_runner_backend`` resolved.
          attention_backend, tbo_round_barriers, tbo_issue_barriers: see the fields.

        Returns:
          The config.

        Raises:
          ValueError: a mesh without the ``("dp", "attn_tp")`` axes, or a bad field.
        """
        if tuple(mesh.axis_names) != mesh_lib.TP_AXES:
            raise ValueError(f"mesh axes {mesh.axis_names} != {mesh_lib.TP_AXES}")
        return cls(
            attn_tp_size=mesh.shape[mesh_lib.ATTN_TP_AXIS], moe=moe,
            attention_backend=attention_backend, tbo_round_barriers=tbo_round_barriers,
            tbo_issue_barriers=tbo_issue_barriers,
        )  # fmt: skip

    @property
    def issue_barriers(self) -> bool:
        """Whether TBO steps on multi-device meshes use issue barriers (see the field)."""
        if self.tbo_issue_barriers is None:
            return self.attn_tp_size == 1
        return self.tbo_issue_barriers

    def __post_init__(self):
        """Checks the resolved backends.

        Raises:
          ValueError: ``attn_tp_size < 1``, an unresolved (None) ``moe.moe_runner_backend`` or
            an unknown ``attention_backend``.
        """
        if self.attn_tp_size < 1:
            raise ValueError(f"attn_tp_size={self.attn_tp_size} must be >= 1")
        if self.moe.moe_runner_backend is None:
            raise ValueError(
                "ParallelConfig needs moe.moe_runner_backend resolved to one of "
                f"{MOE_RUNNER_BACKENDS}, got None (ModelRunner resolves None per platform)"
            )
        attn_backend_lib.backend_class(self.attention_backend)  # ValueError naming the field


class StepBox:
    """Mutable state shared by both micro-batches of one traced step.

    Attributes:
      kv_cache: the DP rank's ``KVCache``; each attention replaces it with its updated copy.
      overflow: per micro-batch (EP dispatcher), ``[2]`` int32 (peer, expert) assignments
        dropped for lack of EP capacity, summed over layers.
      peak_load: per micro-batch, ``[2]`` int32 (peer, expert) peak loads, max over layers
        (the capacities the step needed; ``ep_dispatch.DispatchState.peak_load``).
    """

    def __init__(self, kv_cache, num_micro_batches: int):
        """Args: kv_cache: the step's input KV cache (local shard); num_micro_batches: 1 or 2."""
        self.kv_cache = kv_cache
        self.overflow = [jnp.zeros((2,), jnp.int32) for _ in range(num_micro_batches)]
        self.peak_load = [jnp.zeros((2,), jnp.int32) for _ in range(num_micro_batches)]

    def after_attention(self, out: jax.Array, kv_cache) -> tuple[jax.Array, Any]:
        """Orders the next pool write after this attention's pool reads (TBO only).

        With one micro-batch the next layer's K/V write already depends on this attention's
        output. With two, the other micro-batch's write does not, and XLA can then only keep
        the attention's reads valid by copying the whole pool before the write, several times
        a step (docs/benchmarks/, "TBO step cost on one GPU"). Passing the output and the pool
        through one ``optimization_barrier`` makes the pool handed on depend on the attention
        having finished, so the write can run in place. The output is no collective result, so no
        in-flight collective is pinned by it.

        Args:
          out: this attention's output.
          kv_cache: the cache after this attention's write.

        Returns:
          ``(out, kv_cache)``, the same values.
        """
        if len(self.overflow) == 1:
            return out, kv_cache
        return jax.lax.optimization_barrier((out, kv_cache))

    def add_overflow(self, micro_batch: int, counts: jax.Array, peak_load: jax.Array) -> None:
        """Adds one dispatch's ``[2]`` overflow counts and ``[2]`` peak loads to
        micro-batch ``micro_batch``'s (sum and max)."""
        self.overflow[micro_batch] = self.overflow[micro_batch] + counts
        self.peak_load[micro_batch] = jnp.maximum(self.peak_load[micro_batch], peak_load)


def attention_operations(layer: model_lib.DecoderLayer, parallel: ParallelConfig) -> dict:
    """The attention half of a layer: ``comm_prepare_attn`` .. ``comm_prepare_mlp``.

    Args:
      layer: the layer's modules (local shards).
      parallel: the mesh layout.

    Returns:
      Operation name -> callable.
    """

    def comm_prepare_attn(state, hidden_states, residual, positions):
        residual = residual + hidden_states
        state.update(
            dict(
                positions=positions,
                residual_after_input_ln=residual,
                hidden_states_after_comm_pre_attn=layer.input_norm(residual),
            )
        )

    def attn_prepare(state):
        hidden = state.pop("hidden_states_after_comm_pre_attn")
        state.attn_qkv = layer.attn.qkv(hidden, state.positions)

    def attn_core(state):
        qkv = state.pop("attn_qkv")
        box, md = state.step_box, state.attn_metadata
        backend = attn_backend_lib.backend_class(parallel.attention_backend)(md.capacity)
        out, cache = layer.attn.attend(backend, qkv, layer.layer_id, md, box.kv_cache)
        state.hidden_states_after_attn, box.kv_cache = box.after_attention(out, cache)

    return dict(
        comm_prepare_attn=row_joint.RowWiseOperation(comm_prepare_attn),
        attn_prepare=row_joint.RowWiseOperation(attn_prepare),
        attn_core=attn_core,
        comm_prepare_mlp=row_joint.RowWiseOperation(_comm_prepare_mlp(layer, parallel)),
    )


def _comm_prepare_mlp(layer: model_lib.DecoderLayer, parallel: ParallelConfig):
    """Output projection, its sum over attn_tp (all-reduce), residual add, post-attn norm."""

    def comm_prepare_mlp(state):
        out = layer.attn.output(state.pop("hidden_states_after_attn"))
        if parallel.attn_tp_size > 1:
            out = jax.lax.psum(out, mesh_lib.ATTN_TP_AXIS)
        residual = state.pop("residual_after_input_ln") + out
        state.residual_after_comm_pre_mlp = residual
        state.hidden_states_mlp_input = layer.post_attn_norm(residual)

    return comm_prepare_mlp


def _postprocess(state, mlp_output):
    """``comm_postprocess_layer``: the layer's outputs; the state must be empty afterwards."""
    out = dict(
        hidden_states=mlp_output,
        residual=state.pop("residual_after_comm_pre_mlp"),
        positions=state.pop("positions"),
    )
    state.clear(expect_keys=[])
    return out


def dense_layer_operations(
    layer: model_lib.DecoderLayer, parallel: ParallelConfig
) -> dict[str, Callable[..., Any]]:
    """A dense-MLP layer's operations (``jtbo.models.step_operations`` arranges them).

    Args:
      layer: a layer with ``mlp``.
      parallel: the mesh layout.

    Returns:
      Operation name -> callable: the attention operations, ``mlp`` and
      ``comm_postprocess_layer``.
    """

    def mlp(state):
        state.hidden_states_mlp_output = layer.mlp(state.pop("hidden_states_mlp_input"))

    def comm_postprocess_layer(state):
        return _postprocess(state, state.pop("hidden_states_mlp_output"))

    return dict(
        attention_operations(layer, parallel),
        mlp=row_joint.RowWiseOperation(mlp),
        comm_postprocess_layer=comm_postprocess_layer,
    )


def _padding_ids(topk_ids: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """Marks the pairs of rows at or past ``num_tokens`` as unrouted (-1)."""
    real = jnp.arange(topk_ids.shape[0])[:, None] < num_tokens
    return jnp.where(real, topk_ids, -1)


def moe_layer_operations(
    layer: model_lib.DecoderLayer, config: config_lib.MoEConfig, parallel: ParallelConfig
) -> dict[str, Callable[..., Any]]:
    """A MoE layer's operations, keyed by SGLang's strategy names.

    ``shared_experts`` is present only when the config has shared experts (DeepSeek layout);
    without it the Qwen3-MoE layout applies.

    Args:
      layer: a layer with ``moe`` (local shards).
      config: the model config.
      parallel: the mesh layout.

    Returns:
      Operation name -> callable.
    """
    moe = layer.moe
    if parallel.moe.moe_a2a_backend == "ep":
        exchange_ops = moe_exchange.ep_operations(
            moe, parallel.attn_tp_size, parallel.moe.moe_runner_backend
        )
    else:
        exchange_ops = moe_exchange.gather_operations(moe, parallel.moe.moe_runner_backend)
    return dict(
        attention_operations(layer, parallel),
        **_routing_operations(moe, config),
        **exchange_ops,
        **_output_operations(moe),
    )


def _routing_operations(moe: model_lib.MoEBlock, config: config_lib.MoEConfig) -> dict:
    """``gate`` and ``select_experts``: top-k experts and weights of each row."""

    def gate(state):
        state.router_logits = moe.router.gate(state.hidden_states_mlp_input)

    def top_k(router_logits):
        bias = None if moe.router.correction_bias is None else moe.router.correction_bias[...]
        return router.select_experts(router_logits, bias, config)

    def set_selection(state, selection):
        weights, ids = selection
        state.topk_weights_local = weights
        state.topk_ids_local = _padding_ids(ids, state.num_tokens)

    def select_experts(state):
        set_selection(state, top_k(state.pop("router_logits")))

    def select_experts_joint(states, inputs):
        # Top-k is row-wise; the padding mask reads each micro-batch's own token count, so it
        # runs after the split.
        del inputs  # the selection reads the state only
        logits, rows = row_joint.concat_rows([state.pop("router_logits") for state in states])
        for state, selection in zip(states, row_joint.split_rows(top_k(logits), rows), strict=True):
            set_selection(state, selection)
        return None, None

    return dict(
        gate=row_joint.RowWiseOperation(gate),
        select_experts=operations.JointOperation(select_experts, select_experts_joint),
    )


def _output_operations(moe: model_lib.MoEBlock) -> dict:
    """``shared_experts`` (DeepSeek layout only), ``output`` and ``comm_postprocess_layer``."""

    def shared_experts(state):
        state.shared_output = moe.shared_output(state.hidden_states_mlp_input)

    def output(state):
        routed = state.pop("hidden_states_after_combine")
        state.pop("hidden_states_mlp_input")
        if moe.shared is not None:
            routed = routed + state.pop("shared_output")
        state.hidden_states_mlp_output = routed

    def comm_postprocess_layer(state):
        return _postprocess(state, state.pop("hidden_states_mlp_output"))

    ops = dict(
        output=row_joint.RowWiseOperation(output), comm_postprocess_layer=comm_postprocess_layer
    )
    if moe.shared is not None:
        ops["shared_experts"] = row_joint.RowWiseOperation(shared_experts)
    return ops
