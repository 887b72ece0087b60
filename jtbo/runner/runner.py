"""``ModelRunner``: serves a ``MoEModel`` on a ``("dp", "attn_tp")`` mesh, TBO on or off.

``forward(batches)`` takes one host ``ForwardBatch`` per DP rank (None: idle), records the new
tokens' KV slots in the page table it owns, plans the step (``planning.plan_step``: bucket,
attention kind, DP agreement on TBO, split, metadata), runs the jitted ``shard_map`` step and
returns each rank's logits. The KV pools stay on the devices between steps (donated to the
step, replaced by its output). One compile per (bucket, attention kind, TBO child capacity);
``warmup`` compiles them ahead of serving.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtbo import split
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import layer_ops, step
from jtbo.models import model as model_lib
from jtbo.runner import generate as generate_lib
from jtbo.runner import kv_table, planning

ForwardMode = split.ForwardMode


class ExpertCapacityError(RuntimeError):
    """Raised when a step dropped routed tokens for lack of EP capacity."""


class ModelRunner:
    """Runs a ``MoEModel`` with DP attention, EP or TP MoE, and optional two-batch overlap."""

    def __init__(
        self,
        model: model_lib.MoEModel,
        mesh: jax.sharding.Mesh,
        *,
        enable_two_batch_overlap: bool = False,
        tbo_token_distribution_threshold: float = 0.48,
        moe_a2a_backend: str = "ep",
        max_total_tokens: int,
        max_running_requests: int,
        token_buckets: Sequence[int] | None = None,
        dtype=jnp.bfloat16,
        ep_capacity_factor: float | None = None,
    ):
        """Places the model on the mesh and allocates every DP rank's KV pool.

        Args:
          model: the model (float32 parameters; cast to ``dtype`` here).
          mesh: a mesh with axes ``("dp", "attn_tp")`` (``jtbo.collectives.make_mesh``).
          enable_two_batch_overlap: split eligible steps into two overlapped micro-batches.
          tbo_token_distribution_threshold: SGLang's split threshold, in [0, 0.5].
          moe_a2a_backend: "ep" (all-to-all) or "none" (DP gather + reduce-scatter).
          max_total_tokens: KV slots per DP rank (also the longest sequence).
          max_running_requests: requests per DP rank (page-table rows, sequences per step).
          token_buckets: token capacities of compiled steps; powers of two up to
            ``max_total_tokens`` when None.
          dtype: parameter, activation and KV dtype.
          ep_capacity_factor: EP slots per (device, expert) as a multiple of the balanced load;
            None never drops a token (``layer_ops.ParallelConfig``).

        Raises:
          ValueError: a mesh without the right axes, or shapes that do not divide over it.
        """
        if tuple(mesh.axis_names) != mesh_lib.TP_AXES:
            raise ValueError(f"mesh axes {mesh.axis_names} != {mesh_lib.TP_AXES}")
        config = model.config
        self.dp_size, self.attn_tp_size = mesh.shape["dp"], mesh.shape["attn_tp"]
        _check_divisible(config, self.dp_size, self.attn_tp_size, moe_a2a_backend)
        if max_total_tokens < 1 or max_running_requests < 1:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} and max_running_requests="
                f"{max_running_requests} must be >= 1"
            )
        self.config, self.mesh, self.dtype = config, mesh, dtype
        self.max_total_tokens, self.max_running_requests = max_total_tokens, max_running_requests
        self.parallel = layer_ops.ParallelConfig(
            moe_a2a_backend, self.attn_tp_size, self.dp_size * self.attn_tp_size, ep_capacity_factor
        )
        buckets = token_buckets or split.default_token_buckets(max_total_tokens)
        self.options = planning.PlanOptions(
            attn_tp_size=self.attn_tp_size,
            token_buckets=tuple(int(b) for b in buckets),
            seq_capacity=max_running_requests,
            max_context=max_total_tokens,
            enable_tbo=enable_two_batch_overlap,
            threshold=tbo_token_distribution_threshold,
        )
        served = model_lib.cast(model, dtype)
        self._step = step.make_step(served, mesh, self.parallel)
        _, params = nnx.split(served)
        shardings = jax.tree.map(
            lambda spec: jax.sharding.NamedSharding(mesh, spec),
            step.param_specs(params, moe_a2a_backend),
        )
        self._params = jax.device_put(params, shardings)
        self._init_kv()
        self.num_steps = 0
        self.num_tbo_steps = 0

    def _init_kv(self) -> None:
        shape = (
            self.dp_size,
            self.config.num_layers,
            self.max_total_tokens + 1,  # slot 0 is the padding slot
            self.config.num_key_value_heads,
            self.config.head_dim,
        )
        kv_sharding = jax.sharding.NamedSharding(self.mesh, step.KV_CACHE_SPEC.k)
        self._k = jax.device_put(jnp.zeros(shape, self.dtype), kv_sharding)
        self._v = jax.device_put(jnp.zeros(shape, self.dtype), kv_sharding)
        self.req_to_token = np.zeros(
            (self.dp_size, self.max_running_requests, self.max_total_tokens), np.int32
        )
        self._req_to_token_device = None  # uploaded copy; None when the host table changed

    def record(self, rank: int, batch: split.ForwardBatch) -> None:
        """Records a batch's new-token KV slots in rank ``rank``'s page table.

        Raises:
          ValueError: a request row, KV position or slot outside the table / pool.
        """
        kv_table.record(self.req_to_token[rank], batch, self.num_slots)
        self._req_to_token_device = None

    @property
    def num_slots(self) -> int:
        """KV-pool slots per DP rank, the padding slot 0 included."""
        return self.max_total_tokens + 1

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per bucket, attention kind and TBO key)."""
        return self._step.compile_count()

    def forward(self, batches: Sequence[split.ForwardBatch | None]) -> list[np.ndarray | None]:
        """Runs one step over every DP rank.

        Args:
          batches: one unpadded host ``ForwardBatch`` per DP rank (None: the rank is idle).
            The caller owns request rows and KV slots (``req_pool_indices``,
            ``out_cache_loc``); the runner records them in its page table.

        Returns:
          Per rank, float32 logits ``[num_tokens, vocab]`` as numpy, or None for idle ranks.

        Raises:
          ValueError: wrong number of batches, a bad token id, a batch that does not fit.
          ExpertCapacityError: the step dropped routed tokens (raise ``ep_capacity_factor``).
        """
        if len(batches) != self.dp_size:
            raise ValueError(f"got {len(batches)} batches for dp_size={self.dp_size}")
        full = [planning.idle_batch() if b is None else b for b in batches]
        for rank, batch in enumerate(full):
            self._validate(rank, batch)
        for rank, batch in enumerate(full):
            self.record(rank, batch)
        plan = planning.plan_step(full, self.options)
        logits = self._run(plan)
        return [
            None if b is None else logits[r, : plan.num_tokens[r]] for r, b in enumerate(batches)
        ]

    def _validate(self, rank: int, batch: split.ForwardBatch) -> None:
        ids = np.asarray(batch.input_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"rank {rank}: token ids span [{ids.min()}, {ids.max()}], vocabulary is "
                f"[0, {self.config.vocab_size})"
            )
        if batch.num_token_non_padded not in (None, batch.num_tokens):
            raise ValueError(f"rank {rank}: pass unpadded batches; the runner pads them")
        if batch.batch_size > self.max_running_requests:
            raise ValueError(
                f"rank {rank}: batch_size={batch.batch_size} > max_running_requests="
                f"{self.max_running_requests}"
            )
        if ids.size and batch.positions is None:
            raise ValueError(f"rank {rank}: ForwardBatch.positions is required")

    def _run(self, plan: planning.StepPlan) -> np.ndarray:
        return np.asarray(self.run_plan(plan))

    def run_plan(self, plan: planning.StepPlan) -> jax.Array:
        """Runs a planned step (``planning.plan_step``) and returns the device logits.

        The page table must already hold the plan's tokens (``forward`` records them).

        Returns:
          ``[dp, capacity, vocab]`` float32 logits, still on the devices.

        Raises:
          ExpertCapacityError: the step dropped routed tokens.
        """
        if self._req_to_token_device is None:
            sharding = jax.sharding.NamedSharding(self.mesh, step.KV_CACHE_SPEC.req_to_token)
            self._req_to_token_device = jax.device_put(self.req_to_token, sharding)
        cache = kv_cache_lib.KVCache(k=self._k, v=self._v, req_to_token=self._req_to_token_device)
        logits, cache, overflow = self._step(
            self._params,
            cache,
            plan.per_rank,
            plan.replicated,
            mode=int(plan.mode),
            child_capacity=plan.child_capacity,
        )
        self._k, self._v, self._req_to_token_device = cache.k, cache.v, cache.req_to_token
        self.num_steps += 1
        self.num_tbo_steps += plan.child_capacity is not None
        if int(overflow):
            raise ExpertCapacityError(
                f"{int(overflow)} routed (token, expert) pairs exceeded the EP capacity "
                f"(ep_capacity_factor={self.parallel.ep_capacity_factor}); raise it (None "
                "never drops)"
            )
        return logits

    def generate(self, prompts, *, max_new_tokens: int, dp_rank_of=None, **kwargs):
        """Greedy generation for many prompts; see ``jtbo.runner.generate.generate``.

        Returns:
          One ``GenerationResult`` (token ids, or the error that rejected it) per prompt.
        """
        return generate_lib.generate(
            self, prompts, max_new_tokens=max_new_tokens, dp_rank_of=dp_rank_of, **kwargs
        )

    def warmup(self, token_counts: Sequence[int], modes: Sequence[ForwardMode]) -> int:
        """Compiles the steps of the given token counts and modes before serving.

        Runs a synthetic step (rank 0 busy, the rest idle) with the static keys a real step of
        that many tokens in that mode has; its K/V writes go to the padding slot only.

        Args:
          token_counts: token counts whose buckets to compile.
          modes: EXTEND, DECODE (TARGET_VERIFY needs a draft size: compile it by serving).

        Returns:
          The compile count afterwards.
        """
        for count in token_counts:
            for mode in modes:
                self._run(self._warmup_plan(count, ForwardMode(mode)))
        return self.compile_count

    def _warmup_plan(self, count: int, mode: ForwardMode) -> planning.StepPlan:
        """A real plan for one synthetic batch on rank 0 that writes only the padding slot."""
        batch = _synthetic_batch(mode, count)
        batches = [batch] + [planning.idle_batch()] * (self.dp_size - 1)
        return planning.plan_step(batches, self.options)


def _synthetic_batch(mode: ForwardMode, count: int) -> split.ForwardBatch:
    ids = np.zeros(count, np.int32)  # token 0, position 0, KV slot 0 (the padding slot)
    ones = np.ones(count, np.int32)
    if mode.is_decode():
        return split.ForwardBatch(
            forward_mode=mode, batch_size=count, input_ids=ids, positions=ids,
            out_cache_loc=ids, req_pool_indices=ids, seq_lens=ones,
        )  # fmt: skip
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=ids, positions=ids,
        out_cache_loc=ids, req_pool_indices=ids[:1], seq_lens=np.array([count]),
        extend_seq_lens=np.array([count]), extend_prefix_lens=np.array([0]),
    )  # fmt: skip


def _check_divisible(config, dp: int, tp: int, backend: str) -> None:
    devices = dp * tp
    checks = [
        ("num_attention_heads", config.num_attention_heads, tp),
        ("num_key_value_heads", config.num_key_value_heads, tp),
    ]
    if backend == "ep":
        checks.append(("num_experts", config.num_experts, devices))
    else:
        checks.append(("moe_intermediate_size", config.moe_intermediate_size, devices))
    for name, value, by in checks:
        if value % by:
            raise ValueError(f"{name}={value} does not divide over {by} devices")
