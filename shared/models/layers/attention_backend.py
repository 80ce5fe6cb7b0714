"""Attention backends: how the attention layers write a step's new K/V into their pages and
attend over paged KV. The engine chooses one (select_backend: from the device, the dtype and
whether the C kernels build) and hands it to every layer; another device adds a backend here.

- TorchBackend: plain torch (index_copy_ and SDPA) on any device and dtype, for every mask;
  the reference the other backends are tested against.
- CpuKernelBackend: the C kernels on CPU, float32 and bfloat16: one pass writes the new K/V
  and runs the decode rows over the pages in place (kernels/cpu/attention.py). Prefill
  chunks are torch's SDPA, and so are decode rows whose mask the kernel cannot express (a
  chunked layer whose chunks do not start pages). Its layers may also run whole decode steps
  in one C call (decode_layer.py) when they all attend alike.
- CudaBackend: the CUDA kernels (kernels/cuda/, cupy): the K/V write into page slots and the
  decode rows over their pages (flash decoding); prefill chunks are torch's SDPA (flash
  attention on a GPU). Its launches read everything from device memory, so decode steps
  replay from CUDA graphs (shared/engine/graphs.py)."""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F

from kernels.cpu import attention as cpu_attention
from kernels.cuda import attention as cuda_attention
from kernels.cuda import kv_pages
from kernels.cuda import runtime as cuda
from shared.errors import InvalidRequestError
from shared.models.layers.attention import AttentionMetadata, DecodeRows, PrefillSpan

AUTO, CPU_KERNELS, CUDA, TORCH = "auto", "cpu_kernels", "cuda", "torch"
BACKENDS = (AUTO, CPU_KERNELS, CUDA, TORCH)  # EngineConfig.attention_backend


class AttentionBackend(ABC):
    """One layer's attention for a step's flat batch (prefill chunks and decode rows mixed),
    in two parts: the new K/V written into their slots together with the decode rows (one
    query each, over their pages), then each prefill chunk over its context's pages."""

    name: ClassVar[str]
    fused_decode: ClassVar[bool] = False  # whether its layers may run decode_layer.c

    def for_shape(self, num_heads: int, num_kv_heads: int, head_dim: int) -> "AttentionBackend":
        """The backend of a layer with these (per-rank) heads: this one, or one that takes
        them."""
        return self

    @abstractmethod
    def write_and_decode(
        self, q, k, v, kv_layer, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        """Writes k, v (T, nkv, hd) into their slots (meta.slot_mapping) of kv_layer
        (2, P, S, nkv, hd), then attends the decode rows of q (T, nh, hd) (meta.decode, if
        any) over their pages into those rows of out (T, nh, hd). Returns out, or the decode
        output itself when every row decodes."""

    @abstractmethod
    def prefill(self, q, kv_layer, span: PrefillSpan, scale: float) -> torch.Tensor:
        """One prefill chunk: q (n, nh, hd) over its context's pages -> (n, nh, hd)."""

    def forward(self, q, k, v, kv_layer, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q (T, nh, hd), k/v (T, nkv, hd), kv_layer (2, P, S, nkv, hd) -> (T, nh, hd)."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        out = self.write_and_decode(q, k, v, kv_layer, meta, scale, out)
        for span in meta.prefills:
            out[span.start : span.end] = self.prefill(
                q[span.start : span.end], kv_layer, span, scale
            )
        return out


class TorchBackend(AttentionBackend):
    name = TORCH

    def write_and_decode(self, q, k, v, kv_layer, meta, scale, out):
        self.write_kv(k, v, kv_layer, meta.slot_mapping)
        return self.decode_rows(q, kv_layer, meta.decode, scale, out)

    @staticmethod
    def write_kv(k, v, kv_layer, slot_mapping: torch.Tensor) -> None:
        """k, v (T, nkv, hd) into their slots (T,) of kv_layer (2, P, S, nkv, hd)."""
        pool = kv_layer.view(2, -1, *k.shape[1:])  # (2, P*S, nkv, hd)
        pool[0].index_copy_(0, slot_mapping, k)
        pool[1].index_copy_(0, slot_mapping, v)

    def decode_rows(self, q, kv_layer, d: DecodeRows | None, scale: float, out) -> torch.Tensor:
        """The decode rows of q (T, nh, hd) into those rows of out; returns out, or the decode
        output itself when every row decodes (no copy)."""
        if d is None:
            return out
        decoded = self.decode(q if d.rows is None else q[d.rows], kv_layer, d, scale)
        if d.rows is None:
            return decoded
        out[d.rows] = decoded
        return out

    @staticmethod
    def decode(q, kv_layer, d: DecodeRows, scale: float) -> torch.Tensor:
        """q (B, nh, hd), one query a row, over its pages -> (B, nh, hd)."""
        # whole pages are copied (S * nkv * hd contiguous elements each), not token slots;
        # index_select copies rows with memcpy, ~3x faster than advanced indexing on CPU
        k_pages, v_pages = kv_layer[0], kv_layer[1]
        shape = (*d.block_table.shape[:1], -1, *k_pages.shape[2:])  # (B, Pmax*S, nkv, hd)
        pages = d.block_table.flatten().long()
        keys = k_pages.index_select(0, pages).view(shape).transpose(1, 2)  # (B, nkv, L, hd)
        values = v_pages.index_select(0, pages).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (B, nh, 1, hd)
            keys,
            values,
            attn_mask=d.mask,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )  # (B, nh, 1, hd)
        return out.squeeze(2)

    def prefill(self, q, kv_layer, span: PrefillSpan, scale: float) -> torch.Tensor:
        # 4-D inputs: the CPU flash kernel takes only (B, heads, L, hd); 3-D falls back to math
        keys = kv_layer[0].index_select(0, span.pages).flatten(0, 1)[: span.ctx]  # (ctx, nkv, hd)
        values = kv_layer[1].index_select(0, span.pages).flatten(0, 1)[: span.ctx]
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # (1, nh, n, hd); keys (1, nkv, ctx, hd)
            keys,
            values,
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )  # (1, nh, n, hd)
        return out[0].transpose(0, 1)


class CpuKernelBackend(AttentionBackend):
    name = CPU_KERNELS
    fused_decode = True

    def __init__(self) -> None:
        if not cpu_attention.usable(torch.empty(0)):  # builds and loads them on first use
            raise RuntimeError("the C CPU kernels could not be built (no C compiler?)")
        self.reference = TorchBackend()  # prefill chunks; decode masks the kernel lacks

    def for_shape(self, num_heads, num_kv_heads, head_dim) -> AttentionBackend:
        if cpu_attention.attention_supported(num_heads, num_kv_heads, head_dim):
            return self
        return self.reference

    def write_and_decode(self, q, k, v, kv_layer, meta, scale, out):
        d = meta.decode
        if d is not None and d.first_key is not None:  # the kernel writes, torch decodes
            cpu_attention.paged_attention(q, k, v, kv_layer, meta.slot_mapping, scale, out)
            return self.reference.decode_rows(q, kv_layer, d, scale, out)
        decode = {} if d is None else d.kernel_args()
        cpu_attention.paged_attention(q, k, v, kv_layer, meta.slot_mapping, scale, out, **decode)
        return out

    def prefill(self, q, kv_layer, span, scale):
        return self.reference.prefill(q, kv_layer, span, scale)


class CudaBackend(AttentionBackend):
    name = CUDA

    def __init__(self) -> None:
        self.reference = TorchBackend()  # prefill chunks (SDPA)

    def write_and_decode(self, q, k, v, kv_layer, meta, scale, out):
        kv_pages.write_kv(k, v, kv_layer, meta.slot_mapping)
        d = meta.decode
        if d is None:
            return out
        rows = (q if d.rows is None else q[d.rows]).contiguous()  # (B, nh, hd)
        decoded = cuda_attention.paged_decode(
            rows, kv_layer, d.block_table, d.context_lens, scale, d.window, d.first_key
        )  # (B, nh, hd)
        if d.rows is None:
            return decoded
        out[d.rows] = decoded
        return out

    def prefill(self, q, kv_layer, span, scale):
        return self.reference.prefill(q, kv_layer, span, scale)


def select_backend(
    device: torch.device | str, dtype: torch.dtype, name: str = AUTO
) -> AttentionBackend:
    """The engine's backend. auto: the C kernels where they run (CPU, float32 or bfloat16,
    a C compiler to build them), the CUDA kernels on a GPU where cupy imports, else torch;
    torch: always torch (tests, debugging); cpu_kernels, cuda: those kernels, or
    InvalidRequestError where they cannot run."""
    if name not in BACKENDS:
        raise InvalidRequestError("attention_backend", f"must be one of {', '.join(BACKENDS)}")
    if name == TORCH:
        return TorchBackend()
    kind = torch.device(device).type
    if name == CUDA or (name == AUTO and kind == "cuda"):
        if cuda.usable(torch.empty(0, dtype=dtype, device=torch.device(device))):
            return CudaBackend()
    if name == CUDA:
        raise InvalidRequestError(
            "attention_backend",
            f"the CUDA kernels do not run for {dtype} on {device} (a GPU, float32 or "
            "bfloat16, cupy)",
        )
    if kind == "cpu" and cpu_attention.usable(torch.empty(0, dtype=dtype)):
        return CpuKernelBackend()
    if name == CPU_KERNELS:
        raise InvalidRequestError(
            "attention_backend",
            f"the C kernels do not run for {dtype} on {device} (CPU, float32 or bfloat16, "
            "a C compiler)",
        )
    return TorchBackend()
