"""Paged decode attention's parity cases (kernels/cuda/attention.py, GQA/MHA and MLA): each
wrapper against its torch reference on one device, the CPU through tests/gpu/host_runtime.py
(tests/test_cuda_attention_cpu.py) or a GPU through cupy (tests/gpu/test_cuda_attention.py),
then that reference against the engine's own code on the same inputs (TorchBackend.decode
with DecodeRows; LatentAttention's absorbed decode), so the chain reaches the engine.
Inputs are drawn on the CPU from a seed and moved, so both devices see the same values; each
row's pages are drawn at random from the pool and its table 0-padded, as the engine's.

Bounds, against the reference computed in float32 on the same (widened) inputs: float32
within F32_ATOL; bfloat16, whose output is rounded once, within half a bf16 ulp of that
(BF16_RTOL |ref|) plus F32_ATOL. The references against the engine's code: F32_ATOL (MLA:
MLA_ATOL, its W_UK / W_UV products summed in another order)."""

import torch

from kernels.cuda import attention
from shared.models.layers.attention import AttentionMetadata, DecodeRows
from shared.models.layers.attention_backend import TorchBackend
from shared.models.layers.latent_attention import LatentAttention, LatentUpProjection

F32_ATOL = 1e-5
BF16_RTOL = 2.0**-8  # half an ulp of bf16 (8 significant bits)
MLA_ATOL = 2e-5


def assert_bounded(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out (the kernel's, its dtype) against ref (float32), with the module's bounds."""
    rounded = out.dtype == torch.bfloat16
    out, ref = out.cpu().float(), ref.cpu().float()
    bound = F32_ATOL + (BF16_RTOL * ref.abs() if rounded else 0)
    err = (out - ref).abs()
    assert torch.isfinite(out).all(), "non-finite output"
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}"


def _randn(gen, shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def page_tables(gen, contexts, page_size: int, spare: int = 2):
    """Each row's pages drawn at random from a pool of P pages: (P, block_table (B, Pmax)
    int32 0-padded, context_lens (B,) int32), on the CPU."""
    need = [max(1, -(-c // page_size)) for c in contexts]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(contexts), max(need), dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at : at + n]
        at += n
    return num_pages, table, torch.tensor(contexts, dtype=torch.int32)


def check_paged(device, dtype, contexts, nh, nkv, hd, page_size=16, window=None, first_key=None,
                partition_size=None, misaligned=False, seed=0) -> None:  # fmt: skip
    """paged_decode against its reference, the reference against TorchBackend.decode.
    misaligned: the pool starts one element past a 16-byte boundary (the scalar path)."""
    gen = torch.Generator().manual_seed(seed)
    P, table, lens = page_tables(gen, contexts, page_size)
    shape = (2, P, page_size, nkv, hd)
    store = _randn(gen, (2 * P * page_size * nkv * hd + 1,), dtype, device)
    kv = store[int(misaligned) :][: store.numel() - 1].view(shape)
    q = _randn(gen, (len(contexts), nh, hd), dtype, device)
    table, lens, scale = table.to(device), lens.to(device), hd**-0.5
    first = None if first_key is None else torch.tensor(first_key, dtype=torch.int32).to(device)
    out = attention.paged_decode(q, kv, table, lens, scale, window, first, partition_size)
    ref = attention.paged_decode_reference(q.float(), kv.float(), table, lens, scale, window, first)
    assert out.shape == q.shape and out.dtype == dtype
    assert_bounded(out, ref)
    seen = lens > 0  # the engine never decodes a row without keys (SDPA: NaN)
    rows = DecodeRows(None, table[seen], lens[seen], page_size, window,
                      None if first is None else first[seen])  # fmt: skip
    engine = TorchBackend.decode(q[seen].float(), kv.float(), rows, scale)
    torch.testing.assert_close(ref[seen], engine, atol=F32_ATOL, rtol=0)


def mla_inputs(gen, dtype, device, contexts, nh, rank, rope_dim, page_size=16):
    """q_latent (B, nh, R), q_rope (B, nh, Dr), a latent pool (P, S, R + Dr), its table and
    context lengths."""
    P, table, lens = page_tables(gen, contexts, page_size)
    pool = _randn(gen, (P, page_size, rank + rope_dim), dtype, device)
    q_latent = _randn(gen, (len(contexts), nh, rank), dtype, device) * rank**-0.5
    q_rope = _randn(gen, (len(contexts), nh, rope_dim), dtype, device)
    return q_latent, q_rope, pool, table.to(device), lens.to(device)


def check_mla(device, dtype, contexts, nh, rank, rope_dim, partition_size=None,
              heads_per_block=attention.MLA_HEADS_PER_BLOCK, seed=0) -> None:  # fmt: skip
    """mla_decode against its reference."""
    gen = torch.Generator().manual_seed(seed)
    q_latent, q_rope, pool, table, lens = mla_inputs(gen, dtype, device, contexts, nh, rank,
                                                     rope_dim)  # fmt: skip
    scale = (rank + rope_dim) ** -0.5
    args = (q_latent, q_rope, pool, table, lens, scale)
    out = attention.mla_decode(*args, partition_size, heads_per_block)
    widened = (q_latent.float(), q_rope.float(), pool.float(), table, lens, scale)
    ref = attention.mla_decode_reference(*widened)
    assert out.shape == q_latent.shape and out.dtype == dtype
    assert_bounded(out, ref)


def check_mla_layer(device, contexts, nh, nope, rope_dim, rank, v_dim, seed=0) -> None:
    """float32: LatentAttention's forward (each row's new latent written into its last slot,
    then its absorbed decode) against mla_decode on the pool it wrote, with the layer's W_UK
    folded into the query and its W_UV applied after."""
    gen = torch.Generator().manual_seed(seed)
    f32, B, page_size = torch.float32, len(contexts), 16
    _, _, pool, table, lens = mla_inputs(gen, f32, device, contexts, 1, rank, rope_dim)
    up = LatentUpProjection(nh, nope, v_dim, rank, f32).to(device)
    up.weight.data = _randn(gen, up.weight.shape, f32, device) * rank**-0.5
    scale = (nope + rope_dim) ** -0.5
    layer = LatentAttention(nope, rope_dim, rank, scale)
    q = _randn(gen, (B, nh, nope + rope_dim), f32, device)
    latent, k_rope = _randn(gen, (B, rank), f32, device), _randn(gen, (B, rope_dim), f32, device)
    last = (lens - 1).long()  # each row's new token: its last key
    pages = table.long().gather(1, (last // page_size)[:, None])[:, 0]
    slots = pages * page_size + last % page_size
    rows = DecodeRows(None, table, lens, page_size, None)
    meta = AttentionMetadata(slot_mapping=slots, decode=rows, prefills=[])
    engine = layer(q, latent, k_rope, pool, meta, up)  # (B, nh, Dv); writes the pool
    w = up.heads  # (nh, Dn + Dv, R)
    q_nope, q_rope = q.split([nope, rope_dim], dim=-1)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)  # (B, nh, R)
    o = attention.mla_decode(q_latent.contiguous(), q_rope.contiguous(), pool, table, lens, scale)
    out = torch.einsum("bhr,hvr->bhv", o, w[:, nope:])  # (B, nh, Dv)
    torch.testing.assert_close(out, engine, atol=MLA_ATOL, rtol=0)
