"""Paged decode attention's CUDA kernels (kernels/cuda/paged_attention.cu) run on the CPU: the
wrappers unchanged, the .cu compiled as C++ by tests/gpu/host_runtime.py, against their torch
references and those against the engine's code (the cases and bounds: tests/gpu/
attention_cases.py); then the wrappers' refusals of bad inputs. Small partitions make short
contexts cross several, so the merge kernel runs too. The emulation runs a block's 128
threads as real threads: few blocks a case."""

import pytest
import torch
from gpu import attention_cases as cases
from gpu.gpu_testing import ON_HOST

from kernels.cuda import attention

pytestmark = ON_HOST
F32, BF16 = torch.float32, torch.bfloat16


# (contexts, nh, nkv, hd, partition_size): GQA groups of 8, 4, 1 (MHA), 2 and 12 (two tiles
# of heads); ragged rows from one key to a few hundred, partitions crossed, ended exactly (64
# of 32) and left empty
GQA = {
    "g8-hd64": ([1, 37, 200], 8, 1, 64, 32),
    "g4-hd128": ([300, 5], 8, 2, 128, 64),
    "mha-hd128": ([130, 64, 17], 2, 2, 128, None),
    "g2-hd80": ([90, 33], 4, 2, 80, 32),
    "g12-hd64": ([45, 100], 12, 1, 64, 32),
}


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("case", GQA, ids=str)
def test_paged_decode(case, dtype):
    contexts, nh, nkv, hd, part = GQA[case]
    cases.check_paged("cpu", dtype, contexts, nh, nkv, hd, partition_size=part)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_paged_decode_sliding_window(dtype):
    # keys [ctx - 48, ctx): row 0's first partitions see nothing; row 2 is inside its window
    cases.check_paged("cpu", dtype, [200, 70, 9], 4, 1, 64, window=48, partition_size=32)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_paged_decode_first_key(dtype):
    # Llama 4's chunked rows: keys before first_key in the row's first page are hidden
    cases.check_paged("cpu", dtype, [150, 40], 4, 2, 64, first_key=[37, 16], partition_size=32)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_paged_decode_unaligned_pool(dtype):
    """A pool one element past a 16-byte boundary is read element by element."""
    cases.check_paged("cpu", dtype, [70, 20], 4, 1, 64, partition_size=32, misaligned=True)


def test_a_row_without_keys_gets_zeros():
    gen = torch.Generator().manual_seed(0)
    _, table, lens = cases.page_tables(gen, [0, 3], 16)
    q, kv = torch.randn(2, 2, 64, generator=gen), torch.randn(2, 4, 16, 1, 64, generator=gen)
    for part in (None, 1):  # the partition kernel's own output, then the merge's
        out = attention.paged_decode(q, kv, table, lens, 0.125, partition_size=part)
        assert not out[0].any() and out[1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_mla_decode(dtype):
    cases.check_mla("cpu", dtype, [1, 90, 170], 4, 64, 16, partition_size=32)


def test_mla_decode_partial_head_tiles():
    cases.check_mla("cpu", BF16, [50, 21], 5, 64, 16, partition_size=32, heads_per_block=2)


def test_mla_decode_at_deepseek_size():
    """kv_lora_rank 512 and a RoPE part of 64: 576 values a token, as DeepSeek-V3 and Kimi."""
    cases.check_mla("cpu", BF16, [40, 100], 2, 512, 64, partition_size=64)


def test_mla_decode_is_the_layers_absorbed_decode():
    cases.check_mla_layer("cpu", [1, 40, 70], nh=3, nope=16, rope_dim=8, rank=32, v_dim=24)


# --- refusals ---


def _paged(**change):
    gen = torch.Generator().manual_seed(0)
    _, table, lens = cases.page_tables(gen, [20, 5], 16)
    args = dict(q=torch.randn(2, 4, 64), kv_layer=torch.randn(2, 4, 16, 2, 64),
                block_table=table, context_lens=lens, scale=0.125)  # fmt: skip
    return attention.paged_decode(**{**args, **change})


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(q=torch.randn(2, 4, 64, dtype=torch.float16)), "q"),
        (dict(q=torch.randn(2, 64, 4).transpose(1, 2)), "q"),
        (dict(q=torch.randn(2, 3, 64)), "q"),  # 3 heads over 2 KV heads
        (dict(kv_layer=torch.randn(2, 4, 16, 2, 64, dtype=BF16)), "kv_layer"),
        (dict(kv_layer=torch.randn(2, 4, 16, 2, 32)), "kv_layer"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "block_table"),
        (dict(block_table=torch.zeros(3, 2, dtype=torch.int32)), "block_table"),
        (dict(context_lens=torch.ones(3, dtype=torch.int32)), "context_lens"),
        (dict(context_lens=torch.ones(2)), "context_lens"),
        (dict(window=0), "window"),
        (dict(first_key=torch.zeros(3, dtype=torch.int32)), "first_key"),
        (dict(partition_size=100_000), "partition_size"),
    ],
)
def test_paged_decode_refuses(change, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        _paged(**change)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(q_rope=torch.randn(2, 3, 8)), "q_rope"),
        (dict(q_rope=torch.randn(2, 4, 8, dtype=BF16)), "q_rope"),
        (dict(kv_layer=torch.randn(4, 16, 41)), "kv_layer"),
        (dict(heads_per_block=0), "heads_per_block"),
        (dict(q_latent=torch.randn(2, 4, 64, dtype=torch.float64)), "q_latent"),
    ],
)
def test_mla_decode_refuses(change, name):
    gen = torch.Generator().manual_seed(0)
    _, table, lens = cases.page_tables(gen, [20, 5], 16)
    args = dict(q_latent=torch.randn(2, 4, 32), q_rope=torch.randn(2, 4, 8),
                kv_layer=torch.randn(4, 16, 40), block_table=table, context_lens=lens,
                scale=0.125)  # fmt: skip
    with pytest.raises(ValueError, match=f"^{name}"):
        attention.mla_decode(**{**args, **change})
