"""The FP8 weight kernels (kernels/cuda/fp8_linear.cu) on a GPU through cupy: the CPU test's
cases (tests/test_cuda_fp8_cpu.py; cases and bounds in fp8_cases.py) on CUDA tensors, real
models' shapes, and `measure`, the weight bytes a second fp8_linear reads, for a device
script:

    import sys; sys.path[:0] = [".", "tests"]
    from gpu.test_cuda_fp8 import measure; print(measure())

Skipped without cupy or a CUDA device."""

import math

import pytest
import torch
from gpu import fp8_cases as cases
from gpu.gpu_testing import ON_GPU, gpu_ready, graph_and_eager_ms

from kernels.cuda import fp8_linear as fp8

pytestmark = ON_GPU
F32, BF16 = torch.float32, torch.bfloat16


if not gpu_ready():
    pytest.skip("needs cupy and a CUDA device", allow_module_level=True)


SHAPES = {  # (N, K, block)
    "ragged": (37, 48, (16, 16)),
    "ragged-128": (130, 176, (128, 128)),
    "bytes": (37, 40, (16, 16)),
    "llama8b-gate_up": (2 * 14336, 4096, (128, 128)),
    "llama8b-down": (4096, 14336, (128, 128)),
    "deepseek-q_b-tp8": (3072, 1536, (128, 128)),
    "deepseek-kv_a": (576, 7168, (128, 128)),  # N inside a block
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("M", [1, 3, 8, 17, 32, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_linear(dtype, M, shape):
    N, K, block = SHAPES[shape]
    cases.check_linear("cuda", dtype, M, N, K, block, seed=M)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_fp8_linear_bias_and_strides(dtype):
    cases.check_linear("cuda", dtype, 5, 4096, 1024, (128, 128), bias=True, x_pad=128)
    cases.check_linear("cuda", dtype, 5, 300, 1024, (128, 128), x_pad=3)  # byte by byte


@pytest.mark.parametrize("block", [(16, 16), (16, 8)])
def test_every_byte_decodes_exactly(block):
    """On the device's own float units: denormal products kept (no flush to zero)."""
    cases.check_every_byte("cuda", block, [1.0, 0.3, -1.7, 300.0, 2.0**-130])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("N, K, block", [(14336, 4096, (128, 128)), (37, 40, (16, 16))])
def test_fp8_dequantize(dtype, N, K, block):
    cases.check_dequantize("cuda", dtype, N, K, block)
    cases.check_dequantize("cuda", dtype, N, K, block, seed=1, scale_exp=(8, 12))


def test_measure_runs():
    result = measure(rows=(1, 4), shape=(512, 1024), repeats=3, flush_bytes=1 << 20)
    assert set(result) == {"m1", "m4"}
    assert all(r["gb_per_s"] > 0 and r["dequant_ms"] > 0 for r in result.values())


def measure(rows=(1, 8, 32), shape=(4096, 14336), repeats=20, flush_bytes=512 << 20) -> dict:
    """Weight bytes a second read by fp8_linear (bf16 x of each row count over an FP8 weight
    of `shape` (N, K): Llama-3-8B's down_proj by default, 128 x 128 blocks), {"m8": {...}},
    each with gb_per_s (timed from a CUDA graph of `repeats` calls: the kernel, not Python's
    launches), eager_gb_per_s (the calls launched one by one) and, for comparison,
    bf16_gb_per_s (torch's F.linear over the same weight in bf16: its 2 bytes a weight per
    second) and dequant_ms (fp8_dequantize to bf16: what the layer's path beyond 64 rows adds
    to that matmul). Successive calls read other copies of the weight, at least flush_bytes
    in all, so that it is not read from L2."""
    return {f"m{m}": _measure_one(m, shape, repeats, flush_bytes) for m in rows}


def _measure_one(M: int, shape, repeats: int, flush_bytes: int) -> dict:
    dev, (N, K), block = torch.device("cuda"), shape, (128, 128)
    copies = max(1, math.ceil(flush_bytes / (N * K)))
    weights = torch.randint(0, 0x7E, (copies, N, K), dtype=torch.uint8, device=dev)
    scales = torch.rand(copies, -(-N // 128), -(-K // 128), device=dev) * 1e-2
    x = torch.randn(M, K, device=dev).to(BF16)
    calls = [(fp8.fp8_linear, (x, weights[i], scales[i], block)) for i in range(copies)]
    fp8_ms, eager_ms = graph_and_eager_ms(calls, repeats)
    dense_copies = max(1, math.ceil(flush_bytes / (2 * N * K)))
    dense = [torch.randn(N, K, device=dev).to(BF16) for _ in range(min(dense_copies, copies))]
    linear = torch.nn.functional.linear
    bf16_ms, _ = graph_and_eager_ms([(linear, (x, w)) for w in dense], repeats)
    dequant = [(fp8.fp8_dequantize, (weights[i], scales[i], block)) for i in range(copies)]
    dequant_ms, _ = graph_and_eager_ms(dequant, repeats)
    return dict(
        rows=M, n=N, k=K, weight_bytes=N * K, graph_ms=fp8_ms, eager_ms=eager_ms,
        gb_per_s=N * K / fp8_ms / 1e6, eager_gb_per_s=N * K / eager_ms / 1e6,
        bf16_ms=bf16_ms, bf16_gb_per_s=2 * N * K / bf16_ms / 1e6, dequant_ms=dequant_ms,
    )  # fmt: skip
