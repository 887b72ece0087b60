"""Mesh construction and SGLang's DP-attention rank layout."""

import jax
import pytest

from jtbo.collectives import mesh as mesh_lib


@pytest.mark.parametrize("dp_size, attn_tp_size", [(8, 1), (4, 2), (2, 4), (1, 8), (2, 1)])
def test_make_mesh_orders_devices_like_tp_rank(dp_size, attn_tp_size):
    mesh = mesh_lib.make_mesh(dp_size, attn_tp_size)
    assert mesh.axis_names == ("dp", "attn_tp")
    assert dict(mesh.shape) == {"dp": dp_size, "attn_tp": attn_tp_size}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    devices = jax.devices()
    for dp_rank in range(dp_size):
        for tp_rank in range(attn_tp_size):
            assert mesh.devices[dp_rank, tp_rank] == devices[dp_rank * attn_tp_size + tp_rank]


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="needs 16 devices"):
        mesh_lib.make_mesh(4, 4)
    with pytest.raises(ValueError, match="got 3"):
        mesh_lib.make_mesh(2, 2, devices=jax.devices()[:3])
    with pytest.raises(ValueError, match="dp_size=0"):
        mesh_lib.make_mesh(0, 2)


def test_world_info_matches_sglang_layout():
    # tp=8, dp=4: attn_tp=2, tp_rank 5 -> dp rank 2, attn_tp rank 1.
    assert mesh_lib.compute_dp_attention_world_info(True, 5, 8, 4) == (1, 2, 2, 4)
    # Without DP attention one DP rank spans the TP group.
    assert mesh_lib.compute_dp_attention_world_info(False, 5, 8, 4) == (5, 8, 0, 1)
    # With context parallelism: layout (dp, cp, tp); tp=8, dp=2, cp=2 -> attn_tp=2.
    assert mesh_lib.compute_dp_attention_world_info(True, 7, 8, 2, 2) == (1, 2, 1, 2)
    assert mesh_lib.compute_dp_attention_world_info(True, 3, 8, 2, 2) == (1, 2, 0, 2)
    for tp_rank in range(8):
        tp, tp_size, dp, dp_size = mesh_lib.compute_dp_attention_world_info(True, tp_rank, 8, 4)
        assert dp * tp_size + tp == tp_rank and (tp_size, dp_size) == (2, 4)


def test_world_info_errors():
    with pytest.raises(ValueError, match="tp_size=8"):
        mesh_lib.compute_dp_attention_world_info(True, 0, 8, 3)
    with pytest.raises(ValueError, match="tp_rank=8"):
        mesh_lib.compute_dp_attention_world_info(True, 8, 8, 4)
