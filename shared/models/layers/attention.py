"""Paged attention over the KV pool, for a flat batch that mixes prefill chunks and decode tokens.

The new tokens' K/V are written into their pages first (slot_mapping); then each query reads
its whole context straight from the pages. Decode rows (one query each) run as one padded
batch; each prefill chunk runs on its own with a causal mask offset by its cached prefix."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of this chunk in the flat (T, ...) batch
    end: int  # one past its last row
    pages: torch.Tensor  # (ceil(ctx / S),) pages of the whole context, cached prefix + chunk
    ctx: int  # context length: cached prefix + this chunk
    mask: torch.Tensor | None  # (n, ctx) bool; None when the chunk is the whole context (causal)


@dataclass
class DecodeGroup:
    """Decode rows (one query token each) whose contexts are within 2x of each other, so one
    padded attention call wastes little on padding."""

    rows: torch.Tensor  # (Bg,) rows of the flat batch
    pages: torch.Tensor  # (Bg, Pmax) page table of each row, 0-padded
    mask: torch.Tensor  # (Bg, 1, 1, Pmax * S) True where the key is visible


@dataclass
class AttentionMetadata:
    """Where each token's K/V lives; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # (T,) pool slot (page * page_size + offset) of each new token
    decode: list[DecodeGroup]
    all_decode: bool  # one decode group holding every row of T, in order (no row gathers)
    prefills: list[PrefillSpan]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads

    def forward(self, q, k, v, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd), kv_layer (2, P, S, nkv, hd) -> (T, nh, hd)."""
        pool = kv_layer.view(2, -1, self.num_kv_heads, self.head_dim)  # (2, P*S, nkv, hd)
        pool[0].index_copy_(0, meta.slot_mapping, k)  # new tokens into their slots
        pool[1].index_copy_(0, meta.slot_mapping, v)
        k_pages, v_pages = kv_layer[0], kv_layer[1]  # (P, S, nkv, hd): gathered page by page
        if meta.all_decode:
            return self._decode(q, k_pages, v_pages, meta.decode[0])
        out = torch.empty_like(q)
        for group in meta.decode:
            out[group.rows] = self._decode(q[group.rows], k_pages, v_pages, group)
        for span in meta.prefills:
            out[span.start : span.end] = self._prefill(
                q[span.start : span.end], k_pages, v_pages, span
            )
        return out

    def _decode(self, q, k_pages, v_pages, group: DecodeGroup) -> torch.Tensor:
        # whole pages are copied (S * nkv * hd contiguous elements each), not token slots;
        # index_select copies rows with memcpy, ~3x faster than advanced indexing on CPU
        shape = (*group.pages.shape[:1], -1, *k_pages.shape[2:])  # (Bg, Pmax*S, nkv, hd)
        pages = group.pages.flatten()
        keys = k_pages.index_select(0, pages).view(shape).transpose(1, 2)  # (Bd, nkv, L, hd)
        values = v_pages.index_select(0, pages).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (Bd, nh, 1, hd)
            keys,
            values,
            attn_mask=group.mask,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (Bd, nh, 1, hd)
        return out.squeeze(2)

    def _prefill(self, q, k_pages, v_pages, span: PrefillSpan) -> torch.Tensor:
        # 4-D inputs: the CPU flash kernel takes only (B, heads, L, hd); 3-D falls back to math
        keys = k_pages.index_select(0, span.pages).flatten(0, 1)[: span.ctx]  # (ctx, nkv, hd)
        values = v_pages.index_select(0, span.pages).flatten(0, 1)[: span.ctx]
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, hd); keys (1, nkv, ctx, hd)
            keys,
            values,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (1, nh, n, hd)
        return out[0].transpose(0, 1)
