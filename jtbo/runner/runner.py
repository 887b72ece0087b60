"""``ModelRunner``: serves a ``MoEModel`` on a ``("dp", "attn_tp")`` mesh, TBO on or off.

The runner is a facade over parts that each hold one concern:

* ``runner_config``: the arguments resolved once into a frozen ``RunnerConfig`` (backends,
  buckets, page-table width, TBO and "auto" settings, plan and statistics files);
* ``host_table``: the host's checks of the batches and its record of each request row's KV
  context;
* ``step_agreement``: every process agreeing on a step before any device work, and the failure
  monitor of several processes;
* ``plan_choice``: the agreed step's plan, in the program an "auto" runner chose for its shape;
* ``step_engine``: the devices' side (parameters, KV pools, page table, compiled steps, EP
  overflow re-runs);
* ``warmup`` and ``generate``: compiling ahead, and the serving loop.

``forward(batches)`` takes one host ``ForwardBatch`` per DP rank (None: idle), records the new
tokens' KV slots in the page table, plans the step (bucket, attention kind, DP agreement on
TBO, split, metadata), runs the jitted ``shard_map`` step and returns each rank's logits.
``dispatch(batches)`` runs the same step but samples each sequence's next token on the
devices and returns at once; ``resolve`` reads the tokens back (``jtbo.runner.token_step``;
what ``generate`` runs). One compile per (bucket, attention kind, extend sequence bucket, TBO
child capacity, DP padding mode and SUM_LEN length bucket: ``planning``).

``TboOptions(enable_two_batch_overlap="auto")`` decides TBO per step shape (bucket and agreed
mode) from measured step times (``tbo_auto``); a ``tbo_plan`` file decides shapes without
timing.

Multi-process (``jax.distributed``, one process per host, the mesh over every process's
devices): each DP rank belongs to the process whose devices hold its mesh row
(``distributed.dp_rank_owners``; ``local_dp_ranks`` lists this process's). Every process
builds the runner with the same model, options and mesh and calls ``forward`` in lockstep
with the batches of its own ranks only; the processes exchange their ranks' plan-defining
integers first (``step_agreement``), so all plan the same step and a batch refused on one
process raises on every process. A single process is the special case that owns every rank.
"""

import functools
import os
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import split
from jtbo.collectives import mesh as mesh_lib
from jtbo.models import layer_ops, step_io
from jtbo.models import model as model_lib
from jtbo.overlap import xla_options
from jtbo.runner import (
    ep_stats_file,
    failure,
    host_table,
    last_rows,
    numerics,
    plan_choice,
    planning,
    runner_config,
    step_agreement,
    step_engine,
    step_exchange,
    step_phases,
    tbo_auto,
    tbo_options,
    tbo_plan_file,
    token_step,
    warmup,
)
from jtbo.runner import generate as generate_lib

ForwardMode = split.ForwardMode
ExpertCapacityError = step_engine.ExpertCapacityError


def _config_field(name: str, doc: str) -> property:
    """A read-only runner attribute that reads ``runner_config.<name>``."""
    return property(lambda self: getattr(self.runner_config, name), doc=doc)


def _engine_field(name: str, doc: str) -> property:
    """A read-only runner attribute that reads ``engine.<name>``."""
    return property(lambda self: getattr(self.engine, name), doc=doc)


class ModelRunner:
    """Runs a ``MoEModel`` with DP attention, EP or TP MoE, and optional two-batch overlap.

    ``ModelRunner(model, mesh, **options)`` places the model on the mesh and allocates every
    DP rank's KV pool. Its arguments:

    * ``model``: the model (float32 parameters; cast to ``dtype`` here).
    * ``mesh``: a mesh with axes ``("dp", "attn_tp")`` (``jtbo.collectives.make_mesh``).
    * ``max_total_tokens``: KV slots per DP rank; ``max_running_requests``: requests per DP
      rank (page-table rows, sequences per step).
    * ``max_context_len``: the longest context one request may hold (the page table's
      width); None: the model's ``max_position_embeddings``, at most ``max_total_tokens``.
    * ``moe``: the MoE exchange and experts (``layer_ops.MoEOptions``); None: its defaults.
      ``moe_runner_backend=None`` takes the fastest here that tiles the model
      (``jtbo.runner.kernel_backends``).
    * ``tbo``: two-batch overlap (``tbo_options.TboOptions``); None: off.
    * ``token_buckets``: token capacities of compiled steps; powers of two up to
      ``max_total_tokens`` when None.
    * ``dtype``: parameter, activation and KV dtype.
    * ``attention_backend``: "native" (blocked jnp attention, the exact reference), "pallas"
      (the extend and paged kernels; the Pallas interpreter on the CPU) or "triton" (the
      same kernels in Triton, GPUs only); None: the fastest here that serves the model.
    * ``query_tile``: query rows per attention tile of extend steps.
    * ``dp_padding``: layout of the ``"none"`` backend's DP gathers: "auto" (MAX_LEN or
      SUM_LEN per step), "max_len" or "sum_len" (``jtbo.runner.planning``).
    * ``peer_timeout_s``: several processes: a process whose heartbeat stopped this long ago
      counts as failed and every other process ends (``jtbo.runner.failure``).
    * ``check_finite_logits``: raise ``NonFiniteLogitsError`` (naming the DP rank and the
      request) when a step's logits hold a NaN or an infinity.
    * ``ep_routing_stats``: an EP routing-statistics file (``save_ep_routing_stats``): the
      dispatch sizes it lists get capacities of ``moe.ep_capacity_headroom`` times its
      measured peak loads.
    * ``params_from``: another runner of the same model object on the same mesh, dtype and
      ``moe_a2a_backend``, whose device parameters this runner reads instead of placing a
      second copy.

    The constructor raises ValueError for a mesh without the right axes, shapes that do not
    divide over it, a backend that cannot serve the model, bad sizes, or a bad plan or
    statistics file (naming the field).

    Attributes:
      runner_config: the resolved ``runner_config.RunnerConfig`` every part reads.
      engine: the devices' side (``step_engine.StepEngine``).
      host_table: the batch checks and recorded KV contexts (``host_table.HostTable``).
      agreement: the step exchange and failure monitor (``step_agreement.StepAgreement``).
      plans: the plan assembly and "auto" decisions (``plan_choice.PlanChooser``).
      mesh: the mesh.
      num_steps: device steps run; num_tbo_steps: those run with two-batch overlap (an
        "auto" shape's timing runs are not counted, its real step is).
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
        """See the class docstring."""
        self.runner_config = config = runner_config.resolve(
            model.config, mesh, max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests, max_context_len=max_context_len,
            moe=moe, tbo=tbo, token_buckets=token_buckets, dtype=dtype,
            attention_backend=attention_backend, query_tile=query_tile, dp_padding=dp_padding,
            peer_timeout_s=peer_timeout_s, check_finite_logits=check_finite_logits,
            ep_routing_stats=ep_routing_stats,
        )  # fmt: skip
        self.mesh = mesh
        _warn_about_process_env(mesh, config)
        shared = None if params_from is None else params_from.engine
        self.engine = step_engine.StepEngine(model, mesh, config, shared)
        self.host_table = host_table.HostTable(config)
        ids = [d.id for d in mesh.devices.flat]
        fingerprint = step_exchange.fingerprint(*config.fingerprint_parts(ids, mesh.devices.shape))
        self.agreement = step_agreement.StepAgreement(config, fingerprint)
        self.plans = plan_choice.PlanChooser(config, self.agreement, self.engine.execute)
        self.num_steps = 0
        self.num_tbo_steps = 0

    config = _config_field("model", "The model's ``MoEConfig``.")
    options = _config_field("plan", "The planner's ``planning.PlanOptions``.")
    parallel = _config_field("parallel", "The layers' ``layer_ops.ParallelConfig``.")
    dtype = _config_field("dtype", "Parameter, activation and KV dtype (a name).")
    dp_size = _config_field("dp_size", "DP ranks of the mesh.")
    max_total_tokens = _config_field("max_total_tokens", "KV slots per DP rank.")
    max_running_requests = _config_field("max_running_requests", "Request rows per DP rank.")
    max_context_len = _config_field("max_context_len", "The page table's width.")
    num_slots = _config_field("num_slots", "KV slots per DP rank, the padding slot included.")
    local_dp_ranks = _config_field("local_dp_ranks", "The DP ranks this process drives.")
    dp_rank_owners = _config_field("dp_rank_owners", "Per DP rank, the process driving it.")
    multiprocess = _config_field("multiprocess", "Whether the mesh spans other processes.")
    check_finite_logits = _config_field("check_finite_logits", "Whether steps check logits.")
    req_to_token = _engine_field("req_to_token", "The page table on the devices.")
    num_reruns = _engine_field("num_reruns", "Extra runs: EP overflow and stale token steps.")
    last_step_phases = _engine_field(
        "last_step_phases", "The host phases of the last run (``step_phases.StepPhases``)."
    )

    @property
    def attn_tp_size(self) -> int:
        """Devices per DP rank."""
        return self.runner_config.parallel.attn_tp_size

    @property
    def kv_filled(self) -> np.ndarray:
        """``[dp, rows]`` recorded leading KV positions per request row."""
        return self.host_table.kv_filled

    @property
    def compile_count(self) -> int:
        """Programs compiled so far (one per bucket, attention kind, sequence bucket, TBO and DP
        padding key)."""
        return self.engine.step.compile_count()

    def record(self, rank: int, batch: split.ForwardBatch) -> None:
        """Records a batch's new-token KV slots in rank ``rank``'s page table without running
        it (``forward`` and ``dispatch`` record their batches inside the step).

        Raises:
          ValueError: several processes (their tables change only inside steps, in
            lockstep), a rank this process does not drive, a request row, KV position or slot
            outside the table / pool, or a request row written past its recorded context.
        """
        if self.multiprocess:
            raise ValueError("record() needs a single process; forward() records its batches")
        self.engine.write_table(rank, *self.host_table.check_writes(rank, batch))

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
        return self.agreement.phase(lambda: self.agreement.exchanges, name, collective=collective)

    def _forward(self, batches, last: bool = False) -> tuple[list[np.ndarray | None], bool]:
        """``forward``'s step; also returns whether it ran on the devices."""
        step, local, decision, picked = self.agreement.agree(self.host_table.prepare, batches, last)
        if decision.all_idle:
            return [None] * len(batches), False
        plan = self.plans.choose(local, decision, step, picked)
        with self.agreement.phase(
            step, "device step", collective=True, agreed=(ExpertCapacityError,)
        ):
            logits, finite = self._run(plan, self.check_finite_logits)
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
            with self.agreement.phase(step, "numerics guard", collective=False):
                numerics.check_finite(finite, plan.ranks, batches, plan.num_tokens, picked)
        return out, True

    def _run(self, plan: planning.StepPlan, check_finite: bool = False):
        """Runs a plan (counted); returns the logits rows of ``plan.ranks`` as numpy and, when
        ``check_finite``, whether each returned row is finite."""
        return self.engine.run_logits(plan, self.run_plan(plan), check_finite)

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
        logits = self.engine.execute(plan)
        self._count(plan)
        return logits

    def _count(self, plan: planning.StepPlan) -> None:
        self.num_steps += 1
        self.num_tbo_steps += plan.child_capacity is not None

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
          sampling: per local rank, its sequences' parameters (None: greedy); None: all greedy.
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
        check = functools.partial(
            token_step.check_step_inputs, batches, sampling, token_sources, after is not None,
            self.max_running_requests,
        )  # fmt: skip
        step, local, decision, picked = self.agreement.agree(
            self.host_table.prepare, batches, True, check
        )
        pending = token_step.PendingStep(step, None, list(batches), picked)
        if decision.all_idle:
            pending.result = [None] * count
            return pending
        pending.after = after
        pending.plan = self._token_plan(pending, local, decision, sampling, token_sources, logprobs)
        with self.agreement.phase(
            step, "device step", collective=True, agreed=(ExpertCapacityError,)
        ):
            self.engine.launch_pending(pending, time.perf_counter())
        self._count(pending.plan)
        return pending

    def _token_plan(self, pending, local, decision, sampling, token_sources, logprobs: bool):
        """A token step's plan (in the "auto" program), its sampler set on ``pending``."""
        rows = self.max_running_requests
        # Several processes do not see each other's rows: they always take the sampling
        # program, so that every process compiles the same one.
        greedy = not self.multiprocess and all(s is None or s.greedy for s in sampling)
        pending.sampler = step_io.SamplerKey(rows, greedy_only=greedy, logprobs=logprobs)
        finish = functools.partial(
            token_step.add_token_inputs, token_sources=token_sources, sampling=sampling,
            rows=rows, greedy=greedy,
        )  # fmt: skip
        run = functools.partial(
            self.engine.execute, sampler=pending.sampler,
            prev_tokens=self.engine.prev_tokens(pending.after),
        )  # fmt: skip
        return self.plans.choose(local, decision, pending.index, pending.picked, finish, run)

    def run_token_plan(self, plan: planning.StepPlan) -> dict:
        """Enqueues a planned greedy token step and returns its device outputs, unread.

        For benchmarks: runs enqueued back to back take the devices' time of the step, the
        host's work hidden under it. Nothing is checked (no EP counts, no numerics guard), the
        step is not counted, and its decode rows read their ids from the plan.

        Args:
          plan: a plan with ``logits="last"`` rows (``planning.plan_step_for_ranks``); its
            KV writes are recorded by the step. A plan without ``token_source`` gets one
            (every id from the plan).

        Returns:
          The step's device ``tokens`` and ``finite`` ``[dp, max_running_requests]``.
        """
        rows = self.max_running_requests
        if plan.per_rank.token_source is None:
            plan = token_step.add_token_inputs(
                plan, [None] * len(plan.ranks), None, rows, greedy=True
            )
        engine = self.engine
        inputs, dispatchers = engine.step_inputs(plan), engine.dispatchers_for(plan)
        sampler = step_io.SamplerKey(rows)
        return engine.launch(plan, inputs, dispatchers, sampler, engine.prev_tokens(None))[0]

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
        with self.agreement.phase(
            step, "device step", collective=True, agreed=(ExpertCapacityError,)
        ):
            host = self.engine.settle_pending(pending)
        pending.clock.append(time.perf_counter())
        self.engine.last_step_phases = step_phases.from_clock(pending.clock)
        if self.check_finite_logits:
            with self.agreement.phase(step, "numerics guard", collective=False):
                token_step.check_finite_tokens(host["finite"], pending, step)
        pending.result = token_step.step_tokens(host, pending)
        return pending.result

    def tbo_decisions(self) -> tuple[tbo_auto.TboDecision, ...]:
        """An "auto" runner's TBO choice per step shape, with both programs' timings.

        Returns:
          One frozen ``tbo_auto.TboDecision`` per shape decided so far (timed or from the
          plan file), by mode and then bucket; empty for a runner with TBO on or off.
        """
        return self.plans.decisions()

    def save_tbo_plan(self, path: str | os.PathLike) -> None:
        """Writes ``tbo_decisions()`` as a plan file for ``TboOptions(tbo_plan=path)``.

        Args:
          path: the JSON file to (over)write (``tbo_plan_file`` has the format).

        Raises:
          ValueError: the runner is not "auto" (it has no decisions to save).
        """
        if not self.runner_config.auto:
            raise ValueError(
                "save_tbo_plan needs enable_two_batch_overlap='auto', got "
                f"{self.runner_config.tbo_switch!r}"
            )
        tbo_plan_file.save(path, list(self.tbo_decisions()))

    def tbo_summary(self) -> str:
        """How many steps ran TBO and why (``tbo_auto.steps_summary``), e.g. "TBO on 12 of 20
        steps: decode bucket 8 plain (TBO 1.31x plain), extend bucket 64 TBO (TBO 0.97x
        plain)"."""
        return tbo_auto.steps_summary(
            self.num_steps, self.num_tbo_steps, self.runner_config.tbo_switch,
            self.tbo_decisions(),
        )  # fmt: skip

    def ep_routing_model(self) -> dict:
        """What this runner's EP peak loads depend on: the ``model`` object of its routing
        statistics file (``ep_stats_file.model_key``: experts, top-k, EP size, dedup)."""
        config = self.runner_config
        return runner_config.ep_routing_model(
            config.model, self.mesh.devices.size, config.parallel.moe
        )

    def ep_routing_stats(self) -> dict[int, tuple[int, int]]:
        """The largest EP peak loads this runner's steps reported, by dispatch size.

        Returns:
          Token rows per device -> ``(peer, expert)`` peak load (the most assignments, or
          dedup rows, one peer and one local expert were given in one dispatch), over every
          step run so far, re-runs included; empty without EP.
        """
        return self.engine.step.dispatchers.observed_peaks()

    def save_ep_routing_stats(self, path: str | os.PathLike) -> None:
        """Writes ``ep_routing_stats()`` for a later runner's ``ep_routing_stats=path``.

        Args:
          path: the JSON file to (over)write (``ep_stats_file`` has the format).
        """
        ep_stats_file.save(path, self.ep_routing_model(), self.ep_routing_stats())

    def ep_buffer_fill(self) -> list[tuple[float, float]]:
        """How full the last step's EP buffers were, per micro-batch (one without TBO).

        Returns:
          ``(peer, expert)`` fill per dispatcher: the step's peak load (max over layers and
          devices) over ``peer_capacity`` / ``expert_capacity``; above 1 means it overflowed
          (and re-ran or raised). Empty without EP or before the first step. Reads the peak
          loads back from the devices.
        """
        return self.engine.ep_buffer_fill()

    def generate(self, prompts, *, max_new_tokens: int, **kwargs):
        """Generation for many prompts (``jtbo.runner.generate.generate``, whose keywords it
        takes). With several processes every process passes the same prompts and gets every
        result.

        Returns:
          One ``GenerationResult`` (token ids, or the error that rejected it) per prompt.
        """
        return generate_lib.generate(self, prompts, max_new_tokens=max_new_tokens, **kwargs)

    def warmup(
        self,
        token_counts: Sequence[int],
        modes: Sequence[ForwardMode],
        seq_counts: Sequence[int] = (1,),
        outputs: str = "logits",
    ) -> int:
        """Compiles the steps of the given token counts and modes before serving
        (``jtbo.runner.warmup``). With several processes, every process calls it alike.

        An extend step's attention is sized by its sequence bucket (``planning.seq_bucket``):
        ``seq_counts`` names the sequence counts to compile extend programs for (counts above
        a token count are skipped for it); other buckets, and SUM_LEN programs, compile on
        first use.

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
        run_logits = functools.partial(self._run, check_finite=self.check_finite_logits)
        warmup.warmup(
            self.runner_config, self.engine, run_logits, token_counts, modes, seq_counts, outputs
        )
        return self.compile_count


def _warn_about_process_env(mesh: jax.sharding.Mesh, config: runner_config.RunnerConfig) -> None:
    """Warns when a multi-GPU TBO runner's process environment hinders run-time overlap
    (``xla_options.process_env_advice`` for the runner's EP exchange).

    A warning, not an error: the step is still right, only less of its communication runs
    beside compute, and the variable cannot be changed once CUDA has started.
    """
    if (
        not config.plan.enable_tbo
        or mesh.devices.size < 2
        or mesh_lib.mesh_platform(mesh) not in ("gpu", "cuda")
    ):
        return
    for advice in xla_options.process_env_advice(os.environ, config.parallel.moe.exchange(True)):
        warnings.warn(advice, stacklevel=3)
