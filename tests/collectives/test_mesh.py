"""Mesh construction in SGLang's DP-attention rank layout (tp_rank = dp * attn_tp + attn_tp)."""

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
    with pytest.raises(mesh_lib.TooFewDevicesError, match="needs 16 devices") as raised:
        mesh_lib.make_mesh(16, 1)
    assert (raised.value.needed, raised.value.available) == (16, jax.device_count())
    with pytest.raises(ValueError, match="got 3"):
        mesh_lib.make_mesh(2, 2, devices=[jax.devices()[0]] * 3)
    with pytest.raises(ValueError, match="dp_size=0"):
        mesh_lib.make_mesh(0, 2)
