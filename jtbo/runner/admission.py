"""Admission of ``generate``'s requests: per DP rank a FIFO queue, admitted as room frees.

A request needs a page-table row and ``len(prompt) + max_new_tokens`` KV slots, reserved up
front (so a running request is never preempted). Requests wait in arrival order; the head of
the queue is admitted as soon as a row, its slots and a running place are free, and a
finished request's row and slots go back to the rank. A request that could never fit (more
slots than the rank's whole pool) is refused before it is queued (``validate_prompt`` in
``jtbo.runner.generate``), so the head of a queue always fits once enough requests finish:
nothing waits forever and nothing is dropped.

Running places are capped by the largest token bucket as well as by ``max_running_requests``:
one decode step feeds one token per running request, and a step larger than the largest
bucket would be refused.
"""

import collections
import dataclasses

import numpy as np


@dataclasses.dataclass
class Request:
    """One admitted request of a rank.

    Attributes:
      index: the prompt's index in ``generate``'s input.
      prompt: [prompt_len] token ids.
      row: its page-table row.
      slots: [prompt_len + max_new_tokens] its reserved KV slots, by position.
      request_id: the id that keys its random draws (``jtbo.models.sampler``).
      prefilled: prompt tokens already dispatched.
      generated: tokens read back so far.
      logprobs: their log-probabilities, when asked for.
      dispatched: tokens whose step was dispatched (read back or not).
      source_step: the step that makes its latest dispatched token.
      source_row: that token's row of the step's token output.
    """

    index: int
    prompt: np.ndarray  # [prompt_len]
    row: int
    slots: np.ndarray  # [prompt_len + max_new_tokens]
    request_id: int = 0
    prefilled: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    dispatched: int = 0
    source_step: object = None  # a token_step.PendingStep
    source_row: int = -1


def running_limit(max_running_requests: int, token_buckets) -> int:
    """How many requests a rank may run at once.

    Args:
      max_running_requests: the runner's page-table rows per rank.
      token_buckets: the runner's token capacities.

    Returns:
      ``min(max_running_requests, max(token_buckets))``.
    """
    return min(max_running_requests, max(token_buckets))


class RankQueue:
    """One DP rank's free rows and slots, waiting queue and running requests."""

    def __init__(self, max_reqs: int, num_slots: int, limit: int | None = None):
        """Builds an empty rank.

        Args:
          max_reqs: page-table rows.
          num_slots: KV slots, the padding slot 0 included (it is never handed out).
          limit: running requests at most (``running_limit``); ``max_reqs`` when None.
        """
        self.free_rows = list(range(max_reqs))
        self.free_slots = collections.deque(range(1, num_slots))
        self.limit = max_reqs if limit is None else limit
        self.waiting: collections.deque = collections.deque()
        self.running: list[Request] = []

    def admit(self, max_new_tokens: int) -> None:
        """Admits waiting requests in order while the head fits (rows, slots, running places).

        Args:
          max_new_tokens: tokens each request generates (its slots are reserved now).
        """
        while self.waiting and self.free_rows and len(self.running) < self.limit:
            index, prompt, request_id = self.waiting[0]
            need = len(prompt) + max_new_tokens
            if need > len(self.free_slots):
                return
            self.waiting.popleft()
            slots = np.array([self.free_slots.popleft() for _ in range(need)], np.int32)
            row = self.free_rows.pop(0)
            self.running.append(Request(index, prompt, row, slots, request_id))

    def release(self, request: Request) -> None:
        """Returns a finished request's row and slots to the rank."""
        self.running.remove(request)
        self.free_rows.append(request.row)
        self.free_slots.extend(request.slots.tolist())
