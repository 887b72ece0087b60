"""``ModelRunner``: serves a ``MoEModel`` on a ``("dp", "attn_tp")`` mesh, TBO on or off.

``forward(batches)`` takes one host ``ForwardBatch`` per DP rank (None: idle), records the new
tokens' KV slots in the page table it owns, plans the step (``planning.plan_step``: bucket,
attention kind, DP agreement on TBO, split, metadata), runs the jitted ``shard_map`` step and
returns each rank's logits. ``dispatch(batches)`` runs the same step but samples each
sequence's next token on the devices and returns at once; ``resolve`` reads the tokens back
(``jtbo.runner.token_step``; what ``generate`` runs). The KV pools and the page table stay on
the devices between steps (donated to the step, replaced by its output): a plan carries only
its new tokens' page writes. One compile per (bucket, attention kind, extend sequence bucket, TBO
child capacity, DP padding mode and SUM_LEN length bucket: ``planning``);
``warmup`` compiles them ahead of serving.

Options come in the layers' configuration objects: ``moe=layer_ops.MoEOptions(...)`` (the
MoE exchange and experts) and ``tbo=tbo_options.TboOptions(...)`` (two-batch overlap); the
runner resolves their platform defaults and derives the mesh's sizes into the layers'
``layer_ops.ParallelConfig`` (``runner.parallel``) and the planner's ``planning.PlanOptions``
(``runner.options``).

``TboOptions(enable_two_batch_overlap="auto")`` decides TBO per step shape (bucket and agreed
mode) from measured step times: the first TBO-able step of a shape times both programs on its
own inputs and keeps the faster (``tbo_auto`` has the algorithm and why the step's result
stays exact); a ``tbo_plan`` file (``tbo_plan_file``) decides shapes without timing.

Multi-process (``jax.distributed``, one process per host, the mesh over every process's
devices): each DP rank belongs to the process whose devices hold its mesh row
(``distributed.dp_rank_owners``; ``local_dp_ranks`` lists this process's). Every process
builds the runner with the same model, options and mesh and calls ``forward`` in lockstep
with the batches of its own ranks only. Before any device work the processes exchange their
ranks' plan-defining integers (``step_exchange``): all then plan the same step, and a batch
refused on one process raises on every process instead of leaving the others waiting in a
collective. Step inputs are global arrays built from each process's own rows; logits are read
back from addressable shards, so each process gets its own ranks' outputs. A single process
is the special case that owns every rank.
"""

import contextlib
import dataclasses
import functools
import itertools
import os
import time
import warnings
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import split
from jtbo.attention import kv_cache as kv_cache_lib
from jtbo.collectives import ep_overflow
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import ep_dispatchers, layer_ops, step, step_io
from jtbo.models import model as model_lib
from jtbo.overlap import xla_options
from jtbo.runner import (
    distributed,
    ep_stats_file,
    failure,
    kernel_backends,
    kv_table,
    last_rows,
    multiprocess_generate,
    numerics,
    planning,
    step_exchange,
    step_phases,
    tbo_auto,
    tbo_options,
    tbo_plan_file,
    token_step,
)
from jtbo.runner import generate as generate_lib

ForwardMode = split.ForwardMode


class ExpertCapacityError(ep_overflow.CapacityOverflowError):
    """Raised when a step dropped routed tokens for lack of EP capacity (policy "raise")."""


class ModelRunner:
    """Runs a ``MoEModel`` with DP attention, EP or TP MoE, and optional two-batch overlap.

    Attributes:
      dp_rank_owners: per DP rank, the process that drives it (its mesh row's devices).
      local_dp_ranks: the DP ranks this process drives, in rank order (``forward``'s batches).
      multiprocess: whether the mesh spans other processes' devices (``jax.distributed``).
      num_reruns: extra runs of steps: EP overflow re-runs, and token steps run again on the
        tokens of a step before them that re-ran.
      num_steps: device steps run; num_tbo_steps: those run with two-batch overlap (an
        "auto" shape's timing runs are not counted, its real step is).
      last_step_phases: the host time of the last step's phases (``step_phases.StepPhases``;
        None before the first step), an "auto" shape's timing runs included.
      tbo: the ``TboOptions`` as given (None: the defaults, TBO off).
      parallel: the layers' ``layer_ops.ParallelConfig`` (backends resolved, sizes from the mesh).
      options: the planner's ``planning.PlanOptions``.
    """

    def __init__(
        self,
        model: model_lib.MoEModel,
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
        params_from: "ModelRunner | None" = None,
    ):
        """Places the model on the mesh and allocates every DP rank's KV pool.

        Args:
          model: the model (float32 parameters; cast to ``dtype`` here).
          mesh: a mesh with axes ``("dp", "attn_tp")`` (``jtbo.collectives.make_mesh``); the
            layers' mesh-derived sizes are read off it (``layer_ops.ParallelConfig.for_mesh``).
          max_total_tokens: KV slots per DP rank.
          max_running_requests: requests per DP rank (page-table rows, sequences per step).
          max_context_len: the longest context one request may hold (the page table's
            width); None: the model's ``max_position_embeddings``, at most
            ``max_total_tokens``.
          moe: the MoE exchange and experts (``layer_ops.MoEOptions``); None: its defaults
            (EP all-to-all, no token dropped). ``moe_runner_backend=None`` takes the fastest
            here that tiles the model ("auto" on GPUs where a kernel's tiles fit: per step,
            the Pallas or the Mosaic GPU grouped GEMM by its rows; else "xla";
            ``jtbo.runner.kernel_backends``).
          tbo: two-batch overlap (``tbo_options.TboOptions``); None: off.
          token_buckets: token capacities of compiled steps; powers of two up to
            ``max_total_tokens`` when None.
          dtype: parameter, activation and KV dtype.
          attention_backend: "native" (blocked jnp attention, the exact reference),
            "pallas" (the extend and paged kernels, ``jtbo.attention.extend`` / ``.paged``;
            the Pallas interpreter on the CPU) or "triton" (the same kernels written in
            Triton, through jax-triton; GPUs only), for the whole batch and both TBO
            micro-batches; None: the fastest here that serves the model (measured:
            ``jtbo.kernels.impls.FASTEST``; "native" on the CPU and for heads no kernel
            tiles).
          query_tile: query rows per attention tile of extend steps
            (``planning.PlanOptions.query_tile``).
          dp_padding: layout of the ``"none"`` backend's DP gathers: "auto" picks MAX_LEN or
            SUM_LEN per step (SGLang's rule, where SUM_LEN's bucketed buffer is the smaller:
            unequal ranks; ``jtbo.runner.planning``), "max_len" / "sum_len" force one ("sum_len"
            needs ``moe_a2a_backend="none"``; EP steps have no DP gather and take MAX_LEN).
          peer_timeout_s: several processes: a process whose heartbeat stopped this long ago
            counts as failed and every other process ends (``jtbo.runner.failure``).
          check_finite_logits: raise ``NonFiniteLogitsError`` (naming the DP rank and the
            request) when a step's logits hold a NaN or an infinity; off saves a scan of the
            logits per step (``python -m jtbo.bench tbo --no-numerics-guard``).
          ep_routing_stats: an EP routing-statistics file (``save_ep_routing_stats``,
            ``jtbo.runner.ep_stats_file``): the dispatch sizes it lists get capacities of
            ``moe.ep_capacity_headroom`` times its measured peak loads instead of
            ``moe.ep_capacity_factor`` times the balanced load.
          params_from: another runner of the same model object on the same mesh, dtype and
            ``moe_a2a_backend``, whose device parameters this runner reads instead of placing
            a second copy (a step never writes its parameters; the benchmark's runners share
            one copy this way).

        Raises:
          ValueError: a mesh without the right axes, shapes that do not divide over it, a
            backend that cannot serve the model, bad sizes, a bad plan file (names the field).
        """
        moe = moe or layer_ops.MoEOptions()
        tbo = tbo or tbo_options.TboOptions()
        self.parallel = parallel_config(model.config, mesh, moe, tbo, attention_backend)
        if max_total_tokens < 1 or max_running_requests < 1:
            raise ValueError(
                f"max_total_tokens={max_total_tokens} and max_running_requests="
                f"{max_running_requests} must be >= 1"
            )
        config = model.config
        self.max_context_len = _max_context_len(config, max_total_tokens, max_context_len)
        self.dp_size, self.attn_tp_size = mesh.shape["dp"], self.parallel.attn_tp_size
        self.config, self.mesh, self.dtype, self.tbo = config, mesh, dtype, tbo
        self.dp_rank_owners = distributed.dp_rank_owners(mesh)
        self.local_dp_ranks = distributed.local_dp_ranks(self.dp_rank_owners)
        self.multiprocess = distributed.is_multiprocess(mesh)
        self.max_total_tokens, self.max_running_requests = max_total_tokens, max_running_requests
        buckets = token_buckets or split.default_token_buckets(max_total_tokens)
        self.options = planning.PlanOptions(
            attn_tp_size=self.attn_tp_size,
            token_buckets=tuple(int(b) for b in buckets),
            seq_capacity=max_running_requests,
            max_context=self.max_context_len,
            enable_tbo=tbo.enabled,
            threshold=tbo.tbo_token_distribution_threshold,
            child_buckets=tbo.tbo_child_buckets,
            query_tile=query_tile,
            attention_backend=self.parallel.attention_backend,
            dp_padding=planning.dp_padding_for_backend(dp_padding, moe.moe_a2a_backend),
        )
        _warn_about_process_env(mesh, tbo.enabled, moe.exchange(True))
        self._tbo_auto = None
        if tbo.auto:
            known = () if tbo.tbo_plan is None else tbo_plan_file.load(tbo.tbo_plan)
            self._tbo_auto = tbo_auto.TboAuto(
                tbo.tbo_auto_trials, tbo.tbo_auto_margin, tbo.tbo_timer or tbo_auto.wall_timer,
                known,
            )  # fmt: skip
        self._place_params(model, params_from)
        measured = self._load_routing_stats(ep_routing_stats)
        self._init_kv()
        self.check_finite_logits = check_finite_logits
        self.last_step_phases: step_phases.StepPhases | None = None  # of the last run_plan
        self._fingerprint = step_exchange.fingerprint(
            self.options, self.parallel, config, jnp.dtype(dtype).name, mesh.devices.shape,
            [d.id for d in mesh.devices.flat], self.dp_rank_owners, tbo.agreed_part(),
            check_finite_logits, self.tbo_decisions(), sorted(measured.items()),
        )  # fmt: skip
        self._exchanges = 0
        self._monitor = failure.monitor(peer_timeout_s) if self.multiprocess else None
        self.num_steps = 0
        self.num_tbo_steps = 0
        self.num_reruns = 0
        self._last_ep_load = ((), None)  # the last run's dispatchers and peak loads

    def ep_routing_model(self) -> dict:
        """What this runner's EP peak loads depend on: the ``model`` object of its routing
        statistics file (``ep_stats_file.model_key``: experts, top-k, EP size, dedup)."""
        return ep_stats_file.model_key(
            self.config.num_experts, self.config.num_experts_per_tok, self.mesh.devices.size,
            self.parallel.moe.ep_dedup,
        )  # fmt: skip

    def _load_routing_stats(self, path) -> dict[int, tuple[int, int]]:
        """Sizes the EP dispatchers on a routing-statistics file's peaks; returns them."""
        if path is None:
            return {}
        if self.parallel.moe.moe_a2a_backend != "ep":
            raise ValueError(
                "ep_routing_stats sizes expert-parallel exchanges; moe_a2a_backend="
                f"{self.parallel.moe.moe_a2a_backend!r} has none"
            )
        peaks = ep_stats_file.load(path, self.ep_routing_model())
        self._step.dispatchers.use_measured_peaks(peaks)
        return peaks

    def ep_routing_stats(self) -> dict[int, tuple[int, int]]:
        """The largest EP peak loads this runner's steps reported, by dispatch size.

        Returns:
          Token rows per device -> ``(peer, expert)`` peak load (the most assignments, or
          dedup rows, one peer and one local expert were given in one dispatch), over every
          step run so far, re-runs included; empty without EP.
        """
        return self._step.dispatchers.observed_peaks()

    def save_ep_routing_stats(self, path: str | os.PathLike) -> None:
        """Writes ``ep_routing_stats()`` for a later runner's ``ep_routing_stats=path``.

        Args:
          path: the JSON file to (over)write (``ep_stats_file`` has the format).
        """
        ep_stats_file.save(path, self.ep_routing_model(), self.ep_routing_stats())

    def _place_params(self, model: model_lib.MoEModel, params_from) -> None:
        """Casts the model to the runner's dtype, builds its step and puts its parameters on
        the mesh (every process holds the full parameters and fills its own devices), or
        reads ``params_from``'s."""
        self._model_ref = weakref.ref(model)  # for params_from; the host model is not kept
        served = model_lib.cast(model, self.dtype)
        self._step = step.make_step(served, self.mesh, self.parallel)
        if params_from is not None:
            self._params = _shared_params(params_from, model, self)
            return
        _, params = step.split_params(served)
        shardings = jax.tree.map(
            lambda spec: jax.sharding.NamedSharding(self.mesh, spec),
            step.param_specs(params, self.parallel.moe.moe_a2a_backend),
        )
        if self.multiprocess:
            self._params = jax.tree.map(distributed.full_value_array, params, shardings)
        else:
            self._params = jax.device_put(params, shardings)

    def _init_kv(self) -> None:
        heads, k_dim, v_dim = self.config.kv_pool_heads(self.attn_tp_size)
        # Slot 0 is the padding slot.
        shape = (self.dp_size, self.config.num_layers, self.max_total_tokens + 1, heads)
        kv_sharding = step.kv_cache_shardings(self.mesh).k

        def zeros(dim):  # created in place on each device (also other processes' devices)
            return jax.jit(lambda: jnp.zeros((*shape, dim), self.dtype), out_shardings=kv_sharding)

        # An MLA latent pool has no value width (config.kv_pool_heads): no value pool.
        self._k, self._v = zeros(k_dim)(), zeros(v_dim)() if v_dim else None
        # The page table lives on the devices; each step writes its new tokens' slots into
        # it (planning's page_writes). Unrecorded positions hold slot 0, the padding slot.
        table = (self.dp_size, self.max_running_requests, self.max_context_len)
        self.req_to_token = jax.jit(
            lambda: jnp.zeros(table, jnp.int32),
            out_shardings=step.kv_cache_shardings(self.mesh).req_to_token,
        )()
        # Recorded leading KV positions per request row (kv_table.check_context).
        self.kv_filled = np.zeros((self.dp_size, self.max_running_requests), np.int64)
        self._no_tokens = None  # [dp, rows] zeros: prev_tokens of a step that reads none

    def _check_writes(self, rank: int, batch: split.ForwardBatch):
        """Checks a batch's KV writes against rank ``rank``'s table and records their
        positions in ``kv_filled``; returns the writes (``kv_table.page_writes``)."""
        if rank not in self.local_dp_ranks:
            raise ValueError(f"DP rank {rank} is not driven by this process {self.local_dp_ranks}")
        return kv_table.page_writes(
            batch, self.req_to_token.shape[1:], self.num_slots, self.kv_filled[rank]
        )

    def record(self, rank: int, batch: split.ForwardBatch) -> None:
        """Records a batch's new-token KV slots in rank ``rank``'s page table without running
        it (``forward`` and ``dispatch`` record their batches inside the step).

        Raises:
          ValueError: several processes (their tables change only inside steps, in
            lockstep), a rank this process does not drive, a request row, KV position or slot
            outside the table / pool, or a request row written past its recorded context
            (``kv_table.check_context``: its attention would read the padding slot).
        """
        if self.multiprocess:
            raise ValueError("record() needs a single process; forward() records its batches")
        rows, positions, slots = self._check_writes(rank, batch)
        self.req_to_token = _write_table(self.req_to_token, rank, rows, positions, slots)

    @property
    def num_slots(self) -> int:
        """KV-pool slots per DP rank, the padding slot 0 included."""
        return self.max_total_tokens + 1

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per bucket, attention kind, sequence bucket, TBO and DP
        padding key)."""
        return self._step.compile_count()

    def forward(
        self, batches: Sequence[split.ForwardBatch | None], *, logits: str = "all"
    ) -> list[np.ndarray | None]:
        """Runs one step over every DP rank (of every process).

        Args:
          batches: one unpadded host ``ForwardBatch`` per DP rank this process drives
            (``local_dp_ranks``: every rank for a single process; None: the rank is idle).
            The caller owns request rows and KV slots (``req_pool_indices``,
            ``out_cache_loc``); the runner records them in its page table.
          logits: ``"all"``: every token's row; ``"last"``: each sequence's last token only
            (what a sampler reads; ``jtbo.runner.last_rows``): the step runs the LM head on
            those rows only, and only they reach the host (the numerics guard checks them).
            Extend and decode batches.

        Returns:
          Per local rank, float32 logits as numpy, ``[num_tokens, vocab]`` (``"all"``) or
          ``[batch_size, vocab]`` in sequence order (``"last"``), or None for idle ranks. A
          step where every rank of every process is idle does no device work.

        Raises:
          ValueError: wrong number of batches, a bad token id, a batch that does not fit, a
            request written past its recorded KV context (``kv_table.check_context``), an
            unknown ``logits``, ``"last"`` for a target-verify batch; with several processes
            also ``step_exchange.StepRejectedError`` on every other process.
          ExpertCapacityError: the step dropped routed tokens (raise ``ep_capacity_factor``).
        """
        last_rows.check_mode(logits)
        return self._forward(batches, logits == "last")[0]

    def step_idle(self) -> bool:
        """Takes part in one step with every rank of this process idle.

        A process that has run out of work calls this while others may still be serving, so
        that their steps' collectives still have every process.

        Returns:
          Whether some rank of some process had work (so the step ran on the devices).
        """
        return self._forward([None] * len(self.local_dp_ranks))[1]

    def _phase(self, step, name: str, *, collective: bool, agreed: tuple[type, ...] = ()):
        """A ``failure.FailureMonitor`` phase (multi-process), else a no-op context."""
        if self._monitor is None:
            return contextlib.nullcontext()
        return self._monitor.phase(step, name, collective=collective, agreed=agreed)

    def failure_phase(self, name: str, *, collective: bool):
        """A context in which an exception counts as this process's failure (several processes).

        Code that runs between steps in lockstep with other processes (the serving loop of
        ``generate``) runs in one, so that its errors end the other processes in bounded time
        instead of leaving them in the next step's collectives (``jtbo.runner.failure``).

        Args:
          name: the phase's name in messages.
          collective: whether the body waits on other processes.

        Returns:
          A context manager (a no-op for a single process).
        """
        return self._phase(lambda: self._exchanges, name, collective=collective)

    def _agree(self, batches, last: bool, check=None):
        """Validates this process's batches and agrees on the step with every process.

        ``check()`` validates a caller's other inputs in the same place, so that a refusal
        raises on every process before any device work.

        Returns:
          ``(step number, local ranks, decision, picked rows or None)``.
        """
        step = self._exchanges
        local, error, picked = [], None, None
        try:
            if check is not None:  # before _prepare_local records the batches' positions
                check()
            local = self._prepare_local(batches)
            if last:  # a bad batch is refused on every process, before any device work
                picked = [np.zeros(0, np.int32) if b is None else last_rows.last_rows(b)
                          for b in batches]  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - re-raised on every process by the exchange
            error = exc
        summaries = {r: item.summary for r, item in zip(self.local_dp_ranks, local, strict=False)}
        report = step_exchange.LocalReport(step, self._fingerprint, summaries, error)
        self._exchanges += 1  # counts refused steps too: every process took part in them
        # Raised alike on every process (a refused batch, a plan no rank can run): no failure.
        agreed = (ValueError, step_exchange.ProcessFailedError, type(error or ValueError()))
        with self._phase(step, "exchange", collective=True, agreed=agreed):
            decision = planning.decide(
                step_exchange.exchange(report, self.dp_rank_owners), self.options
            )
        return step, local, decision, picked

    def _forward(self, batches, last: bool = False) -> tuple[list[np.ndarray | None], bool]:
        step, local, decision, picked = self._agree(batches, last)
        if decision.all_idle:
            return [None] * len(batches), False
        plan, logits, finite = self._plan_and_run(local, decision, step, picked)
        counts = (
            plan.num_tokens
            if picked is None
            else dict(zip(plan.ranks, map(len, picked), strict=True))
        )
        out = [
            None if b is None else logits[i, : counts[rank]]
            for i, (rank, b) in enumerate(zip(plan.ranks, batches, strict=True))
        ]
        if finite is not None:
            with self._phase(step, "numerics guard", collective=False):
                numerics.check_finite(finite, plan.ranks, batches, plan.num_tokens, picked)
        return out, True

    def _plan_and_run(self, local, decision, step: int, picked=None):
        """Assembles the step (with "auto": in the shape's chosen mode) and runs it once.

        ``picked``: per local rank, the token rows whose logits the step computes
        (``last_rows``), or None for every row.

        Returns:
          ``(plan, logits rows of plan.ranks, finite rows or None)``.
        """
        plan = self._choose_plan(local, decision, step, picked)
        with self._phase(step, "device step", collective=True, agreed=(ExpertCapacityError,)):
            logits, finite = self._run(plan, self.check_finite_logits)
        return plan, logits, finite

    def _choose_plan(self, local, decision, step: int, picked, finish=None, run=None):
        """Assembles the step (with "auto": in the shape's chosen mode, timing a new shape).

        ``finish(plan)`` adds a caller's inputs to an assembled plan; ``run(plan)`` runs one
        synchronously (the timing runs; default ``_execute``).
        """
        shape = None if self._tbo_auto is None else tbo_auto.shape_of(decision)
        if shape is not None:
            known = self._tbo_auto.decision(shape)
            if known is None:
                known = self._decide_shape(shape, local, decision, step, picked, finish, run)
            decision = decision if known.use_tbo else planning.without_tbo(decision)
        with self._phase(step, "assemble", collective=False):
            plan = planning.assemble(local, self.local_dp_ranks, decision, self.options, picked)
            return plan if finish is None else finish(plan)

    def _decide_shape(
        self, shape, local, decision, step: int, picked, finish=None, run=None
    ) -> tbo_auto.TboDecision:
        """Times both programs of a new shape on this step's inputs and logits rows
        (``tbo_auto``).

        The trial runs change only the KV slots this step writes; the real run that follows
        rewrites each of them before reading it, so the step's result is exactly one run of
        the chosen program's.
        """
        ranks = self.local_dp_ranks
        finish = finish or (lambda plan: plan)
        run = run or self._execute
        with self._phase(step, "assemble", collective=False):
            tbo_plan = finish(planning.assemble(local, ranks, decision, self.options, picked))
            plain_decision = planning.without_tbo(decision)
            plain = finish(planning.assemble(local, ranks, plain_decision, self.options, picked))
        with self._phase(step, "timing TBO", collective=True):
            return self._tbo_auto.decide(shape, lambda: run(plain), lambda: run(tbo_plan))

    def dispatch(
        self,
        batches: Sequence[split.ForwardBatch | None],
        *,
        sampling: Sequence[token_step.RowSampling | None] | None = None,
        token_sources: Sequence[np.ndarray | None] | None = None,
        after: token_step.PendingStep | None = None,
        logprobs: bool = False,
    ) -> token_step.PendingStep:
        """Starts a step that samples one token per sequence on the devices; does not wait.

        The step records its batches' KV slots, runs the model, samples each sequence's next
        token from its last row (greedy, or ``sampling``'s temperature / top-p draws) and keeps
        ``[dp, max_running_requests]`` token ids on the devices (``jtbo.runner.token_step``).
        ``resolve`` reads them. The host may dispatch the next step first: its decode rows can
        read this step's tokens on the devices (``token_sources`` with ``after``).

        Args:
          batches: as ``forward``'s (extend and decode batches). Ids of rows that
            ``token_sources`` names may be any valid id (they are replaced).
          sampling: per local rank, its sequences' parameters (None: greedy); None: all
            greedy.
          token_sources: per local rank, ``[num_tokens]`` rows of ``after``'s token output that
            give the row's input id (-1: the batch's id); None: every id from the batches.
          after: the step whose tokens ``token_sources`` reads (dispatched before this one).
          logprobs: also return each token's log-probability (every process passes the same).

        Returns:
          The ``token_step.PendingStep``.

        Raises:
          ValueError: what ``forward(logits="last")`` raises, per-rank inputs of the wrong
            length, token sources outside ``after``'s rows or without ``after``.
          ExpertCapacityError: a timing run of a new "auto" shape dropped routed tokens.
        """
        count = len(self.local_dp_ranks)
        sampling = list(sampling or [None] * count)
        token_sources = list(token_sources or [None] * count)
        rows = self.max_running_requests

        check = functools.partial(
            token_step.check_step_inputs, batches, sampling, token_sources, after is not None, rows
        )
        step, local, decision, picked = self._agree(batches, True, check)
        pending = token_step.PendingStep(step, None, list(batches), picked)
        if decision.all_idle:
            pending.result = [None] * count
            return pending
        # Several processes do not see each other's rows: they always take the sampling
        # program, so that every process compiles the same one.
        greedy = not self.multiprocess and all(s is None or s.greedy for s in sampling)
        pending.sampler = step_io.SamplerKey(rows, greedy_only=greedy, logprobs=logprobs)
        finish = functools.partial(
            token_step.add_token_inputs, token_sources=token_sources, sampling=sampling,
            rows=rows, greedy=greedy,
        )  # fmt: skip
        run = functools.partial(
            self._execute, sampler=pending.sampler, prev_tokens=self._prev_tokens(after)
        )
        pending.plan = self._choose_plan(local, decision, step, picked, finish, run)
        pending.after = after
        with self._phase(step, "device step", collective=True, agreed=(ExpertCapacityError,)):
            self._launch_pending(pending, time.perf_counter())
        self.num_steps += 1
        self.num_tbo_steps += pending.plan.child_capacity is not None
        return pending

    def run_token_plan(self, plan: planning.StepPlan) -> dict:
        """Enqueues a planned greedy token step and returns its device outputs, unread.

        For benchmarks: runs enqueued back to back take the devices' time of the step, the
        host's work hidden under it. Nothing is checked (no EP counts, no numerics guard), the
        step is not counted, and its decode rows read their ids from the plan.

        Args:
          plan: a plan with ``logits="last"`` rows (``planning.plan_step_for_ranks``); its
            KV writes are recorded by the step. A plan without ``token_source`` gets one
            (every id from the plan) added in place.

        Returns:
          The step's device ``tokens`` and ``finite`` ``[dp, max_running_requests]``.
        """
        rows = self.max_running_requests
        if plan.per_rank.token_source is None:
            plan = token_step.add_token_inputs(
                plan, [None] * len(plan.ranks), None, rows, greedy=True
            )
        dispatchers = self._step.dispatchers.for_step(plan.capacity, plan.child_capacity)
        inputs = self._step_inputs(plan)
        sampler = step_io.SamplerKey(rows)
        return self._launch(plan, inputs, dispatchers, sampler, self._prev_tokens(None))[0]

    def _prev_tokens(self, after: token_step.PendingStep | None) -> jax.Array:
        """The token output a step's ``token_source`` rows read (zeros without ``after``)."""
        if after is not None and after.outputs is not None:
            return after.outputs["tokens"]
        if self._no_tokens is None:
            shape = (self.dp_size, self.max_running_requests)
            self._no_tokens = jax.jit(
                lambda: jnp.zeros(shape, jnp.int32),
                out_shardings=jax.sharding.NamedSharding(
                    self.mesh, jax.sharding.PartitionSpec(mesh_lib.DP_AXIS)
                ),
            )()
        return self._no_tokens

    def _launch_pending(self, pending: token_step.PendingStep, start: float) -> None:
        """Enqueues a pending step's program (again, after an EP overflow or a re-run of the
        step it reads tokens from)."""
        if pending.inputs is None:
            pending.inputs = self._step_inputs(pending.plan)
            pending.dispatchers = self._step.dispatchers.for_step(
                pending.plan.capacity, pending.plan.child_capacity
            )
        pending.clock = [start, time.perf_counter()]
        launched = self._launch(
            pending.plan, pending.inputs, pending.dispatchers, pending.sampler,
            self._prev_tokens(pending.after),
        )  # fmt: skip
        pending.outputs, pending.overflow, pending.peak_load = launched
        pending.after_runs = 0 if pending.after is None else pending.after.runs
        pending.clock.append(time.perf_counter())

    def resolve(self, pending: token_step.PendingStep) -> list[token_step.StepTokens | None]:
        """Waits for a dispatched step and reads its tokens.

        A step that dropped routed tokens re-runs (policy "rerun"), and so does a step whose
        ``after`` step re-ran since (it read that step's tokens and K/V); resolve steps in
        the order they were dispatched.

        Returns:
          Per local rank, its ``token_step.StepTokens`` (None: idle).

        Raises:
          ExpertCapacityError: the step dropped routed tokens (policy "raise").
          numerics.NonFiniteLogitsError: a sampled row's logits held a NaN or an infinity
            (names the step, the DP rank and the request), when ``check_finite_logits``.
        """
        if pending.result is not None:
            return pending.result
        step = pending.index
        with self._phase(step, "device step", collective=True, agreed=(ExpertCapacityError,)):
            if pending.stale:
                self._launch_pending(pending, time.perf_counter())
                pending.runs += 1
                self.num_reruns += 1
            while True:
                if self.multiprocess:  # waits with the GIL released: the failure monitor runs
                    jax.block_until_ready((pending.outputs, pending.overflow))
                # One wait: the tokens, flags and EP counts come back together.
                host, counts = self._local_rows(
                    pending.outputs, pending.plan, (pending.overflow, pending.peak_load)
                )
                rerun = self._settle(pending.dispatchers, *counts)
                if rerun is None:
                    break
                pending.dispatchers = rerun
                self._launch_pending(pending, time.perf_counter())
                pending.runs += 1
                self.num_reruns += 1
        pending.clock.append(time.perf_counter())
        self.last_step_phases = step_phases.from_clock(pending.clock)
        if self.check_finite_logits:
            with self._phase(step, "numerics guard", collective=False):
                token_step.check_finite_tokens(host["finite"], pending, step)
        pending.result = token_step.step_tokens(host, pending)
        return pending.result

    def _local_rows(self, outputs: dict, plan: planning.StepPlan, replicated):
        """This process's ranks' rows of a step's device outputs and the ``replicated``
        arrays, as numpy."""
        if self.multiprocess:
            rows = {k: distributed.local_rank_rows(v, plan.ranks) for k, v in outputs.items()}
            return rows, jax.device_get(replicated)
        return jax.device_get((outputs, replicated))

    def tbo_decisions(self) -> tuple[tbo_auto.TboDecision, ...]:
        """An "auto" runner's TBO choice per step shape, with both programs' timings.

        Returns:
          One frozen ``tbo_auto.TboDecision`` per shape decided so far (timed or from the
          plan file), by mode and then bucket; empty for a runner with TBO on or off.
        """
        return () if self._tbo_auto is None else self._tbo_auto.decisions()

    def save_tbo_plan(self, path: str | os.PathLike) -> None:
        """Writes ``tbo_decisions()`` as a plan file for ``TboOptions(tbo_plan=path)``.

        Args:
          path: the JSON file to (over)write (``tbo_plan_file`` has the format).

        Raises:
          ValueError: the runner is not "auto" (it has no decisions to save).
        """
        if self._tbo_auto is None:
            raise ValueError(
                "save_tbo_plan needs enable_two_batch_overlap='auto', got "
                f"{self.tbo.enable_two_batch_overlap!r}"
            )
        tbo_plan_file.save(path, list(self.tbo_decisions()))

    def tbo_summary(self) -> str:
        """How many steps ran TBO and why (``tbo_auto.steps_summary``), e.g. "TBO on 12 of 20
        steps: decode bucket 8 plain (TBO 1.31x plain), extend bucket 64 TBO (TBO 0.97x
        plain)"."""
        return tbo_auto.steps_summary(
            self.num_steps, self.num_tbo_steps, self.tbo.enable_two_batch_overlap,
            self.tbo_decisions(),
        )  # fmt: skip

    def _prepare_local(self, batches) -> list[planning.LocalRank]:
        """Validates and records this process's batches; returns their summaries."""
        ranks = self.local_dp_ranks
        if len(batches) != len(ranks):
            raise ValueError(
                f"got {len(batches)} batches for the {len(ranks)} DP ranks {ranks} this process "
                f"drives (dp_size={self.dp_size})"
            )
        full = [planning.idle_batch() if b is None else b for b in batches]
        for rank, batch in zip(ranks, full, strict=True):
            self._validate(rank, batch)
        for rank, batch in zip(ranks, full, strict=True):
            self._check_writes(rank, batch)  # the step writes them into the device table
        return [planning.summarize(batch, self.options) for batch in full]

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
        if not batch.forward_mode.is_idle() and (batch.batch_size == 0 or ids.size == 0):
            raise ValueError(
                f"rank {rank}: a {batch.forward_mode.name} batch with no work (batch_size="
                f"{batch.batch_size}, len(input_ids)={ids.size}); pass None for an idle rank"
            )
        positions = np.asarray(batch.positions if ids.size else [0])
        if positions.min() < 0 or positions.max() >= self.max_context_len:
            raise ValueError(
                f"rank {rank}: positions span [{positions.min()}, {positions.max()}], outside "
                f"[0, max_context_len={self.max_context_len})"
            )
        try:
            kv_table.check_context(self.kv_filled[rank], batch)
        except ValueError as error:
            raise ValueError(f"rank {rank}: {error}") from error

    def _run(self, plan: planning.StepPlan, check_finite: bool = False):
        """Runs a plan; returns the logits rows of ``plan.ranks`` as numpy and, when
        ``check_finite``, whether each returned row is finite (``[ranks, rows]`` bool; a plan
        with ``logit_rows`` computes and checks those rows only)."""
        logits = self.run_plan(plan)
        finite = numerics.finite_rows(logits) if check_finite else None
        if self.multiprocess:
            rows = distributed.local_rank_rows(logits, plan.ranks)
            return rows, None if finite is None else distributed.local_rank_rows(finite, plan.ranks)
        return np.asarray(logits), None if finite is None else np.asarray(finite)

    def run_plan(self, plan: planning.StepPlan) -> jax.Array:
        """Runs a planned step (``planning.plan_step``) and returns the device logits.

        The plan's KV writes are recorded in the page table by the step itself (the plan's
        ``page_writes``); its batches must have passed ``forward``'s checks or ``record``.

        Returns:
          ``[dp, capacity, vocab]`` float32 logits, still on the devices (with several
          processes a global array: read it with ``distributed.local_rank_rows``).

        Raises:
          ValueError: a plan whose rows are not this process's ranks.
          ExpertCapacityError: the step dropped routed tokens.
        """
        logits = self._execute(plan)
        self.num_steps += 1
        self.num_tbo_steps += plan.child_capacity is not None
        return logits

    def _execute(self, plan: planning.StepPlan, sampler=None, prev_tokens=None) -> jax.Array:
        """``run_plan`` without counting the step (also the runs that time an auto shape);
        with ``sampler`` a token step's outputs (``dispatch``)."""
        if tuple(plan.ranks) != self.local_dp_ranks:
            raise ValueError(
                f"plan rows {plan.ranks} != this process's ranks {self.local_dp_ranks}"
            )
        start = time.perf_counter()
        inputs = self._step_inputs(plan)
        dispatchers = self._step.dispatchers.for_step(plan.capacity, plan.child_capacity)
        clock = [start, time.perf_counter()]  # phase boundaries: inputs, then per run two
        while dispatchers is not None:  # re-runs rewrite the same KV slots before reading them
            logits, overflow, peak_load = self._launch(
                plan, inputs, dispatchers, sampler, prev_tokens
            )
            clock.append(time.perf_counter())
            if self.multiprocess:  # waits with the GIL released: the failure monitor runs
                jax.block_until_ready((logits, overflow, peak_load))
            dispatchers = self._settle(dispatchers, overflow, peak_load)
            self.num_reruns += dispatchers is not None
            clock.append(time.perf_counter())
        self.last_step_phases = step_phases.from_clock(clock)
        return logits

    def _launch(self, plan, inputs, dispatchers, sampler=None, prev_tokens=None):
        """Enqueues one run of a planned step on the runner's pools; returns its device
        ``(logits or token outputs, overflow, peak_load)`` without waiting."""
        cache = kv_cache_lib.KVCache(k=self._k, v=self._v, req_to_token=self.req_to_token)
        out, cache, overflow, peak_load = self._step(
            self._params, cache, inputs, mode=int(plan.mode), child_capacity=plan.child_capacity,
            dispatchers=dispatchers, sampler=sampler, prev_tokens=prev_tokens,
        )  # fmt: skip
        self._k, self._v, self.req_to_token = cache.k, cache.v, cache.req_to_token
        return out, overflow, peak_load

    def _settle(self, dispatchers, overflow, peak_load):
        """Reads a run's EP counts (waiting for it) and applies the overflow policy.

        Returns:
          None when the run stands, else the dispatchers to re-run it with.

        Raises:
          ExpertCapacityError: policy "raise" and the run overflowed.
        """
        if dispatchers:  # one wait for the step, both small copies issued together
            overflow, peak_load = jax.device_get((overflow, peak_load))
            self._step.dispatchers.observe(dispatchers, peak_load)
        self._last_ep_load = (dispatchers, peak_load)
        return self._resolve_overflow(dispatchers, overflow, peak_load)

    def ep_buffer_fill(self) -> list[tuple[float, float]]:
        """How full the last step's EP buffers were, per micro-batch (one without TBO).

        Returns:
          ``(peer, expert)`` fill per dispatcher: the step's peak load (max over layers and
          devices) over ``peer_capacity`` / ``expert_capacity``; above 1 means it overflowed
          (and re-ran or raised). Empty without EP or before the first step. Reads the peak
          loads back from the devices.
        """
        dispatchers, peak_load = self._last_ep_load
        if not dispatchers:
            return []
        peaks = ep_dispatchers.step_peaks(dispatchers, peak_load)
        return [
            (int(peer) / d.peer_capacity, int(expert) / d.expert_capacity)
            for d, (peer, expert) in zip(dispatchers, peaks, strict=True)
        ]

    def _step_inputs(self, plan: planning.StepPlan) -> step.StepInputs:
        """The plan's arrays on the mesh: two packed buffers, two host->device transfers."""
        inputs = step.pack_step_inputs(plan.per_rank, plan.replicated)
        if not self.multiprocess:
            return self._step.put(inputs)
        per_rank, replicated = distributed.global_step_inputs(
            self.mesh, inputs.per_rank, plan.ranks, inputs.replicated, self.dp_size
        )  # this process's rows of [dp, n] / its devices' copies of [m]
        return dataclasses.replace(inputs, per_rank=per_rank, replicated=replicated)

    def _resolve_overflow(self, dispatchers, overflow, peak_load):
        """The dispatchers to re-run the step with, or None when its result stands.

        Raises:
          ExpertCapacityError: policy "raise" and the step overflowed.
        """
        try:
            return self._step.dispatchers.resolve(dispatchers, overflow, peak_load)
        except ep_overflow.CapacityOverflowError as error:
            raise ExpertCapacityError(
                f"{error} [ep_capacity_factor={self.parallel.moe.ep_capacity_factor}; None never "
                "overflows, ep_overflow_policy='rerun' re-runs]"
            ) from error

    def generate(self, prompts, *, max_new_tokens: int, dp_rank_of=None, **kwargs):
        """Greedy generation for many prompts; see ``jtbo.runner.generate.generate``.

        With several processes every process passes the same prompts; each serves the prompts
        of its own DP ranks and every process gets all results
        (``jtbo.runner.multiprocess_generate``).

        Returns:
          One ``GenerationResult`` (token ids, or the error that rejected it) per prompt.
        """
        if self.multiprocess:
            return multiprocess_generate.generate(
                self, prompts, max_new_tokens=max_new_tokens, dp_rank_of=dp_rank_of, **kwargs
            )
        return generate_lib.generate(
            self, prompts, max_new_tokens=max_new_tokens, dp_rank_of=dp_rank_of, **kwargs
        )

    def warmup(
        self,
        token_counts: Sequence[int],
        modes: Sequence[ForwardMode],
        seq_counts: Sequence[int] = (1,),
        outputs: str = "logits",
    ) -> int:
        """Compiles the steps of the given token counts and modes before serving.

        With several processes, every process calls it with the same arguments.

        Runs a synthetic step (rank 0 busy, the rest idle) with the static keys a real step of
        that many tokens in that mode has; its K/V writes target the padding slot (dropped). An
        "auto" runner compiles both the plain and the TBO program of each (it decides later,
        on real steps). A TBO step compiles at each of its bucket's child capacities
        (``planning.child_capacities``): a real step's split picks one of them. With
        ``dp_padding="auto"`` the programs are MAX_LEN's (those of steps whose ranks are
        equal); SUM_LEN programs depend on a step's token sum (its bucket) and compile on
        first use. An extend step's attention is sized by its
        sequence bucket (``planning.seq_bucket``): ``seq_counts`` names the sequence counts
        to compile extend programs for (each count's bucket; counts above a token count are
        skipped for it), and a step in another bucket compiles on first use.

        Args:
          token_counts: token counts whose buckets to compile.
          modes: EXTEND, DECODE (TARGET_VERIFY needs a draft size: compile it by serving).
          seq_counts: sequences per rank of the extend programs (decode programs hold one
            sequence per token).
          outputs: "logits" compiles ``forward``'s programs, "tokens" the greedy token
            programs of ``dispatch`` (what ``generate`` runs with greedy sampling).

        Returns:
          The compile count afterwards.

        Raises:
          ValueError: a sequence count below 1 or above ``max_running_requests``, an unknown
            ``outputs``.
        """
        if outputs not in ("logits", "tokens"):
            raise ValueError(f"outputs must be 'logits' or 'tokens', got {outputs!r}")
        bad = [s for s in seq_counts if not 1 <= s <= self.max_running_requests]
        if bad:
            raise ValueError(
                f"seq_counts {bad} outside [1, max_running_requests={self.max_running_requests}]"
            )
        both = (False, True) if self._tbo_auto is not None else (self.options.enable_tbo,)
        for count in token_counts:
            for mode in map(ForwardMode, modes):
                seqs = [count] if mode.is_decode() else [s for s in seq_counts if s <= count]
                for num_seqs, tbo in itertools.product(seqs, both):
                    for plan in self._warmup_plans(count, mode, num_seqs, tbo, outputs):
                        if outputs == "logits":
                            self._run(plan, self.check_finite_logits)
                        else:
                            sampler = step_io.SamplerKey(self.max_running_requests)
                            jax.block_until_ready(
                                self._execute(plan, sampler, self._prev_tokens(None))
                            )
        return self.compile_count

    def _warmup_plans(
        self, count: int, mode: ForwardMode, num_seqs: int, tbo: bool, outputs: str
    ) -> list[planning.StepPlan]:
        """Real plans for one synthetic batch on rank 0 that write only the padding slot: the
        plain plan, or the TBO plan at its child capacity and at each larger one (token
        plans: sampled from each sequence's last row, every id from the host)."""
        batch = _synthetic_batch(mode, count, num_seqs)
        batches = [batch] + [planning.idle_batch()] * (self.dp_size - 1)
        padding = "max_len" if self.options.dp_padding == "auto" else self.options.dp_padding
        options = dataclasses.replace(self.options, enable_tbo=tbo, dp_padding=padding)
        logits = "last" if outputs == "tokens" else "all"
        plans = self._warmup_tbo_plans(batches, options, logits)
        if outputs == "tokens":
            rows = self.max_running_requests
            plans = [
                token_step.add_token_inputs(plan, [None] * len(plan.ranks), None, rows, greedy=True)
                for plan in plans
            ]
        return plans

    def _warmup_tbo_plans(self, batches, options, logits: str) -> list[planning.StepPlan]:
        """``_warmup_plans``' plans before their token inputs."""
        plan = planning.plan_step_for_ranks(batches, self.local_dp_ranks, options, logits=logits)
        if plan.child_capacity is None:
            return [plan]
        larger = [
            child
            for child in planning.child_capacities(plan.capacity, plan.mode, None, options)
            if child > plan.child_capacity
        ]
        return [plan] + [
            planning.plan_step_for_ranks(
                batches, self.local_dp_ranks, options, logits=logits, child_capacity=child
            )
            for child in larger
        ]


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


@functools.partial(jax.jit, donate_argnums=0)
def _write_table(table, rank: int, rows, positions, slots):
    """``table[rank, rows, positions] = slots`` on the devices (``ModelRunner.record``)."""
    return table.at[rank, rows, positions].set(slots)


def _shared_params(source: ModelRunner, model: model_lib.MoEModel, runner: ModelRunner):
    """``source``'s device parameters, if ``runner`` would place the very same ones.

    Raises:
      ValueError: another model object, mesh, dtype or ``moe_a2a_backend`` (they would be
        laid out or valued differently).
    """
    if source._model_ref() is not model:
        raise ValueError("params_from: that runner serves another model object")
    mine = (runner.mesh, jnp.dtype(runner.dtype), runner.parallel.moe.moe_a2a_backend)
    theirs = (source.mesh, jnp.dtype(source.dtype), source.parallel.moe.moe_a2a_backend)
    for name, a, b in zip(("mesh", "dtype", "moe_a2a_backend"), mine, theirs, strict=True):
        if a != b:
            raise ValueError(f"params_from: its {name} {b} differs from this runner's {a}")
    return source._params


def _synthetic_batch(mode: ForwardMode, count: int, num_seqs: int) -> split.ForwardBatch:
    """``count`` tokens (decode: sequences; extend: ``num_seqs`` near-equal prompts) that
    read and write only the padding slot through request row 0."""
    ids = np.zeros(count, np.int32)  # token 0, position 0, KV slot 0 (the padding slot)
    ones = np.ones(count, np.int32)
    if mode.is_decode():
        return split.ForwardBatch(
            forward_mode=mode, batch_size=count, input_ids=ids, positions=ids,
            out_cache_loc=ids, req_pool_indices=ids, seq_lens=ones,
        )  # fmt: skip
    lens = np.full(num_seqs, count // num_seqs)
    lens[: count % num_seqs] += 1
    rows = np.zeros(num_seqs, np.int32)
    return split.ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=num_seqs, input_ids=ids, positions=ids,
        out_cache_loc=ids, req_pool_indices=rows, seq_lens=lens, extend_seq_lens=lens,
        extend_prefix_lens=rows,
    )  # fmt: skip


def parallel_config(
    config, mesh: jax.sharding.Mesh, moe: layer_ops.MoEOptions, tbo: tbo_options.TboOptions,
    attention_backend: str | None,
) -> layer_ops.ParallelConfig:  # fmt: skip
    """The layers' ``ParallelConfig`` on ``mesh``, with the platform defaults (None backends)
    resolved for the model's shapes (``kernel_backends``). It needs only the model's config,
    so a caller can check a layout before loading the weights.

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
    moe = dataclasses.replace(
        moe,
        moe_runner_backend=kernel_backends.moe_runner_backend(
            moe.moe_runner_backend, (config.hidden_size, expert_width)
        ),
    )
    if config.attention_kind == "mla":  # the widths the paged kernel tiles
        whole = (config.kv_lora_rank, config.v_head_dim)
        split = (config.qk_rope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim)
        # The latent row: its value part, then the RoPE part in power-of-two pieces.
        key_parts = max(1 + split[0].bit_count(), split[1].bit_count())
    else:
        whole, split, key_parts = (config.head_dim,), (), 1
    attention_backend = kernel_backends.attention_backend(
        attention_backend, config.attention_kind, whole, split, key_parts
    )
    return layer_ops.ParallelConfig.for_mesh(
        mesh, moe=moe, attention_backend=attention_backend,
        tbo_round_barriers=tbo.tbo_round_barriers, tbo_issue_barriers=tbo.tbo_issue_barriers,
    )  # fmt: skip


def _warn_about_process_env(mesh: jax.sharding.Mesh, enable_tbo: bool, ep_exchange: str) -> None:
    """Warns when a multi-GPU TBO runner's process environment hinders run-time overlap
    (``xla_options.process_env_advice`` for the runner's EP exchange).

    A warning, not an error: the step is still right, only less of its communication runs
    beside compute, and the variable cannot be changed once CUDA has started.
    """
    if (
        not enable_tbo
        or mesh.devices.size < 2
        or mesh_lib.mesh_platform(mesh) not in ("gpu", "cuda")
    ):
        return
    for advice in xla_options.process_env_advice(os.environ, ep_exchange):
        warnings.warn(advice, stacklevel=3)


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
