"""pack / unpack: bit-exact round trips (host and jitted), layouts, and refused dtypes."""

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.extra import numpy as hnp

from jtbo.split import packing

SPECIAL_FLOATS = [np.nan, np.inf, -np.inf, -0.0, 0.0, np.float32(1e-45)]  # 1e-45: subnormal


def _leaf(lead_shape):
    """A random bool / int32 / uint32 / float32 array ``[*lead_shape, *shape]`` (may be empty)."""
    dtypes = st.sampled_from([np.bool_, np.int32, np.uint32, np.float32])
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)

    def array(dtype, shape):
        elements = None
        if dtype == np.float32:
            elements = st.floats(width=32, allow_nan=True) | st.sampled_from(SPECIAL_FLOATS)
        return hnp.arrays(dtype, (*lead_shape, *shape), elements=elements)

    return st.tuples(dtypes, shapes).flatmap(lambda pair: array(*pair))


def _trees(lead_shape, min_leaves=0):
    leaf = _leaf(lead_shape)
    nodes = st.recursive(
        leaf,
        lambda children: (
            st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(st.sampled_from("abcd"), children, max_size=3)
        ),
        max_leaves=8,
    )
    return nodes.filter(lambda tree: len(jax.tree.leaves(tree)) >= min_leaves)


def _assert_bitwise_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == np.ascontiguousarray(w).tobytes()


@st.composite
def _packed_cases(draw):
    lead_axes = draw(st.integers(0, 2))
    lead_shape = tuple(draw(st.lists(st.integers(0, 3), min_size=lead_axes, max_size=lead_axes)))
    tree = draw(_trees(lead_shape, min_leaves=1 if lead_axes else 0))
    return tree, lead_axes


@settings(max_examples=60, deadline=None)
@given(_packed_cases())
def test_unpack_of_pack_is_bit_exact(case):
    tree, lead_axes = case
    buffer, layout = packing.pack(tree, lead_axes=lead_axes)
    lead_shape = jax.tree.leaves(tree)[0].shape[:lead_axes] if lead_axes else ()
    assert buffer.dtype == np.int32 and buffer.shape == (*lead_shape, layout.width)
    _assert_bitwise_equal(packing.unpack(buffer, layout), tree)
    jitted = jax.jit(packing.unpack, static_argnums=1)
    _assert_bitwise_equal(jitted(buffer, layout), tree)


def test_layout_is_static_hashable_and_shared_by_equal_trees():
    tree = {"ids": np.arange(6, dtype=np.int32).reshape(2, 3), "on": np.ones((2, 1), bool)}
    buffer, layout = packing.pack(tree, lead_axes=1)
    again = packing.pack(jax.tree.map(np.zeros_like, tree), lead_axes=1)[1]
    assert layout == again and hash(layout) == hash(again)
    assert layout.shapes == ((3,), (1,)) and layout.offsets == (0, 3) and layout.width == 4
    np.testing.assert_array_equal(buffer, [[0, 1, 2, 1], [3, 4, 5, 1]])
    other = packing.pack(dict(tree, ids=tree["ids"].astype(np.float32)), lead_axes=1)[1]
    assert other != layout  # a dtype change is another layout (another compile key)


def test_unpack_of_one_leading_shard_keeps_the_leading_axis():
    # Inside a shard_map a DP rank sees one row of the [dp, n] buffer.
    tree = {"ids": np.arange(8, dtype=np.int32).reshape(4, 2), "n": np.arange(4, dtype=np.int32)}
    buffer, layout = packing.pack(tree, lead_axes=1)
    row = packing.unpack(buffer[2:3], layout)
    np.testing.assert_array_equal(row["ids"], [[4, 5]])
    np.testing.assert_array_equal(row["n"], [2])


@pytest.mark.parametrize("dtype", [np.int64, np.float64, np.float16, np.int8, np.uint64])
def test_pack_refuses_other_dtypes_naming_the_leaf(dtype):
    tree = {"ok": np.zeros(2, np.int32), "meta": [np.zeros(2, np.int32), np.zeros(2, dtype)]}
    with pytest.raises(ValueError, match=rf"\['meta'\]\[1\].*{np.dtype(dtype).name}"):
        packing.pack(tree)


def test_pack_refuses_leaves_with_other_leading_dimensions():
    with pytest.raises(ValueError, match=r"\['b'\].*leading dimensions \(2,\)"):
        packing.pack({"a": np.zeros((2, 3), np.int32), "b": np.zeros((3,), np.int32)}, lead_axes=1)
    with pytest.raises(ValueError, match="without leaves"):
        packing.pack({}, lead_axes=1)
    assert packing.pack({})[0].shape == (0,)


def test_unpack_refuses_a_buffer_the_layout_does_not_describe():
    buffer, layout = packing.pack({"a": np.zeros((2, 3), np.int32)}, lead_axes=1)
    with pytest.raises(ValueError, match="int32 buffer of rank 2"):
        packing.unpack(buffer.view(np.float32), layout)
    with pytest.raises(ValueError, match="int32 buffer of rank 2"):
        packing.unpack(buffer[0], layout)
    with pytest.raises(ValueError, match="4 words per row, layout 3"):
        packing.unpack(np.zeros((2, 4), np.int32), layout)


def test_pack_takes_strided_and_transposed_leaves():
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    tree = {"t": base.transpose(0, 2, 1), "s": base[:, :, ::2], "b": (base > 5)[:, ::2]}
    buffer, layout = packing.pack(tree, lead_axes=1)
    _assert_bitwise_equal(packing.unpack(buffer, layout), tree)
