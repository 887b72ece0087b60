"""TBO children of a padded graph-replay batch (SGLang ``_build_tbo_child_replay_fb_view``).

A replayed (captured, static-shape) DECODE / TARGET_VERIFY step carries no TBO children: the
split must come from the *padded* shape alone, exactly as at capture time, so the compiled
program and the children metadata agree. ``compute_split_indices_for_graph_replay`` gives the
sequence / token cut of the padded buffers; each child takes its rows of the per-token and
per-sequence fields, its part of the verify input, and its share of the real tokens
(``compute_tbo_children_num_token_non_padded``: real rows come first, padding last).
"""

import numpy as np

from jtbo.split import batch as batch_lib
from jtbo.split import plan, spec


def _child(batch, seqs: slice, tokens: slice, num_real: int) -> batch_lib.ForwardBatch:
    """Slices the padded parent into one child (all fields it carries, nothing else)."""

    def cut(value, rows: slice):
        return None if value is None else np.asarray(value)[rows]

    bs = len(range(*seqs.indices(batch.batch_size)))
    child_spec = None
    if batch.spec_info is not None:
        per_seq = batch.spec_info.draft_token_num
        child_spec = spec.split_spec_info(
            batch.spec_info,
            start_seq_index=seqs.start,
            end_seq_index=seqs.start + bs,
            start_token_index=seqs.start * per_seq,
            end_token_index=(seqs.start + bs) * per_seq,
        )
    return batch_lib.ForwardBatch(
        forward_mode=batch.forward_mode,
        batch_size=bs,
        input_ids=cut(batch.input_ids, tokens),
        positions=cut(batch.positions, tokens),
        out_cache_loc=cut(batch.out_cache_loc, tokens),
        req_pool_indices=cut(batch.req_pool_indices, seqs),
        seq_lens=cut(batch.seq_lens, seqs),
        spec_info=child_spec,
        num_token_non_padded=num_real,
    )


def split_replay_batch(
    batch: batch_lib.ForwardBatch,
) -> tuple[batch_lib.ForwardBatch, batch_lib.ForwardBatch]:
    """Splits a padded DECODE / TARGET_VERIFY / IDLE replay batch into TBO children A and B.

    Args:
      batch: the padded host batch (``batch_size`` = the captured bucket).

    Returns:
      ``(child_a, child_b)``; a child may have ``batch_size == 0``.

    Raises:
      ValueError: a ragged mode (graph replay only covers decode-like steps).
    """
    per_seq = plan.get_token_num_per_seq(batch.forward_mode, batch.spec_info)
    if batch.forward_mode.is_idle():
        per_seq = 1
    seq_index, token_index = plan.compute_split_indices_for_graph_replay(
        batch.forward_mode, batch.batch_size * (per_seq or 0), per_seq
    )
    real_a, real_b = plan.compute_tbo_children_num_token_non_padded(
        token_index, batch.num_valid_tokens
    )
    return (
        _child(batch, slice(0, seq_index), slice(0, token_index), real_a),
        _child(batch, slice(seq_index, batch.batch_size), slice(token_index, None), real_b),
    )
