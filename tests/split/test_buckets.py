"""Token buckets: the capacities a step's rows are padded to."""

import pytest

from jtbo.split import default_token_buckets, token_bucket


def test_buckets():
    assert default_token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert default_token_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_token_buckets(1) == (1,)
    assert token_bucket(0, (4, 8)) == 4
    assert token_bucket(5, (4, 8)) == 8
    assert token_bucket(8, (4, 8)) == 8
    for args, match in [
        ((9, (4, 8)), "exceeds the largest bucket 8"),
        ((3, (8, 4)), "strictly increasing"),
        ((3, ()), "strictly increasing"),
        ((-1, (4,)), "num_tokens"),
        ((1, (0, 4)), "positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            token_bucket(*args)
    with pytest.raises(ValueError, match="max_tokens"):
        default_token_buckets(0)
