"""Paged decode attention's CUDA kernels (kernels/cuda/paged_attention.cu) on a GPU through
cupy: the CPU test's cases (tests/test_cuda_attention_cpu.py; cases and bounds in
attention_cases.py) on CUDA tensors, bigger shapes, and `measure`, the KV bytes a second the
kernels read, for a device script:

    import sys; sys.path[:0] = [".", "tests"]
    from gpu.test_cuda_attention import measure; print(measure())"""

import math

import pytest
import torch
from gpu import attention_cases as cases
from gpu.gpu_testing import gpu_ready, graph_and_eager_ms

from kernels.cuda import attention

pytestmark = pytest.mark.gpu
F32, BF16 = torch.float32, torch.bfloat16


if not gpu_ready():
    pytest.skip("needs cupy and a CUDA device", allow_module_level=True)

# (contexts, nh, nkv, hd, partition_size), as the CPU test's, then real models' shapes with
# the partitions chosen by the wrapper
GQA = {
    "g8-hd64": ([1, 37, 200], 8, 1, 64, 32),
    "g4-hd128": ([300, 5], 8, 2, 128, 64),
    "mha-hd128": ([130, 64, 17], 2, 2, 128, None),
    "g2-hd80": ([90, 33], 4, 2, 80, 32),
    "g12-hd64": ([45, 100], 12, 1, 64, 32),  # two tiles of heads in a block
    "llama3-8b": ([1, 700, 3000, 2048, 513], 32, 8, 128, None),
    "qwen2-7b-hd128": ([4097, 16, 1500], 28, 4, 128, None),
    "gemma-hd256": ([1200, 31], 8, 4, 256, None),
    "hd96-mha": ([800, 3], 16, 16, 96, None),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("case", GQA, ids=str)
def test_paged_decode(case, dtype):
    contexts, nh, nkv, hd, part = GQA[case]
    cases.check_paged("cuda", dtype, contexts, nh, nkv, hd, partition_size=part)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_paged_decode_masks(dtype):
    cases.check_paged("cuda", dtype, [200, 70, 9], 4, 1, 64, window=48, partition_size=32)
    cases.check_paged("cuda", dtype, [5000, 300], 32, 8, 128, window=1024)
    cases.check_paged("cuda", dtype, [150, 40], 4, 2, 64, first_key=[37, 16], partition_size=32)
    cases.check_paged("cuda", dtype, [70, 2000], 8, 2, 128, misaligned=True)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_mla_decode(dtype):
    cases.check_mla("cuda", dtype, [1, 90, 170], 4, 64, 16, partition_size=32)
    cases.check_mla("cuda", dtype, [2000, 33, 513, 1], 16, 512, 64)  # DeepSeek-V3 at TP 8
    cases.check_mla("cuda", dtype, [1500], 128, 512, 64)  # all 128 heads, one row


def test_mla_decode_is_the_layers_absorbed_decode():
    cases.check_mla_layer("cuda", [1, 40, 700], nh=16, nope=128, rope_dim=64, rank=512, v_dim=128)


def test_measure_runs():
    result = measure(batches=(1, 4), context=256, repeats=3, flush_bytes=1 << 20)
    assert set(result) == {"gqa/b1", "gqa/b4", "mla/b1", "mla/b4"}
    assert all(r["gb_per_s"] > 0 for r in result.values())


def measure(batches=(1, 32, 128), context=2048, repeats=20, dtype=BF16,
            flush_bytes=512 << 20) -> dict:  # fmt: skip
    """KV bytes a second read by paged_decode (a Llama-3-8B layer: 32 heads over 8 KV heads
    of 128) and mla_decode (a DeepSeek-V3 layer at TP 8: 16 heads, latent 512 + RoPE 64),
    every row `context` keys long, at each batch size: {"gqa/b32": {...}, ...}, each with
    gb_per_s (timed from a CUDA graph of `repeats` calls: the kernels, not Python's launches)
    and eager_gb_per_s (the calls launched one by one). Successive calls read other pages, at
    least flush_bytes in all (more calls than `repeats` where that takes more), so that the
    KV is not read from L2."""
    return {
        f"{kind}/b{batch}": _measure_one(kind, batch, context, repeats, dtype, flush_bytes)
        for kind in ("gqa", "mla")
        for batch in batches
    }


def _measure_one(kind, batch, context, repeats, dtype, flush_bytes) -> dict:
    dev, page_size = torch.device("cuda"), 16
    nh, nkv, hd, rank, rope = (32, 8, 128, 0, 0) if kind == "gqa" else (16, 0, 0, 512, 64)
    row_bytes = context * (2 * nkv * hd if kind == "gqa" else rank + rope) * dtype.itemsize
    call_bytes = batch * row_bytes
    copies = max(1, math.ceil(flush_bytes / call_bytes))  # pools that together overflow L2
    repeats = max(repeats, copies)
    pages = math.ceil(context / page_size)
    num_pages = copies * batch * pages
    order = torch.randperm(num_pages, device=dev).to(torch.int32)
    tables = order.view(copies, batch, pages).unbind(0)  # each call's pages, contiguous
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    if kind == "gqa":
        pool = torch.randn(2, num_pages, page_size, nkv, hd, device=dev).to(dtype)
        q = torch.randn(batch, nh, hd, device=dev).to(dtype)
        calls = [(attention.paged_decode, (q, pool, t, lens, hd**-0.5)) for t in tables]
    else:
        pool = torch.randn(num_pages, page_size, rank + rope, device=dev).to(dtype)
        q_latent = torch.randn(batch, nh, rank, device=dev).to(dtype)
        q_rope = torch.randn(batch, nh, rope, device=dev).to(dtype)
        scale = (128 + rope) ** -0.5
        calls = [(attention.mla_decode, (q_latent, q_rope, pool, t, lens, scale)) for t in tables]
    graph_ms, eager_ms = graph_and_eager_ms(calls, repeats)
    return dict(
        batch=batch, context=context, kv_bytes=call_bytes, graph_ms=graph_ms, eager_ms=eager_ms,
        gb_per_s=call_bytes / graph_ms / 1e6, eager_gb_per_s=call_bytes / eager_ms / 1e6,
    )  # fmt: skip
