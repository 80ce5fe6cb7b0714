"""Paged attention over the KV pool, for a flat batch that mixes prefill chunks and decode tokens.

The new tokens' K/V are written into their pages first (slot_mapping); then each query reads
its whole context straight from the pages. Decode rows (one query each) run together: on CPU
in a C kernel that reads the pages in place, elsewhere as one padded torch batch. Each prefill
chunk runs on its own, with a causal mask offset by its cached prefix."""

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import attention as cpu_kernels


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of this chunk in the flat (T, ...) batch
    end: int  # one past its last row
    pages: torch.Tensor  # (ceil(ctx / S),) pages of the whole context, cached prefix + chunk
    ctx: int  # context length: cached prefix + this chunk
    mask: torch.Tensor | None  # (n, ctx) bool; None when the chunk is the whole context (causal)


@dataclass
class DecodeRows:
    """The rows of the flat batch that decode (one query token each), in the kernel's layout."""

    rows: torch.Tensor | None  # (B,) int64 rows of T; None when all T rows decode, in order
    block_table: torch.Tensor  # (B, Pmax) int32: each row's pages, 0-padded
    context_lens: torch.Tensor  # (B,) int32: keys each row attends to, its own token included
    page_size: int
    window: int | None  # sliding window: only the last `window` keys are visible

    def kernel_args(self) -> dict:
        """The decode part of cpu_kernels.paged_attention's arguments."""
        return dict(
            block_table=self.block_table,
            context_lens=self.context_lens,
            rows=self.rows,
            window=self.window,
        )

    @cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, 1, Pmax * S) True where a key is visible: the torch path's padding mask."""
        key_pos = torch.arange(self.block_table.shape[1] * self.page_size)
        ctx = self.context_lens.long()[:, None]
        visible = key_pos < ctx
        if self.window is not None:
            visible &= key_pos >= ctx - self.window
        return visible[:, None, None, :]


@dataclass
class AttentionMetadata:
    """Where each token's K/V lives; built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # (T,) pool slot (page * page_size + offset) of each new token
    decode: DecodeRows | None
    prefills: list[PrefillSpan]


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        self.kernel_ok = cpu_kernels.attention_supported(num_heads, num_kv_heads, head_dim)

    def forward(self, q, k, v, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd), kv_layer (2, P, S, nkv, hd) -> (T, nh, hd)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        d = meta.decode
        if self.kernel_ok and cpu_kernels.usable(q):  # K/V stored, decode rows done in C
            decode = {} if d is None else d.kernel_args()
            cpu_kernels.paged_attention(
                q, k, v, kv_layer, meta.slot_mapping, self.scale, out, **decode
            )
        else:
            pool = kv_layer.view(2, -1, self.num_kv_heads, self.head_dim)  # (2, P*S, nkv, hd)
            pool[0].index_copy_(0, meta.slot_mapping, k)  # new tokens into their slots
            pool[1].index_copy_(0, meta.slot_mapping, v)
            if d is not None:
                decoded = self._decode(q if d.rows is None else q[d.rows], *kv_layer, d)
                if d.rows is None:
                    return decoded
                out[d.rows] = decoded
        for span in meta.prefills:
            out[span.start : span.end] = self._prefill(
                q[span.start : span.end], kv_layer[0], kv_layer[1], span
            )
        return out

    def _decode(self, q, k_pages, v_pages, d: DecodeRows) -> torch.Tensor:
        # whole pages are copied (S * nkv * hd contiguous elements each), not token slots;
        # index_select copies rows with memcpy, ~3x faster than advanced indexing on CPU
        shape = (*d.block_table.shape[:1], -1, *k_pages.shape[2:])  # (B, Pmax*S, nkv, hd)
        pages = d.block_table.flatten().long()
        keys = k_pages.index_select(0, pages).view(shape).transpose(1, 2)  # (B, nkv, L, hd)
        values = v_pages.index_select(0, pages).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, nh, 1, hd)
            keys,
            values,
            attn_mask=d.mask,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # (B, nh, 1, hd)
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
