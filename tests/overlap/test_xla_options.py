"""The TBO compile options: one place, names the compiler accepts, CLI parsing."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jtbo import aot
from jtbo.overlap import xla_options


def test_options_and_overrides():
    options = xla_options.tbo_compiler_options(overrides={"xla_gpu_dot_merger_threshold_mb": 5})
    assert options["xla_gpu_dot_merger_threshold_mb"] == 5
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 0
    assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 0
    assert options["xla_gpu_all_reduce_combine_threshold_bytes"] == 0
    limited = xla_options.TboXlaOptions(parallel_collective_overlap_limit=2, extra=(("k", 1),))
    got = limited.compiler_options()
    assert got["xla_gpu_experimental_parallel_collective_overlap_limit"] == 2 and got["k"] == 1


def test_parse_option():
    assert xla_options.parse_option("a=0") == ("a", 0)
    assert xla_options.parse_option("b = true") == ("b", True)
    assert xla_options.parse_option("c=1.5") == ("c", 1.5)
    assert xla_options.parse_option("d=xyz") == ("d", "xyz")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        xla_options.parse_option("novalue")


@pytest.mark.skipif(not aot.aot_available(), reason="needs the aot extra")
def test_gpu_compiler_accepts_every_name():
    mesh = aot.gpu_mesh((2,), ("x",))
    step = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.all_gather(x, "x", tiled=True),
            mesh=mesh,
            in_specs=(P("x"),),  # x: rows over x
            out_specs=P(),
            check_vma=False,
        )
    )
    arg = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    options = xla_options.TboXlaOptions(parallel_collective_overlap_limit=1).compiler_options()
    step.lower(arg).compile(compiler_options=options)
    with pytest.raises(Exception, match="No such compile option"):
        step.lower(arg).compile(compiler_options={"xla_gpu_all_to_all_combine_threshold_bytes": 0})


def test_process_env_advice_names_every_missing_or_wrong_variable():
    name, value = xla_options.TBO_PROCESS_ENV[0]
    assert xla_options.process_env_advice({name: value}) == []
    (unset,) = xla_options.process_env_advice({})
    assert f"{name}=<unset>" in unset and f"set {name}={value}" in unset
    (wrong,) = xla_options.process_env_advice({name: "32"})
    assert f"{name}=32" in wrong


def test_peer_copy_advice_is_to_leave_more_than_one_connection():
    # The peer copy's side stream must not share the compute stream's one hardware queue.
    assert xla_options.process_env_advice({}, "peer_copy") == []
    assert xla_options.process_env_advice({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, "peer_copy") == []
    (advice,) = xla_options.process_env_advice({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "peer_copy")
    assert "unset" in advice
