"""``host_table.HostTable``: the host's batch checks and each request row's recorded context."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.runner import host_table, runner_config
from tests.runner import helpers


def _table() -> host_table.HostTable:
    config = dataclasses.replace(config_lib.MoEConfig.tiny(), num_layers=1)
    resolved = runner_config.resolve(
        config, mesh_lib.make_mesh(2, 1), max_total_tokens=32, max_running_requests=2,
        max_context_len=16, dtype=jnp.float32,
    )  # fmt: skip
    return host_table.HostTable(resolved)


def test_prepare_records_each_rows_context_and_summarizes_idle_ranks():
    table, rank = _table(), helpers.Rank()
    rng = np.random.default_rng(0)
    first = rank.extend({0: rng.integers(0, 128, 5).tolist(), 1: [7, 8]})
    summaries = table.prepare([first, None])
    assert len(summaries) == 2
    np.testing.assert_array_equal(table.kv_filled, [[5, 2], [0, 0]])
    table.prepare([rank.decode({0: 3, 1: 4}), None])
    np.testing.assert_array_equal(table.kv_filled, [[6, 3], [0, 0]])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(input_ids=np.array([1, 2, 500])), r"rank 0: token ids span \[1, 500\]"),
        (dict(input_ids=np.array([1, 2, 3, 0]), positions=np.array([0, 1, 2, 0]),
              out_cache_loc=np.array([1, 2, 3, 0]), num_token_non_padded=3,
              extend_num_tokens=4),
         "pass unpadded batches"),
        (dict(positions=np.array([14, 15, 16])), "outside \\[0, max_context_len=16\\)"),
        (dict(positions=None), "positions is required"),
    ],
)  # fmt: skip
def test_a_bad_batch_names_its_rank_and_what_is_wrong(change, message):
    batch = dataclasses.replace(helpers.Rank().extend({0: [1, 2, 3]}), **change)
    table = _table()
    with pytest.raises(ValueError, match=message):
        table.prepare([batch, None])
    np.testing.assert_array_equal(table.kv_filled, 0)  # nothing recorded


def test_counts_rows_and_context_are_checked():
    table, rank = _table(), helpers.Rank()
    with pytest.raises(ValueError, match="got 1 batches for the 2 DP ranks"):
        table.prepare([None])
    with pytest.raises(ValueError, match="batch_size=3 > max_running_requests=2"):
        table.prepare([rank.extend({0: [1], 1: [2], 2: [3]}), None])
    skipped = helpers.Rank()
    skipped.tokens[0] = [1, 2]  # a history the table never recorded
    with pytest.raises(ValueError, match="rank 1: "):
        table.prepare([None, skipped.decode({0: 5})])
    with pytest.raises(ValueError, match="not driven by this process"):
        table.check_writes(2, rank.extend({0: [1]}))
