"""The devices' side of a ``ModelRunner``: parameters, KV pools, page table and step runs.

A ``StepEngine`` places the model's parameters on the mesh (or shares another engine's),
allocates every DP rank's KV pools and the page table on the devices, and runs planned steps
(``planning.StepPlan``) through the compiled ``shard_map`` step (``jtbo.models.step``). The KV
pools and the page table are donated to each run and replaced by its output, so they stay on
the devices between steps; a plan carries only its new tokens' page writes.

A run's EP dispatchers may overflow (a peer or an expert got more rows than its capacity): the
engine reads the step's small overflow and peak-load counts back with its outputs and applies
the MoE options' policy (``ep_dispatchers``): re-run with larger capacities, or raise
``ExpertCapacityError``. A re-run rewrites the same KV slots before reading them, so the result
is exactly one run's. Token steps (``token_step.PendingStep``) are launched and settled the same
way, one step later (``launch_pending`` / ``settle_pending``).
"""

import dataclasses
import functools
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import ep_overflow
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import ep_dispatchers, step
from jtbo.models import model as model_lib
from jtbo.runner import distributed, numerics, planning, runner_config, step_phases, token_step


class ExpertCapacityError(ep_overflow.CapacityOverflowError):
    """Raised when a step dropped routed tokens for lack of EP capacity (policy "raise")."""


class StepEngine:
    """Device state and step runs of one runner (see the module docstring).

    Attributes:
      step: the compiled-step cache (``step.Step``).
      params: the parameters on the mesh.
      k, v: the KV pools ``[dp, layers, slots, heads, dim]`` (``v`` None for an MLA latent pool).
      req_to_token: the page table ``[dp, rows, max_context_len]`` on the devices.
      num_reruns: extra runs (EP overflow re-runs, token steps re-run on new tokens).
      last_step_phases: the host phases of the last run plan (None before the first).
    """

    def __init__(
        self,
        model: model_lib.MoEModel,
        mesh: jax.sharding.Mesh,
        config: runner_config.RunnerConfig,
        params_from: "StepEngine | None" = None,
    ):
        """Casts the model, builds its step, places (or shares) its parameters, allocates the
        pools.

        Raises:
          ValueError: ``params_from`` serves another model object, mesh, dtype or
            ``moe_a2a_backend``.
        """
        self.mesh, self.config = mesh, config
        self.model_ref = weakref.ref(model)  # for params_from; the host model is not kept
        served = model_lib.cast(model, jnp.dtype(config.dtype))
        self.step = step.make_step(served, mesh, config.parallel)
        if params_from is None:
            self.params = _place_params(served, mesh, config)
        else:
            self.params = params_from.shared_params(model, mesh, config)
        if config.ep_routing_peaks:
            self.step.dispatchers.use_measured_peaks(dict(config.ep_routing_peaks))
        self.k, self.v, self.req_to_token = _allocate_pools(mesh, config)
        self.num_reruns = 0
        self.last_step_phases: step_phases.StepPhases | None = None
        self.last_ep_load = ((), None)  # the last run's dispatchers and peak loads
        self._no_tokens = None  # [dp, rows] zeros: prev_tokens of a step that reads none

    def shared_params(self, model, mesh, config: runner_config.RunnerConfig):
        """This engine's device parameters, for an engine that would place the very same.

        Raises:
          ValueError: another model object, mesh, dtype or ``moe_a2a_backend``.
        """
        if self.model_ref() is not model:
            raise ValueError("params_from: that runner serves another model object")
        mine = (mesh, config.dtype, config.parallel.moe.moe_a2a_backend)
        theirs = (self.mesh, self.config.dtype, self.config.parallel.moe.moe_a2a_backend)
        for name, a, b in zip(("mesh", "dtype", "moe_a2a_backend"), mine, theirs, strict=True):
            if a != b:
                raise ValueError(f"params_from: its {name} {b} differs from this runner's {a}")
        return self.params

    def write_table(self, rank: int, rows, positions, slots) -> None:
        """``req_to_token[rank, rows, positions] = slots`` on the devices."""
        self.req_to_token = _write_table(self.req_to_token, rank, rows, positions, slots)

    def step_inputs(self, plan: planning.StepPlan) -> step.StepInputs:
        """The plan's arrays on the mesh: two packed buffers, two host->device transfers."""
        inputs = step.pack_step_inputs(plan.per_rank, plan.replicated)
        if not self.config.multiprocess:
            return self.step.put(inputs)
        per_rank, replicated = distributed.global_step_inputs(
            self.mesh, inputs.per_rank, plan.ranks, inputs.replicated, self.config.dp_size
        )  # this process's rows of [dp, n] / its devices' copies of [m]
        return dataclasses.replace(inputs, per_rank=per_rank, replicated=replicated)

    def dispatchers_for(self, plan: planning.StepPlan) -> tuple:
        """The EP dispatchers a plan's first run takes (empty without EP)."""
        return self.step.dispatchers.for_step(plan.capacity, plan.child_capacity)

    def launch(self, plan, inputs, dispatchers, sampler=None, prev_tokens=None):
        """Enqueues one run of a planned step on the pools; returns its device
        ``(logits or token outputs, overflow, peak_load)`` without waiting."""
        cache = kv_cache_lib.KVCache(k=self.k, v=self.v, req_to_token=self.req_to_token)
        out, cache, overflow, peak_load = self.step(
            self.params, cache, inputs, mode=int(plan.mode), child_capacity=plan.child_capacity,
            dispatchers=dispatchers, sampler=sampler, prev_tokens=prev_tokens,
        )  # fmt: skip
        self.k, self.v, self.req_to_token = cache.k, cache.v, cache.req_to_token
        return out, overflow, peak_load

    def execute(self, plan: planning.StepPlan, sampler=None, prev_tokens=None) -> jax.Array:
        """Runs a plan until its EP counts stand (re-runs on overflow); returns the device
        logits (with ``sampler``, a token step's outputs). Not counted as a step.

        Raises:
          ValueError: a plan whose rows are not this process's ranks.
          ExpertCapacityError: policy "raise" and the step overflowed.
        """
        if tuple(plan.ranks) != self.config.local_dp_ranks:
            raise ValueError(
                f"plan rows {plan.ranks} != this process's ranks {self.config.local_dp_ranks}"
            )
        start = time.perf_counter()
        inputs = self.step_inputs(plan)
        dispatchers = self.dispatchers_for(plan)
        clock = [start, time.perf_counter()]  # phase boundaries: inputs, then per run two
        while dispatchers is not None:  # re-runs rewrite the same KV slots before reading them
            logits, overflow, peak_load = self.launch(
                plan, inputs, dispatchers, sampler, prev_tokens
            )
            clock.append(time.perf_counter())
            if self.config.multiprocess:  # waits with the GIL released: the monitor runs
                jax.block_until_ready((logits, overflow, peak_load))
            dispatchers = self.settle(dispatchers, overflow, peak_load)
            self.num_reruns += dispatchers is not None
            clock.append(time.perf_counter())
        self.last_step_phases = step_phases.from_clock(clock)
        return logits

    def run_logits(self, plan: planning.StepPlan, logits: jax.Array, check_finite: bool):
        """A run's logits rows of ``plan.ranks`` as numpy and, when ``check_finite``, whether
        each row is finite (``[ranks, rows]`` bool), else None."""
        finite = numerics.finite_rows(logits) if check_finite else None
        if self.config.multiprocess:
            rows = distributed.local_rank_rows(logits, plan.ranks)
            return rows, None if finite is None else distributed.local_rank_rows(finite, plan.ranks)
        return np.asarray(logits), None if finite is None else np.asarray(finite)

    def settle(self, dispatchers, overflow, peak_load):
        """Reads a run's EP counts (waiting for it) and applies the overflow policy.

        Returns:
          None when the run stands, else the dispatchers to re-run it with.

        Raises:
          ExpertCapacityError: policy "raise" and the run overflowed.
        """
        if dispatchers:  # one wait for the step, both small copies issued together
            overflow, peak_load = jax.device_get((overflow, peak_load))
            self.step.dispatchers.observe(dispatchers, peak_load)
        self.last_ep_load = (dispatchers, peak_load)
        try:
            return self.step.dispatchers.resolve(dispatchers, overflow, peak_load)
        except ep_overflow.CapacityOverflowError as error:
            raise ExpertCapacityError(
                f"{error} [ep_capacity_factor={self.config.parallel.moe.ep_capacity_factor}; "
                "None never overflows, ep_overflow_policy='rerun' re-runs]"
            ) from error

    def prev_tokens(self, after: token_step.PendingStep | None) -> jax.Array:
        """The token output a step's ``token_source`` rows read (zeros without ``after``)."""
        if after is not None and after.outputs is not None:
            return after.outputs["tokens"]
        if self._no_tokens is None:
            shape = (self.config.dp_size, self.config.max_running_requests)
            by_rank = jax.sharding.NamedSharding(
                self.mesh, jax.sharding.PartitionSpec(mesh_lib.DP_AXIS)
            )
            self._no_tokens = sharded_zeros(shape, jnp.int32, by_rank)
        return self._no_tokens

    def launch_pending(self, pending: token_step.PendingStep, start: float) -> None:
        """Enqueues a pending step's program (again, after an EP overflow or a re-run of the
        step it reads tokens from)."""
        if pending.inputs is None:
            pending.inputs = self.step_inputs(pending.plan)
            pending.dispatchers = self.dispatchers_for(pending.plan)
        pending.clock = [start, time.perf_counter()]
        launched = self.launch(
            pending.plan, pending.inputs, pending.dispatchers, pending.sampler,
            self.prev_tokens(pending.after),
        )  # fmt: skip
        pending.outputs, pending.overflow, pending.peak_load = launched
        pending.after_runs = 0 if pending.after is None else pending.after.runs
        pending.clock.append(time.perf_counter())

    def settle_pending(self, pending: token_step.PendingStep) -> dict:
        """Waits for a pending step, re-running it while it is stale (its ``after`` step
        re-ran) or its EP counts overflow; returns its host outputs.

        Raises:
          ExpertCapacityError: policy "raise" and the step overflowed.
        """
        if pending.stale:
            self.launch_pending(pending, time.perf_counter())
            pending.runs += 1
            self.num_reruns += 1
        while True:
            if self.config.multiprocess:  # waits with the GIL released: the monitor runs
                jax.block_until_ready((pending.outputs, pending.overflow))
            # One wait: the tokens, flags and EP counts come back together.
            host, counts = self._local_rows(
                pending.outputs, pending.plan, (pending.overflow, pending.peak_load)
            )
            rerun = self.settle(pending.dispatchers, *counts)
            if rerun is None:
                return host
            pending.dispatchers = rerun
            self.launch_pending(pending, time.perf_counter())
            pending.runs += 1
            self.num_reruns += 1

    def _local_rows(self, outputs: dict, plan: planning.StepPlan, replicated):
        """This process's ranks' rows of a step's device outputs and the ``replicated``
        arrays, as numpy."""
        if self.config.multiprocess:
            rows = {k: distributed.local_rank_rows(v, plan.ranks) for k, v in outputs.items()}
            return rows, jax.device_get(replicated)
        return jax.device_get((outputs, replicated))

    def ep_buffer_fill(self) -> list[tuple[float, float]]:
        """How full the last run's EP buffers were, per micro-batch (one without TBO):
        ``(peer, expert)`` peak load over capacity per dispatcher; empty without EP."""
        dispatchers, peak_load = self.last_ep_load
        if not dispatchers:
            return []
        peaks = ep_dispatchers.step_peaks(dispatchers, peak_load)
        return [
            (int(peer) / d.peer_capacity, int(expert) / d.expert_capacity)
            for d, (peer, expert) in zip(dispatchers, peaks, strict=True)
        ]


def _place_params(served: model_lib.MoEModel, mesh, config: runner_config.RunnerConfig):
    """The cast model's parameters on the mesh (every process holds the full parameters and
    fills its own devices)."""
    _, params = step.split_params(served)
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec),
        step.param_specs(params, config.parallel.moe.moe_a2a_backend),
    )
    if config.multiprocess:
        return jax.tree.map(distributed.full_value_array, params, shardings)
    return jax.device_put(params, shardings)


def _allocate_pools(mesh, config: runner_config.RunnerConfig):
    """Zero KV pools and page table, created in place on each device (also other processes'
    devices). Slot 0 is the padding slot; unrecorded positions of the table hold it."""
    heads, k_dim, v_dim = config.model.kv_pool_heads(config.parallel.attn_tp_size)
    shape = (config.dp_size, config.model.num_layers, config.num_slots, heads)
    shardings = step.kv_cache_shardings(mesh)
    dtype = jnp.dtype(config.dtype)

    # An MLA latent pool has no value width (config.kv_pool_heads): no value pool.
    k = sharded_zeros((*shape, k_dim), dtype, shardings.k)
    v = sharded_zeros((*shape, v_dim), dtype, shardings.k) if v_dim else None
    table = (config.dp_size, config.max_running_requests, config.max_context_len)
    return k, v, sharded_zeros(table, jnp.int32, shardings.req_to_token)


# Shardings whose zeros programs are kept (a runner uses a few: its KV pools', its page
# table's, its token buffer's).
_ZEROS_PROGRAMS = 32


@functools.lru_cache(maxsize=_ZEROS_PROGRAMS)
def _zeros_program(sharding: jax.sharding.Sharding):
    """``jnp.zeros`` jitted to write its output with ``sharding``, one program per sharding
    (its shape and dtype static), so that runners on one mesh share the compiled programs;
    the least recently used past ``_ZEROS_PROGRAMS`` shardings are dropped, so that the meshes
    of runners that are gone are not held for the process's life."""
    return jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=sharding)


def sharded_zeros(dims, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Zeros of ``dims`` and ``dtype`` created in place on the devices of ``sharding`` (also
    other processes' devices), never gathered on one device first.

    Args:
      dims: the global shape.
      dtype: the element type.
      sharding: where the array lives.

    Returns:
      The ``jax.Array``.
    """
    return _zeros_program(sharding)(tuple(dims), jnp.dtype(dtype))


@functools.partial(jax.jit, donate_argnums=0)
def _write_table(table, rank: int, rows, positions, slots):
    """``table[rank, rows, positions] = slots`` on the devices (``ModelRunner.record``)."""
    return table.at[rank, rows, positions].set(slots)
