"""The numerics guard: a NaN in a step's logits raises naming the DP rank and the request."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import model as model_lib
from jtbo.runner import numerics
from jtbo.runner import runner as runner_lib
from tests.runner import helpers

POISON = 77  # token id whose embedding row is NaN


def _runner(check: bool):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    model.embed.table.value = model.embed.table.value.at[POISON].set(jnp.nan)
    return runner_lib.ModelRunner(
        model, mesh_lib.make_mesh(2, 1), max_total_tokens=32, max_running_requests=4,
        token_buckets=(16,), dtype=jnp.float32, check_finite_logits=check,
    )  # fmt: skip


def _batches():
    """Rank 0 clean; rank 1's request index 1 (pool row 2) holds the poisoned token."""
    clean = helpers.Rank().extend({0: [1, 2, 3], 1: [4, 5]})
    poisoned = helpers.Rank().extend({0: [6, 7], 2: [8, POISON, 9], 3: [10]})
    return [clean, poisoned]


def test_a_non_finite_logit_raises_naming_the_rank_and_the_request():
    with pytest.raises(numerics.NonFiniteLogitsError) as error:
        _runner(True).forward(_batches())
    # The NaN stays within the poisoned request's rows (2..4 of rank 1): request index 1.
    assert str(error.value).startswith("DP rank 1: non-finite logits in ")
    assert "request index 1 of the batch (req_pool_indices=2, EXTEND)" in str(error.value)


def test_the_guard_switched_off_returns_the_logits_unchecked():
    clean, poisoned = _runner(False).forward(_batches())
    assert np.isfinite(clean).all()
    bad = np.flatnonzero(~np.isfinite(poisoned).all(axis=1))
    assert bad.size and set(bad.tolist()) <= {2, 3, 4}  # the poisoned request's rows only


def test_sequence_of_row_maps_token_rows_to_requests():
    batch = _batches()[1]
    assert [numerics.sequence_of_row(batch, r) for r in range(6)] == [0, 0, 1, 1, 1, 2]


def test_last_rows_guard_names_the_request_of_the_picked_row():
    # logits="last" computes one row per sequence: rank 1's second row is request index 1's
    # last token (token row 4), the poisoned one.
    clean = helpers.Rank().extend({0: [1, 2, 3], 1: [4, 5]})
    poisoned = helpers.Rank().extend({0: [6, 7], 2: [8, 9, POISON], 3: [10]})
    with pytest.raises(numerics.NonFiniteLogitsError) as error:
        _runner(True).forward([clean, poisoned], logits="last")
    message = str(error.value)
    assert message.startswith("DP rank 1: non-finite logits in 1 of 3 token rows; ")
    assert "first at token row 4, request index 1 of the batch (req_pool_indices=2" in message
