"""Shared test helpers: independent numpy references, random data, poisoning, impl lists."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jtbo import aot, kernels
from jtbo.kernels import fp8_blocks, gemm_config

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)
TRAILING = ((), (3,), (2, 5))
# Tiny blocks so the kernels run multi-program grids on tiny test shapes.
SMALL = kernels.CopyConfig(block_elems=16, num_warps=1)


def impls_here() -> tuple[str, ...]:
    """The impls this backend must serve: all three on a GPU, xla and pallas on the CPU."""
    return kernels.IMPLS if jax.default_backend() == "gpu" else ("xla", "pallas")


def random_rows(rng: np.random.Generator, rows: int, trailing, dtype) -> np.ndarray:
    """Random non-zero data of ``[rows, *trailing]`` in ``dtype`` (numpy)."""
    shape = (rows, *trailing)
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(1, 2**20, size=shape).astype(dtype)
    return (rng.standard_normal(shape) + 3.0).astype(dtype)


def poison_device_memory(nbytes: int = 1 << 22) -> None:
    """Fills and frees a device buffer so fresh outputs start from garbage, not zeros."""
    junk = jnp.full((nbytes // 4,), 0x7FC0DEAD, jnp.uint32)
    junk.block_until_ready()
    del junk


def pairs(offset: int, size: int, plain_rows: int, offset_rows: int):
    """(plain row, offset row) pairs that the documented rule copies, by brute force."""
    for i in range(max(size, 0)):
        if 0 <= i < plain_rows and 0 <= offset + i < offset_rows:
            yield i, offset + i


def memcpy_np(dst, src, offset, size, offset_src):
    """numpy reference of ``dp_memcpy``."""
    out = np.array(dst, copy=True)
    plain, shifted = (dst, src) if offset_src else (src, dst)
    for i, j in pairs(offset, size, plain.shape[0], shifted.shape[0]):
        if offset_src:
            out[i] = src[j]
        else:
            out[j] = src[i]
    return out


def slice_pad_np(x, start, length, capacity):
    """numpy reference of ``slice_pad``."""
    out = np.zeros((capacity, *x.shape[1:]), x.dtype)
    for i, j in pairs(start, length, capacity, x.shape[0]):
        out[i] = x[j]
    return out


def merge_np(parts, starts, lengths, out_len):
    """numpy reference of ``merge_rows``."""
    out = np.zeros((out_len, *parts[0].shape[1:]), parts[0].dtype)
    for part, start, length in zip(parts, starts, lengths, strict=True):
        for j, r in pairs(start, length, part.shape[0], out_len):
            out[r] = part[j]
    return out


def assert_equal(actual, expected) -> None:
    """Bit-exact comparison (copies must not change values)."""
    np.testing.assert_array_equal(np.asarray(actual), expected)


def numpy_ffn(x, counts, w_gate_up, w_down):
    """float64 SwiGLU of each expert's first ``counts[e]`` slots (``[E, C, H]`` rows,
    ``[E, H, 2, F]`` and ``[E, F, H]`` weights); zero past the counts."""
    x, wgu, wd = (np.asarray(a, np.float64) for a in (x, w_gate_up, w_down))
    out = np.zeros(x.shape[:2] + (wd.shape[2],))
    for e, count in enumerate(np.clip(counts, 0, x.shape[1])):
        rows = x[e, :count]
        gate, up = rows @ wgu[e, :, 0], rows @ wgu[e, :, 1]
        out[e, :count] = (gate / (1 + np.exp(-gate)) * up) @ wd[e]
    return out


def fake_quantized(x, group: int) -> np.ndarray:
    """Each row's ``group`` columns through FP8 and back (numpy, block by block)."""
    block = (1,) * (x.ndim - 1) + (group,)
    values, scales = fp8_blocks.quantize_blocks_reference(np.asarray(x, np.float64), block)
    return fp8_blocks.dequantize_blocks_reference(values, scales, block)


def numpy_fp8_activations_ffn(x, counts, w_gate_up, w_down, group: int):
    """``numpy_ffn`` with the rows and the float32 hidden rows through FP8 per ``group``
    columns (FP8 activations; the weights given dequantized)."""
    x = fake_quantized(np.asarray(x, np.float32), group)
    out = np.zeros(x.shape[:2] + (w_down.shape[2],))
    for e, count in enumerate(np.clip(counts, 0, x.shape[1])):
        gate, up = x[e, :count] @ w_gate_up[e, :, 0], x[e, :count] @ w_gate_up[e, :, 1]
        hidden = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
        out[e, :count] = fake_quantized(hidden, group) @ w_down[e]
    return out


def fp8_expert_weights(seed: int, shape: tuple[int, int, int], block: tuple[int, int]):
    """``[(w_gate_up, its float64 dequantization), (w_down, ...)]`` for ``shape = (E, H, F)``:
    random weights whose blocks' magnitudes span several orders (a scale read from the wrong
    block shows), quantized by ``quantize_blocks_reference`` in ``block = (contraction,
    output)`` blocks and stored contraction-last."""
    num_experts, hidden, ffn = shape
    rng = np.random.default_rng(seed)
    out = []
    for w_shape, fan_in in (
        ((num_experts, hidden, 2, ffn), hidden),
        ((num_experts, ffn, hidden), ffn),
    ):
        w = rng.standard_normal(w_shape) / np.sqrt(fan_in)
        block_shape = fp8_blocks.expert_block_shape(len(w_shape), block)
        factors = np.exp(rng.uniform(-2, 2, fp8_blocks.scales_shape(w_shape, block_shape)))
        w = w * fp8_blocks.dequantize_blocks_reference(np.ones(w_shape), factors, block_shape)
        values, scales = fp8_blocks.quantize_blocks_reference(w, block_shape)
        axes = fp8_blocks.expert_axes(len(w_shape))
        stored = [jnp.asarray(np.transpose(a, axes)) for a in (values, scales.astype(np.float32))]
        q = fp8_blocks.BlockQuantized(*stored, block_shape, axes)
        out.append((q, fp8_blocks.dequantize_blocks_reference(values, scales, block_shape)))
    return out


def lowered_for_h200(fn, shapes):
    """``jax.jit(fn)`` lowered for one described H200 (``jtbo.aot``), its arguments
    ``shapes``: ``(shape, dtype)`` pairs. Pallas asks the abstract mesh which GPU it lowers
    for. Callers skip unless ``aot.aot_available()``."""
    sharding = jax.sharding.NamedSharding(aot.gpu_mesh((1,), ("x",)), jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    abstract = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Auto,), abstract_device=h200
    )
    with jax.sharding.use_abstract_mesh(abstract):
        return jax.jit(fn).lower(*args)


def compiled_for_h200(fn, shapes) -> str:
    """The compiled text of ``lowered_for_h200(fn, shapes)``."""
    return lowered_for_h200(fn, shapes).compile().as_text()


def fp8_expert_shapes(num_experts: int, hidden: int, ffn: int) -> list:
    """``(shape, dtype)`` of FP8 expert weights in 128 x 128 blocks, stored contraction-last:
    gate / up values and scales, then down values and scales (``fp8_experts_of``)."""
    fp8, f32 = fp8_blocks.FP8_DTYPE, jnp.float32
    return [
        ((num_experts, 2, ffn, hidden), fp8), ((num_experts, 2, ffn // 128, hidden // 128), f32),
        ((num_experts, hidden, ffn), fp8), ((num_experts, hidden // 128, ffn // 128), f32),
    ]  # fmt: skip


def fp8_experts_of(gu_values, gu_scales, down_values, down_scales):
    """``(w_gate_up, w_down)`` as ``BlockQuantized`` from the arrays ``fp8_expert_shapes``
    describes."""
    gate_up_axes, down_axes = fp8_blocks.expert_axes(4), fp8_blocks.expert_axes(3)
    w_gate_up = fp8_blocks.BlockQuantized(gu_values, gu_scales, (1, 128, 1, 128), gate_up_axes)
    w_down = fp8_blocks.BlockQuantized(down_values, down_scales, (1, 128, 128), down_axes)
    return w_gate_up, w_down


def both_kernels(config: gemm_config.MosaicFfnConfig, **changes) -> gemm_config.MosaicFfnConfig:
    """``config`` with ``changes`` made to both Mosaic kernels' launch shapes."""
    return gemm_config.MosaicFfnConfig(
        gate_up=dataclasses.replace(config.gate_up, **changes),
        down=dataclasses.replace(config.down, **changes),
    )
