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
    slots: torch.Tensor  # (ctx,) pool slots of the whole context, cached prefix + this chunk
    mask: torch.Tensor | None  # (n, ctx) bool; None when the chunk is the whole context (causal)


@dataclass
class AttentionMetadata:
    """Where each token's K/V lives; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # (T,) pool slot (page * page_size + offset) of each new token
    decode_rows: torch.Tensor | None  # (Bd,) rows of T that are single decode tokens; None: none
    decode_slots: torch.Tensor | None  # (Bd, Lmax) pool slots of each decode row's context
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) True where the key is visible
    all_decode: bool  # every row of T is a decode row, in order (skip gathers)
    prefills: list[PrefillSpan]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads

    def forward(self, q, k, v, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd), kv_layer (2, P, S, nkv, hd) -> (T, nh, hd)."""
        k_pool = kv_layer[0].view(-1, self.num_kv_heads, self.head_dim)  # (P*S, nkv, hd)
        v_pool = kv_layer[1].view(-1, self.num_kv_heads, self.head_dim)
        k_pool.index_copy_(0, meta.slot_mapping, k)
        v_pool.index_copy_(0, meta.slot_mapping, v)
        if meta.all_decode:
            return self._decode(q, k_pool, v_pool, meta)
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_pool, v_pool, meta)
        for span in meta.prefills:
            out[span.start : span.end] = self._prefill(
                q[span.start : span.end], k_pool, v_pool, span
            )
        return out

    def _decode(self, q, k_pool, v_pool, meta) -> torch.Tensor:
        keys = k_pool[meta.decode_slots].transpose(1, 2)  # (Bd, nkv, Lmax, hd)
        values = v_pool[meta.decode_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,  # q: (Bd, nh, 1, hd)
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (Bd, nh, 1, hd)
        return out.squeeze(2)

    def _prefill(self, q, k_pool, v_pool, span: PrefillSpan) -> torch.Tensor:
        # 4-D inputs: the CPU flash kernel takes only (B, heads, L, hd); 3-D falls back to math
        keys = k_pool[span.slots].transpose(0, 1).unsqueeze(0)  # (1, nkv, ctx, hd)
        values = v_pool[span.slots].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, hd)
            keys,
            values,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (1, nh, n, hd)
        return out[0].transpose(0, 1)
