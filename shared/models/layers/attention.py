"""Paged attention over the KV pool, for a flat batch that mixes prefill chunks and decode tokens.

The new tokens' K/V are written into their pages first (slot_mapping); then each query reads
its context straight from the pages. Decode rows (one query each) run together; each prefill
chunk runs on its own, with a causal mask offset by its cached prefix. The engine's
AttentionBackend does the work (attention_backend.py: the C kernels on CPU, torch elsewhere).
A step's metadata holds one AttentionMetadata per distinct mask among the layers
(layer_attention.py: global, sliding window, chunked)."""

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from shared.models.layer_attention import AttentionMask


@dataclass
class PrefillSpan:
    """One sequence's prefill chunk inside the flat batch."""

    start: int  # first row of this chunk in the flat (T, ...) batch
    end: int  # one past its last row
    # (ceil(ctx / S),) pages of the context, cached prefix + chunk: all of it, or (chunked
    # layers) from the page of the first query's chunk on
    pages: torch.Tensor
    ctx: int  # keys from the first of those pages to the chunk's end
    mask: torch.Tensor | None  # (n, ctx) bool; None when the chunk is the whole context (causal)


@dataclass
class DecodeRows:
    """The rows of the flat batch that decode (one query token each), in the kernel's layout."""

    rows: torch.Tensor | None  # (B,) int64 rows of T; None when all T rows decode, in order
    block_table: torch.Tensor  # (B, Pmax) int32: each row's pages, 0-padded
    context_lens: torch.Tensor  # (B,) int32: keys each row attends to, its own token included
    page_size: int
    window: int | None  # sliding window: only the last `window` keys are visible
    # (B,) int32: keys before this one in each row's pages are hidden; None: none. Chunked
    # layers' tables start at their chunk's page: set only where chunks do not start pages
    first_key: torch.Tensor | None = None

    def kernel_args(self) -> dict:
        """The decode part of kernels.cpu.attention.paged_attention's arguments."""
        return dict(
            block_table=self.block_table,
            context_lens=self.context_lens,
            rows=self.rows,
            window=self.window,
        )

    @cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, 1, Pmax * S) True where a key is visible: the torch path's padding mask."""
        key_pos = torch.arange(self.block_table.shape[1] * self.page_size, device=self.device)
        ctx = self.context_lens.long()[:, None]
        visible = key_pos < ctx
        if self.window is not None:
            visible &= key_pos >= ctx - self.window
        if self.first_key is not None:
            visible &= key_pos >= self.first_key.long()[:, None]
        return visible[:, None, None, :]

    @property
    def device(self) -> torch.device:
        return self.block_table.device


@dataclass
class AttentionMetadata:
    """Where each token's K/V lives and which keys each query sees; built once per step for
    each distinct mask, read by every layer of that mask."""

    slot_mapping: torch.Tensor  # (T,) pool slot (page * page_size + offset) of each new token
    decode: DecodeRows | None
    prefills: list[PrefillSpan]


@dataclass
class StepMetadata:
    """A step's attention metadata: one AttentionMetadata per distinct mask among the layers
    that run it (one for a model whose layers all attend alike), each with the slot mapping of
    its layers' pool."""

    by_mask: dict[AttentionMask, AttentionMetadata]

    def of(self, mask: AttentionMask) -> AttentionMetadata:
        return self.by_mask[mask]


class PagedAttention(nn.Module):
    """The attention of one layer: writes the new K/V into its pages, attends over them with
    the engine's backend (chosen once), or the torch one where that backend lacks the shape."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend.for_shape(num_heads, num_kv_heads, head_dim)
        self.kernel_ok = self.backend.fused_decode  # decode_layer.py: may run fused

    def forward(self, q, k, v, kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd), kv_layer (2, P, S, nkv, hd) -> (T, nh, hd)."""
        return self.backend.forward(q, k, v, kv_layer, meta, self.scale)
