"""Host batches for runner tests, the unsharded reference logits they must match, and the
two-layer tiny model most of them serve."""

import dataclasses

import numpy as np

from jtbo import split
from jtbo.models import config as config_lib
from jtbo.models import reference

EXTEND = split.ForwardMode.EXTEND
TWO_LAYER_TINY = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=2)
"""``MoEConfig.tiny`` cut to one dense and one MoE layer: for tests whose checks do not depend
on the depth, each program they compile has fewer layers."""


class Rank:
    """One DP rank's requests in a test: rows, slots and token histories."""

    def __init__(self):
        self.next_slot = 1
        self.tokens: dict[int, list[int]] = {}
        self.slots: dict[int, list[int]] = {}

    def _take(self, row: int, count: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + count))
        self.next_slot += count
        self.slots.setdefault(row, []).extend(slots)
        return slots

    def extend(self, new_tokens: dict[int, list[int]]) -> split.ForwardBatch:
        """EXTEND batch appending ``new_tokens[row]`` to each request (prefix = history)."""
        rows = sorted(new_tokens)
        prefix = [len(self.tokens.get(r, [])) for r in rows]
        lens = [len(new_tokens[r]) for r in rows]
        locs = [self._take(r, n) for r, n in zip(rows, lens, strict=True)]
        for r in rows:
            self.tokens.setdefault(r, []).extend(new_tokens[r])
        return split.ForwardBatch(
            forward_mode=EXTEND,
            batch_size=len(rows),
            input_ids=np.concatenate([new_tokens[r] for r in rows]),
            positions=np.concatenate(
                [np.arange(p, p + n) for p, n in zip(prefix, lens, strict=True)]
            ),
            out_cache_loc=np.concatenate(locs),
            req_pool_indices=rows,
            seq_lens=[p + n for p, n in zip(prefix, lens, strict=True)],
            extend_seq_lens=lens,
            extend_prefix_lens=prefix,
        )

    def decode(self, next_tokens: dict[int, int]) -> split.ForwardBatch:
        """DECODE batch feeding one token per request."""
        rows = sorted(next_tokens)
        positions = [len(self.tokens[r]) for r in rows]
        locs = [self._take(r, 1)[0] for r in rows]
        for r in rows:
            self.tokens[r].append(next_tokens[r])
        return split.ForwardBatch(
            forward_mode=split.ForwardMode.DECODE,
            batch_size=len(rows),
            input_ids=[next_tokens[r] for r in rows],
            positions=positions,
            out_cache_loc=locs,
            req_pool_indices=rows,
            seq_lens=[p + 1 for p in positions],
        )

    def verify(self, drafts: dict[int, list[int]], tree: np.ndarray):
        """TARGET_VERIFY of ``drafts[row]`` (``draft`` tokens) with a ``[draft, draft]`` tree mask.

        Returns the batch and, per row, the positions of the draft tokens.
        """
        rows = sorted(drafts)
        draft = tree.shape[0]
        depth = tree.sum(axis=1) - 1  # a node's position offset is its depth in the tree
        prefix = [len(self.tokens[r]) for r in rows]
        masks, positions, locs = [], [], []
        for r, p in zip(rows, prefix, strict=True):
            block = np.concatenate([np.ones((draft, p), bool), tree], axis=1)
            masks.append(block.reshape(-1))
            positions.append(p + depth)
            locs.append(self._take(r, draft))
        ids = np.concatenate([drafts[r] for r in rows])
        spec = split.SpecVerifyInput(
            draft_token=ids,
            positions=np.concatenate(positions),
            custom_mask=np.concatenate(masks),
            seq_lens=prefix,
            draft_token_num=draft,
        )
        batch = split.ForwardBatch(
            forward_mode=split.ForwardMode.TARGET_VERIFY,
            batch_size=len(rows),
            input_ids=ids,
            positions=np.concatenate(positions),
            out_cache_loc=np.concatenate(locs),
            req_pool_indices=rows,
            seq_lens=prefix,
            spec_info=spec,
        )
        return batch, dict(zip(rows, positions, strict=True))


def reference_new_rows(model, rank: Rank, counts: dict[int, int]) -> np.ndarray:
    """Reference logits of the last ``counts[row]`` tokens of each request, in row order."""
    return np.concatenate(
        [
            reference.reference_causal_logits(model, rank.tokens[r])[-counts[r] :]
            for r in sorted(counts)
        ]
    )


def reference_verify(model, history: list[int], draft: list[int], positions, tree) -> np.ndarray:
    """Reference logits of draft tokens attending to ``history`` and their tree ancestors."""
    p, d = len(history), len(draft)
    mask = np.zeros((p + d, p + d), bool)
    mask[:p, :p] = reference.causal_mask(p)
    mask[p:, :p] = True
    mask[p:, p:] = tree
    ids = np.concatenate([history, draft])
    pos = np.concatenate([np.arange(p), positions])
    return reference.reference_forward_padded(model, ids, pos, mask)[p:]
