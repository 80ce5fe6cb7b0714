"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) over paged latent KV.

A token's KV is one latent c (kv_lora_rank R, RMS-normed) and one RoPE key part k_r
(qk_rope_head_dim Dr) shared by every head: R + Dr values per token and layer (MLAKVSpec), not
2 x heads x head_dim. kv_b_proj holds each head's W_UK (Dn x R) and W_UV (Dv x R), which turn
a latent into the head's no-RoPE key and its value. Prefill chunks expand their context's
latents into keys and values (compute-bound: one matmul, then ordinary attention). Decode rows
use the absorbed form, which reads only the latent pages (memory-bound):
    q_n . (W_UK c) = (W_UK^T q_n) . c      each head's query moves into latent space, and
    sum_j p_j W_UV c_j = W_UV sum_j p_j c_j W_UV applies once, after attention,
so decoding is multi-query attention with one (R + Dr)-dim key and one R-dim value a token.

Plain torch on any device, but for the CUDA kernels of the latent write and the absorbed decode
on a GPU (kernels/cuda/kv_pages.py, attention.py); the heads are split across tensor-parallel
ranks (q, kv_b_proj, o), the latent cache is whole on every rank."""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cuda import attention as cuda_attention
from kernels.cuda import kv_pages
from kernels.cuda import runtime as cuda
from shared.models.layers.attention import AttentionMetadata, DecodeRows, PrefillSpan
from shared.models.layers.linear import _copy
from shared.parallel.group import SINGLE, TPGroup


class LatentUpProjection(nn.Module):
    """kv_b_proj: each head's W_UK and W_UV, heads split across TP ranks (column parallel).
    Read as per-head matrices by LatentAttention, never as a linear layer (so packing.py
    leaves its weight plain)."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int, dtype,
                 tp: TPGroup = SINGLE):  # fmt: skip
        super().__init__()
        self.tp = tp
        self.num_heads = tp.shard(num_heads, "num_attention_heads")  # this rank's
        self.nope_dim, self.v_dim = nope_dim, v_dim
        rows = self.num_heads * (nope_dim + v_dim)
        self.weight = nn.Parameter(
            torch.empty(rows, kv_lora_rank, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = param.shape[0]
        _copy(param.data, loaded.narrow(0, self.tp.rank * rows, rows))

    @property
    def heads(self) -> torch.Tensor:
        """(nh, Dn + Dv, R): per head, W_UK's rows then W_UV's."""
        return self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (N, R) -> no-RoPE keys (N, nh, Dn) and values (N, nh, Dv) of every head."""
        kv = F.linear(latent, self.weight).view(len(latent), self.num_heads, -1)
        return kv.split([self.nope_dim, self.v_dim], dim=-1)


class LatentAttention(nn.Module):
    """One layer's MLA over its latent pages: writes the new tokens' latent + RoPE key into
    their slots, then attends, absorbed for decode rows and expanded for prefill chunks."""

    def __init__(self, nope_dim: int, rope_dim: int, kv_lora_rank: int, scale: float):
        super().__init__()
        self.nope_dim, self.rope_dim, self.rank = nope_dim, rope_dim, kv_lora_rank
        self.scale = scale
        self.absorb = True  # False: decode rows expanded as prefill is (tests compare both)

    def forward(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        up: LatentUpProjection,
    ) -> torch.Tensor:
        """q (T, nh, Dn + Dr) (its RoPE part rotated), latent (T, R), k_rope (T, Dr) rotated,
        kv_layer (P, S, R + Dr) -> (T, nh, Dv)."""
        if cuda.usable(kv_layer):  # one launch, no concatenated copy
            kv_pages.write_latent(latent, k_rope, kv_layer, meta.slot_mapping)
        else:
            entries = kv_layer.view(-1, self.rank + self.rope_dim)  # (P * S, R + Dr)
            entries.index_copy_(0, meta.slot_mapping, torch.cat([latent, k_rope], dim=-1))
        d = meta.decode
        if d is not None and d.rows is None:  # every row decodes
            return self._decode(q, kv_layer, d, up)
        out = q.new_empty((*q.shape[:2], up.v_dim))
        if d is not None:
            out[d.rows] = self._decode(q[d.rows], kv_layer, d, up)
        for span in meta.prefills:
            out[span.start : span.end] = self._prefill(q[span.start : span.end], kv_layer, span, up)
        return out

    def _decode(self, q, kv_layer, d: DecodeRows, up: LatentUpProjection) -> torch.Tensor:
        """q (B, nh, Dn + Dr), one query a row, over its pages -> (B, nh, Dv)."""
        B = q.shape[0]
        if self.absorb and cuda.usable(q):
            return self._decode_kernel(q, kv_layer, d, up)
        entries = kv_layer.index_select(0, d.block_table.flatten().long()).view(
            B, -1, kv_layer.shape[-1]
        )
        if not self.absorb:
            return self._attend_expanded(q, entries, d.mask, up)  # (B, L, R + Dr)
        w = up.heads  # (nh, Dn + Dv, R)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, : self.nope_dim])  # (nh, B, R)
        query = torch.cat([q_latent.transpose(0, 1), q_rope], dim=-1)  # (B, nh, R + Dr)
        scores = torch.bmm(query, entries.transpose(1, 2)).float() * self.scale  # (B, nh, L)
        scores = scores.masked_fill(~d.mask[:, 0], -torch.inf)  # mask (B, 1, L)
        probs = scores.softmax(dim=-1).to(q.dtype)
        o_latent = torch.bmm(probs, entries[..., : self.rank])  # (B, nh, R)
        out = torch.bmm(o_latent.transpose(0, 1), w[:, self.nope_dim :].transpose(1, 2))
        return out.transpose(0, 1)  # (B, nh, Dv)

    def _decode_kernel(self, q, kv_layer, d: DecodeRows, up: LatentUpProjection):
        """_decode's absorbed attention on the CUDA kernel (kernels/cuda/attention.py), which
        reads each latent row once for a block of heads: q (B, nh, Dn + Dr) -> (B, nh, Dv)."""
        w = up.heads  # (nh, Dn + Dv, R)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, : self.nope_dim])  # (nh, B, R)
        o_latent = cuda_attention.mla_decode(
            q_latent.transpose(0, 1).contiguous(),  # (B, nh, R)
            q_rope.contiguous(),  # (B, nh, Dr)
            kv_layer,
            d.block_table,
            d.context_lens,
            self.scale,
        )  # (B, nh, R)
        out = torch.bmm(o_latent.transpose(0, 1), w[:, self.nope_dim :].transpose(1, 2))
        return out.transpose(0, 1)  # (B, nh, Dv)

    def _attend_expanded(self, q, entries, mask, up: LatentUpProjection) -> torch.Tensor:
        """q (B, nh, Dn + Dr), entries (B, L, R + Dr), mask (B, 1, 1, L) -> (B, nh, Dv)."""
        B, L = entries.shape[:2]
        keys, values = self._expand(entries.flatten(0, 1), up)  # (B * L, nh, ...)
        keys = keys.view(B, L, *keys.shape[1:]).transpose(1, 2)  # (B, nh, L, Dn + Dr)
        values = values.view(B, L, *values.shape[1:]).transpose(1, 2)  # (B, nh, L, Dv)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=self.scale
        )  # (B, nh, 1, Dv)
        return out.squeeze(2)

    def _prefill(self, q, kv_layer, span: PrefillSpan, up: LatentUpProjection) -> torch.Tensor:
        """One prefill chunk: q (n, nh, Dn + Dr) over its context's latents -> (n, nh, Dv)."""
        entries = kv_layer.index_select(0, span.pages).flatten(0, 1)[: span.ctx]  # (ctx, R + Dr)
        keys, values = self._expand(entries, up)  # (ctx, nh, Dn + Dr), (ctx, nh, Dv)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, Dn + Dr)
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=self.scale,
        )  # (1, nh, n, Dv)
        return out[0].transpose(0, 1)

    def _expand(self, entries: torch.Tensor, up: LatentUpProjection):
        """entries (N, R + Dr) -> keys (N, nh, Dn + Dr) (each head's no-RoPE part, the shared
        RoPE part) and values (N, nh, Dv)."""
        latent, k_rope = entries.split([self.rank, self.rope_dim], dim=-1)
        k_nope, values = up.expand(latent)
        k_rope = k_rope[:, None, :].expand(-1, k_nope.shape[1], -1)
        return torch.cat([k_nope, k_rope], dim=-1), values
