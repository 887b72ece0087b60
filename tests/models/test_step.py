"""Parameter sharding specs, layout options, and operation names vs the strategy layouts."""

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jtbo.collectives import mesh as mesh_lib
from jtbo.models import config as config_lib
from jtbo.models import layer_ops, step
from jtbo.models import model as model_lib
from jtbo.overlap import strategy
from jtbo.split import ForwardMode


@pytest.mark.parametrize("backend", ["ep", "none"])
def test_param_specs(backend):
    model = model_lib.MoEModel(config_lib.MoEConfig.tiny(), rngs=nnx.Rngs(0))
    _, params = nnx.split(model)
    specs = step.param_specs(params, backend)
    moe = specs["layers"][1]["moe"]
    tp_axes = mesh_lib.TP_AXES
    want_up = P(tp_axes, None, None) if backend == "ep" else P(None, None, tp_axes)
    assert moe["experts"]["w_up"].get_value() == want_up
    assert moe["shared"]["w_up"].get_value() == P()  # the shared MLP is replicated
    assert specs["layers"][0]["attn"]["wq"].get_value() == P(None, "attn_tp", None)
    assert specs["layers"][0]["attn"]["wo"].get_value() == P("attn_tp", None, None)
    assert specs["embed"]["table"].get_value() == P()


@pytest.mark.parametrize("factory", [config_lib.MoEConfig.tiny, config_lib.MoEConfig.tiny_softmax])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_operations_fill_the_strategy_layout(factory, mode):
    config = factory()
    model = model_lib.MoEModel(config, rngs=nnx.Rngs(0))
    parallel = layer_ops.ParallelConfig("ep", 1, 8)
    ops = [layer_ops.moe_layer_operations(layer, config, parallel) for layer in model.layers[1:]]
    family = strategy.LayerFamily.DEEPSEEK if config.num_shared_experts else (
        strategy.LayerFamily.QWEN3_MOE
    )  # fmt: skip
    built = strategy.OperationsStrategy.init_new_tbo(ops, mode, family)
    names = [op.debug_name for op in built.operations if hasattr(op, "debug_name")]
    assert names[0] == "L0.comm_prepare_attn" and names[-1] == "L1.comm_postprocess_layer"
    assert ("L0.shared_experts" in names) == bool(config.num_shared_experts)


def test_parallel_config_rejects_bad_values():
    with pytest.raises(ValueError, match="moe_a2a_backend"):
        layer_ops.ParallelConfig("deepep", 1, 8)
    with pytest.raises(ValueError, match="ep_capacity_factor"):
        layer_ops.ParallelConfig("ep", 1, 8, ep_capacity_factor=0.0)
    with pytest.raises(ValueError, match="ep_overflow_policy"):
        layer_ops.ParallelConfig("ep", 1, 8, ep_overflow_policy="drop")
    with pytest.raises(ValueError, match="ep_exchange"):
        layer_ops.ParallelConfig("ep", 1, 8, ep_exchange="sparse")
