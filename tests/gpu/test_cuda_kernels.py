"""The light CUDA kernels (kernels/cuda: RMSNorm, RoPE, SiLU-and-mul, the KV row copies) on a
real GPU through cupy/NVRTC, against the same torch references and bounds as on the CPU
(tests/gpu/cuda_cases.py; tests/test_cuda_kernels_cpu.py runs them emulated). Sizes are the
models' here: whole warps and blocks, 1024-thread norms, grids of thousands of blocks.
Skipped without cupy or a CUDA device."""

import numpy as np
import pytest
import torch
from gpu import cuda_cases as cases
from gpu.gpu_testing import ON_GPU, gpu_ready

from kernels.cuda import activation, kv_pages, runtime

pytestmark = ON_GPU
BF16 = torch.bfloat16
DTYPES = (torch.float32, BF16)


if not gpu_ready():
    pytest.skip("needs cupy and a CUDA device", allow_module_level=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, row_pad",
    [((64, 4096), 0), ((33, 7168), 0), ((17, 300), 0), ((8, 32, 128), 1024), ((0, 64), 0)],
)
def test_rms_norm(dtype, shape, row_pad):
    cases.check_rms_norm("cuda", dtype, shape, row_pad=row_pad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual(dtype):
    cases.check_rms_norm("cuda", dtype, (257, 4096), residual=True, seed=1)
    cases.check_rms_norm("cuda", dtype, (5, 2000), residual=True, row_pad=96, seed=2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "dtype, tables", [(torch.float32,) * 2, (BF16, BF16), (BF16, torch.float32)]
)
@pytest.mark.parametrize(
    "T, nh, nkv, hd, pad",
    [(300, 32, 8, 128, 0), (7, 28, 4, 64, 0), (64, 16, 1, 64, 128)],  # Llama; Qwen; DeepSeek
)
def test_rope(dtype, tables, interleaved, T, nh, nkv, hd, pad):
    cases.check_rope("cuda", dtype, tables, T, nh, nkv, hd, interleaved, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, d", [(512, 14336), (3, 1000), (1, 1)])
def test_silu_mul(dtype, n, d):
    cases.check_silu_mul("cuda", dtype, n, d)


def test_silu_mul_when_the_grid_is_smaller_than_the_values(monkeypatch):
    monkeypatch.setattr(activation, "MAX_BLOCKS", 7)
    cases.check_silu_mul("cuda", BF16, 100, 3000, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_and_latent(dtype):
    cases.check_write_kv("cuda", dtype, 64, 16, 32, 8, 128, 300)
    cases.check_write_latent("cuda", dtype, 64, 16, 512, 64, 300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layer_shape, units, n",
    [
        ((2, 64, 16, 8, 128), (0, 8), 500),
        ((2, 64, 16, 8, 128), (2, 6), 77),
        ((64, 16, 576), (0, 1), 500),
    ],
)
def test_gather_and_scatter(dtype, layer_shape, units, n):
    cases.check_gather_scatter("cuda", dtype, layer_shape, units, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slots_outside_the_pool_are_skipped(dtype):
    cases.check_slots_outside_the_pool("cuda", dtype)


def test_kernels_run_on_the_current_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cases.check_write_kv("cuda", BF16, 8, 16, 4, 2, 64, 40)
    stream.synchronize()


def test_a_cpu_tensor_is_refused_by_the_gpu_runtime():
    pool, slots = torch.zeros(2, 2, 4, 1, 8, device="cuda"), torch.arange(2, device="cuda")
    payload = torch.zeros(2, 2, 8)  # on the CPU: cupy would copy it and drop the writes
    launch = runtime.function(kv_pages.SOURCE, "tison_kv_gather_f32")
    args = (pool, np.int32(8), np.int32(0), np.int32(8), payload, slots)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        launch((2, 2), (32,), (*args, np.int64(2), np.int64(8)))
