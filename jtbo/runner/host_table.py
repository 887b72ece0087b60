"""The host's checks of the batches a ``ModelRunner`` is given, and its record of the KV
context each request row holds.

The page table itself lives on the devices (``step_engine``); the host keeps, per DP rank and
request row, how many leading KV positions have been recorded (``kv_filled``), so that a batch
that would attend to a position nobody wrote (the padding slot) is refused before any device
work (``kv_table.check_context``). ``HostTable.prepare`` checks one step's batches of this
process's ranks (counts, token ids, sizes, positions, context), records their writes, and
returns the planner's summaries of them.
"""

import numpy as np

from jtbo import split
from jtbo.runner import kv_table, planning, runner_config


class HostTable:
    """Batch checks and the recorded KV context per request row (module docstring).

    Attributes:
      kv_filled: ``[dp, rows]`` recorded leading KV positions per request row.
    """

    def __init__(self, config: runner_config.RunnerConfig):
        self.config = config
        self.kv_filled = np.zeros((config.dp_size, config.max_running_requests), np.int64)

    def check_writes(self, rank: int, batch: split.ForwardBatch):
        """Checks a batch's KV writes against rank ``rank``'s table and records their
        positions in ``kv_filled``; returns the writes (``kv_table.page_writes``).

        Raises:
          ValueError: a rank this process does not drive, a row, position or slot outside
            the table or pool, a write past the row's recorded context.
        """
        config = self.config
        if rank not in config.local_dp_ranks:
            raise ValueError(
                f"DP rank {rank} is not driven by this process {config.local_dp_ranks}"
            )
        table = (config.max_running_requests, config.max_context_len)
        return kv_table.page_writes(batch, table, config.num_slots, self.kv_filled[rank])

    def prepare(self, batches) -> list[planning.LocalRank]:
        """Validates and records this process's batches; returns their summaries.

        Raises:
          ValueError: a wrong number of batches, or a batch ``validate`` refuses.
        """
        ranks = self.config.local_dp_ranks
        if len(batches) != len(ranks):
            raise ValueError(
                f"got {len(batches)} batches for the {len(ranks)} DP ranks {ranks} this process "
                f"drives (dp_size={self.config.dp_size})"
            )
        full = [planning.idle_batch() if b is None else b for b in batches]
        for rank, batch in zip(ranks, full, strict=True):
            self.validate(rank, batch)
        for rank, batch in zip(ranks, full, strict=True):
            self.check_writes(rank, batch)  # the step writes them into the device table
        return [planning.summarize(batch, self.config.plan) for batch in full]

    def validate(self, rank: int, batch: split.ForwardBatch) -> None:
        """Checks one rank's batch against the model and the runner's sizes.

        Raises:
          ValueError: token ids outside the vocabulary, a padded batch, too many sequences,
            missing positions, a busy batch with no work, positions outside the table, a
            request written past its recorded context (each names the rank).
        """
        ids = np.asarray(batch.input_ids)
        _check_ids(rank, batch, ids, self.config)
        positions = np.asarray(batch.positions if ids.size else [0])
        if positions.min() < 0 or positions.max() >= self.config.max_context_len:
            raise ValueError(
                f"rank {rank}: positions span [{positions.min()}, {positions.max()}], outside "
                f"[0, max_context_len={self.config.max_context_len})"
            )
        try:
            kv_table.check_context(self.kv_filled[rank], batch)
        except ValueError as error:
            raise ValueError(f"rank {rank}: {error}") from error


def _check_ids(rank: int, batch, ids: np.ndarray, config: runner_config.RunnerConfig) -> None:
    """The token ids, padding, size and positions checks of ``HostTable.validate``."""
    vocab = config.model.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(
            f"rank {rank}: token ids span [{ids.min()}, {ids.max()}], vocabulary is [0, {vocab})"
        )
    if batch.num_token_non_padded not in (None, batch.num_tokens):
        raise ValueError(f"rank {rank}: pass unpadded batches; the runner pads them")
    if batch.batch_size > config.max_running_requests:
        raise ValueError(
            f"rank {rank}: batch_size={batch.batch_size} > max_running_requests="
            f"{config.max_running_requests}"
        )
    if ids.size and batch.positions is None:
        raise ValueError(f"rank {rank}: ForwardBatch.positions is required")
    if not batch.forward_mode.is_idle() and (batch.batch_size == 0 or ids.size == 0):
        raise ValueError(
            f"rank {rank}: a {batch.forward_mode.name} batch with no work (batch_size="
            f"{batch.batch_size}, len(input_ids)={ids.size}); pass None for an idle rank"
        )
