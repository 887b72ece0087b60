"""``RunnerConfig``: a ``ModelRunner``'s arguments resolved once into one frozen object.

A runner takes options in several places: its own keywords (pool sizes, buckets, dtype,
attention backend, DP padding, the numerics guard, the failure timeout), the MoE options
(``layer_ops.MoEOptions``), the TBO options (``tbo_options.TboOptions``) and two files (a TBO
plan, EP routing statistics). Several of them are None until something decides them for the
platform and the model (the experts' and attention's kernels, the issue barriers, the page
table's width, the token buckets, the "auto" timer). ``resolve`` decides every one of them in
one place and returns a ``RunnerConfig`` in which nothing is left open: the layers'
``ParallelConfig`` (backends resolved), the planner's ``PlanOptions``, the sizes, the DP
ranks' owners, the TBO switch and the "auto" settings, the plan file's decisions and the
routing statistics' peaks. The runner, the benchmarks and the AOT report read this one object;
it needs only the model's config and the mesh, so a caller can check a set-up before loading
any weights.
"""

import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops
from jtbo.runner import (
    distributed,
    ep_stats_file,
    failure,
    kernel_backends,
    planning,
    tbo_auto,
    tbo_options,
    tbo_plan_file,
)


@dataclasses.dataclass(frozen=True)
class TboAutoSettings:
    """How an "auto" runner decides TBO per step shape (``tbo_auto.TboAuto``).

    Attributes:
      trials: timed runs of each program of a new shape.
      margin: TBO is kept only if ``tbo_ms <= (1 - margin) * plain_ms``.
      timer: times one run of a plan (``tbo_auto.wall_timer`` unless given; a
        ``tbo_auto.ModelTimer`` for ``tbo_auto_source="model"``).
      source: "timed" or "model" (``TboOptions.tbo_auto_source``).
      known: decisions made up front (the plan file's; empty without one).
    """

    trials: int
    margin: float
    timer: tbo_auto.StepTimer = dataclasses.field(compare=False, repr=False)
    source: str
    known: tuple[tbo_auto.TboDecision, ...]


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """Everything a ``ModelRunner`` runs by, decided (see the module docstring).

    Attributes:
      model: the model's shapes.
      parallel: the layers' config (backends, TBO experts and exchange and issue barriers
        resolved, sizes from the mesh; ``moe.ep_capacity_factor=None`` means the worst case).
      plan: the planner's options (buckets, capacities, TBO, DP padding).
      dtype: parameter, activation and KV dtype (a numpy dtype name).
      max_total_tokens: KV slots per DP rank, the padding slot not counted.
      max_running_requests: page-table rows (sequences per step) per DP rank.
      max_context_len: the page table's width (the longest context a request holds).
      dp_rank_owners: per DP rank, the process that drives it.
      local_dp_ranks: the DP ranks this process drives, in rank order.
      multiprocess: whether the mesh spans other processes' devices.
      tbo_switch: ``enable_two_batch_overlap`` as given (True, False or "auto").
      tbo_auto: the "auto" settings (used where ``tbo_switch`` is "auto").
      check_finite_logits: whether steps check their logits for NaN / infinity.
      peer_timeout_s: several processes: a silent peer's time to count as failed.
      ep_routing_peaks: a routing-statistics file's peaks, ``((rows, (peer, expert)), ...)``
        sorted by rows; empty without a file.
    """

    model: config_lib.MoEConfig
    parallel: layer_ops.ParallelConfig
    plan: planning.PlanOptions
    dtype: str
    max_total_tokens: int
    max_running_requests: int
    max_context_len: int
    dp_rank_owners: tuple[int, ...]
    local_dp_ranks: tuple[int, ...]
    multiprocess: bool
    tbo_switch: bool | str
    tbo_auto: TboAutoSettings
    check_finite_logits: bool
    peer_timeout_s: float
    ep_routing_peaks: tuple[tuple[int, tuple[int, int]], ...]

    @property
    def dp_size(self) -> int:
        """DP ranks of the mesh."""
        return len(self.dp_rank_owners)

    @property
    def auto(self) -> bool:
        """Whether TBO is decided per step shape ("auto")."""
        return tbo_auto.parse_switch(self.tbo_switch)[1]

    @property
    def num_slots(self) -> int:
        """KV-pool slots per DP rank, the padding slot 0 included."""
        return self.max_total_tokens + 1

    def fingerprint_parts(self, device_ids: Sequence[int], mesh_shape: tuple) -> tuple:
        """What every process of a run must share (``step_exchange.fingerprint`` of its
        ``repr``): the config without this process's own ranks (and without the timer, a
        function, which the config's ``repr`` leaves out), the mesh's shape and devices."""
        return dataclasses.replace(self, local_dp_ranks=()), tuple(mesh_shape), list(device_ids)


def resolve(
    model: config_lib.MoEConfig,
    mesh: jax.sharding.Mesh,
    *,
    max_total_tokens: int,
    max_running_requests: int,
    max_context_len: int | None = None,
    moe: layer_ops.MoEOptions | None = None,
    tbo: tbo_options.TboOptions | None = None,
    token_buckets: Sequence[int] | None = None,
    dtype=jnp.bfloat16,
    attention_backend: str | None = None,
    query_tile: int = planning.DEFAULT_QUERY_TILE,
    dp_padding: str = "auto",
    peer_timeout_s: float = failure.DEFAULT_TIMEOUT_S,
    check_finite_logits: bool = True,
    ep_routing_stats: str | os.PathLike | None = None,
) -> RunnerConfig:
    """Resolves a runner's arguments (``ModelRunner``'s, without the model's weights).

    Args: as ``ModelRunner``'s (``model`` is the model's config).

    Returns:
      The ``RunnerConfig``.

    Raises:
      ValueError: a mesh without the right axes, shapes that do not divide over it, a
        backend that cannot serve the model, bad sizes, a bad plan or statistics file.
    """
    moe = moe or layer_ops.MoEOptions()
    tbo = tbo or tbo_options.TboOptions()
    parallel = parallel_config(model, mesh, moe, tbo, attention_backend)
    if max_total_tokens < 1 or max_running_requests < 1:
        raise ValueError(
            f"max_total_tokens={max_total_tokens} and max_running_requests="
            f"{max_running_requests} must be >= 1"
        )
    context = _max_context_len(model, max_total_tokens, max_context_len)
    buckets = token_buckets or split.default_token_buckets(max_total_tokens)
    plan = planning.PlanOptions(
        attn_tp_size=parallel.attn_tp_size, token_buckets=tuple(int(b) for b in buckets),
        seq_capacity=max_running_requests, max_context=context, enable_tbo=tbo.enabled,
        threshold=tbo.tbo_token_distribution_threshold, child_buckets=tbo.tbo_child_buckets,
        query_tile=query_tile, attention_backend=parallel.attention_backend,
        dp_padding=planning.dp_padding_for_backend(dp_padding, moe.moe_a2a_backend),
    )  # fmt: skip
    owners = distributed.dp_rank_owners(mesh)
    return RunnerConfig(
        model=model, parallel=parallel, plan=plan, dtype=jnp.dtype(dtype).name,
        max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
        max_context_len=context, dp_rank_owners=tuple(owners),
        local_dp_ranks=tuple(distributed.local_dp_ranks(owners)),
        multiprocess=distributed.is_multiprocess(mesh), tbo_switch=tbo.enable_two_batch_overlap,
        tbo_auto=_auto_settings(tbo),
        check_finite_logits=check_finite_logits, peer_timeout_s=peer_timeout_s,
        ep_routing_peaks=_routing_peaks(ep_routing_stats, model, mesh, parallel.moe),
    )  # fmt: skip


def _auto_settings(tbo: tbo_options.TboOptions) -> TboAutoSettings:
    """The "auto" settings with the timer and the plan file's decisions resolved."""
    known = () if tbo.tbo_plan is None else tuple(tbo_plan_file.load(tbo.tbo_plan))
    return TboAutoSettings(
        trials=tbo.tbo_auto_trials, margin=tbo.tbo_auto_margin,
        timer=tbo.tbo_timer or tbo_auto.wall_timer, source=tbo.tbo_auto_source, known=known,
    )  # fmt: skip


def ep_routing_model(
    model: config_lib.MoEConfig, num_devices: int, moe: layer_ops.MoEOptions
) -> dict:
    """What a runner's EP peak loads depend on: the ``model`` object of its routing
    statistics file (``ep_stats_file.model_key``: experts, top-k, EP size, dedup)."""
    return ep_stats_file.model_key(
        model.num_experts, model.num_experts_per_tok, num_devices, moe.ep_dedup
    )


def _routing_peaks(path, model, mesh, moe) -> tuple[tuple[int, tuple[int, int]], ...]:
    """A routing-statistics file's peaks, sorted by dispatch size (empty without a file).

    Raises:
      ValueError: a file for a runner without EP, or for another model or EP size.
    """
    if path is None:
        return ()
    if moe.moe_a2a_backend != "ep":
        raise ValueError(
            "ep_routing_stats sizes expert-parallel exchanges; moe_a2a_backend="
            f"{moe.moe_a2a_backend!r} has none"
        )
    peaks = ep_stats_file.load(path, ep_routing_model(model, mesh.devices.size, moe))
    return tuple(sorted(peaks.items()))


def _max_context_len(config, max_total_tokens: int, requested: int | None) -> int:
    """The page table's width: ``requested``, or the model's trained positions capped by the
    pool.

    Raises:
      ValueError: a requested width outside ``[1, max_total_tokens]``.
    """
    if requested is None:
        trained = config.max_position_embeddings or max_total_tokens
        return max(1, min(trained, max_total_tokens))
    if not 1 <= requested <= max_total_tokens:
        raise ValueError(
            f"max_context_len={requested} must be in [1, max_total_tokens={max_total_tokens}]"
        )
    return requested


def parallel_config(
    config, mesh: jax.sharding.Mesh, moe: layer_ops.MoEOptions, tbo: tbo_options.TboOptions,
    attention_backend: str | None,
) -> layer_ops.ParallelConfig:  # fmt: skip
    """The layers' ``ParallelConfig`` on ``mesh``, with the platform defaults (None backends
    and issue barriers) resolved for the model's shapes (``kernel_backends``), and the TBO
    steps' experts and exchange (None: the plain steps') named. ``ep_capacity_factor=None``
    stays: it is a choice (the worst case, which never overflows), not a default.

    Args:
      config: the model's ``MoEConfig``.
      mesh: the ``("dp", "attn_tp")`` mesh.
      moe: the MoE options (a None ``moe_runner_backend`` is resolved here).
      tbo: the TBO options (their barrier settings).
      attention_backend: a backend name, or None for the fastest that serves the model here.

    Returns:
      The ``ParallelConfig`` a ``ModelRunner`` with these arguments runs.

    Raises:
      ValueError: a mesh without the ``("dp", "attn_tp")`` axes, model shapes that do not
        divide over it.
    """
    if tuple(mesh.axis_names) != mesh_lib.TP_AXES:
        raise ValueError(f"mesh axes {mesh.axis_names} != {mesh_lib.TP_AXES}")
    dp, tp = mesh.shape[mesh_lib.DP_AXIS], mesh.shape[mesh_lib.ATTN_TP_AXIS]
    _check_divisible(config, dp, tp, moe.moe_a2a_backend)
    expert_width = config.moe_intermediate_size // (
        dp * tp if moe.moe_a2a_backend == "none" else 1
    )  # per device: the "none" backend slices every expert's hidden width
    backend = kernel_backends.moe_runner_backend(
        moe.moe_runner_backend, (config.hidden_size, expert_width)
    )
    # TBO steps' experts and exchange default to the plain steps' ones: said explicitly here.
    moe = dataclasses.replace(
        moe, moe_runner_backend=backend,
        moe_runner_backend_tbo=moe.moe_runner_backend_tbo or backend,
        ep_exchange_tbo=moe.ep_exchange_tbo or moe.ep_exchange,
    )  # fmt: skip
    parallel = layer_ops.ParallelConfig.for_mesh(
        mesh, moe=moe, attention_backend=_attention_backend(config, attention_backend),
        tbo_round_barriers=tbo.tbo_round_barriers, tbo_issue_barriers=tbo.tbo_issue_barriers,
    )  # fmt: skip
    return dataclasses.replace(parallel, tbo_issue_barriers=parallel.issue_barriers)


def _attention_backend(config, requested: str | None) -> str:
    """The attention backend: ``requested``, or the fastest here whose kernels tile the
    model's head widths (``kernel_backends.attention_backend``)."""
    if config.attention_kind == "mla":  # the widths the paged kernel tiles
        whole = (config.kv_lora_rank, config.v_head_dim)
        split_widths = (
            config.qk_rope_head_dim,
            config.qk_nope_head_dim + config.qk_rope_head_dim,
        )
        # The latent row: its value part, then the RoPE part in power-of-two pieces.
        key_parts = max(1 + split_widths[0].bit_count(), split_widths[1].bit_count())
    else:
        whole, split_widths, key_parts = (config.head_dim,), (), 1
    return kernel_backends.attention_backend(
        requested, config.attention_kind, whole, split_widths, key_parts
    )


def _check_divisible(config, dp: int, tp: int, backend: str) -> None:
    devices = dp * tp
    checks = [
        ("num_attention_heads", config.num_attention_heads, tp),
    ]
    if config.attention_kind == "gqa":
        checks.append(("num_key_value_heads", config.num_key_value_heads, tp))
    if backend == "ep":
        checks.append(("num_experts", config.num_experts, devices))
    else:
        checks.append(("moe_intermediate_size", config.moe_intermediate_size, devices))
    for name, value, by in checks:
        if value % by:
            raise ValueError(f"{name}={value} does not divide over {by} devices")
