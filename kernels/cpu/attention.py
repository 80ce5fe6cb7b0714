"""Paged attention's C part (attention.c, kv_write.c): the new tokens' K/V into their page
slots, then decode attention reading K/V in place from the pages."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check, row_stride

LANES = 16  # attention.c: head sizes must be a multiple of this
MAX_GROUP = 64  # attention.c: query heads per KV head, at most


def usable(q: torch.Tensor) -> bool:
    """Whether paged_attention can take q's device and dtype (library.usable)."""
    return library.usable(q)


def attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim % LANES == 0 and num_heads // num_kv_heads <= MAX_GROUP


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_table: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """Writes the new tokens' k, v (T, nkv, hd) into their slots (T,) int64 of kv_layer
    (2, P, S, nkv, hd), then runs decode attention for the decode rows of q (T, nh, hd) (rows
    may be strided), reading keys and values in place from the pages, into those rows of out
    (T, nh, hd), contiguous. The decode rows: block_table (B, Pmax) int32 of their pages,
    context_lens (B,) int32, rows (B,) int64 or None (rows 0..B-1), sliding window or None.
    No block_table: no row decodes. After usable(q)."""
    T, nh, hd = q.shape
    _, num_pages, page_size, nkv, _ = kv_layer.shape
    if not attention_supported(nh, nkv, hd):
        raise ValueError(f"paged_attention: head size {hd} or {nh}/{nkv} heads unsupported")
    check("paged_attention k", k, q.dtype, T, nkv, hd)
    check("paged_attention v", v, q.dtype, T, nkv, hd)
    check("paged_attention slots", slots, torch.int64, T)
    check("paged_attention pool", kv_layer, q.dtype, 2, num_pages, page_size, nkv, hd)
    check("paged_attention out", out, q.dtype, T, nh, hd)
    if not (kv_layer.is_contiguous() and out.is_contiguous() and slots.is_contiguous()):
        raise ValueError("paged_attention: the pool, out and slots must be contiguous")
    B, table, lens = 0, block_table, context_lens
    if table is not None:
        B = table.shape[0]
        check("paged_attention block_table", table, torch.int32, *table.shape)
        check("paged_attention context_lens", lens, torch.int32, B)
        if rows is not None:
            check("paged_attention rows", rows, torch.int64, B)
        elif B != T:
            raise ValueError(f"paged_attention: {B} rows decode but q has {T}")
        if not (table.is_contiguous() and lens.is_contiguous()):
            raise ValueError("paged_attention: block table and context lengths: contiguous")
    status = library.functions["tk_paged_attention", q.dtype](
        k.data_ptr(), row_stride("paged_attention k", k), v.data_ptr(),
        row_stride("paged_attention v", v), slots.data_ptr(), T,
        q.data_ptr(), row_stride("paged_attention q", q), None if rows is None else rows.data_ptr(),
        kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
        None if table is None else table.data_ptr(), 0 if table is None else table.stride(0),
        None if lens is None else lens.data_ptr(), B, nh, nkv, hd, page_size, window or 0, scale,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged_attention: no memory for the attention scores")
