"""A decoder layer in one C call (decode_layer.c) for decode steps on CPUs with AMX.

Op by op, a layer of a decode step pays per op a Python module call, a ctypes call, a tensor
allocation and a thread-team wake-up: ~250 us a layer here, a quarter of a batch-32 step. The
fused call runs the same kernels in the same order inside one OpenMP region, so its output is
the op-by-op output bit for bit. It takes steps whose rows all decode, bfloat16, one tensor-
parallel rank (no all-reduce inside) and linears on AMX; everything else stays op by op."""

import ctypes

import torch
from torch import nn

from shared.models.layers import cpu_kernels
from shared.models.layers.attention import AttentionMetadata
from shared.models.layers.cpu_linear import AMX_MAX_ROWS

_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up")
_TABLES = ("down", "cos", "sin")
_SIZES = ("hidden", "heads", "kv_heads", "head_dim", "intermediate")


class DecodeLayerSpec(ctypes.Structure):
    """decode_layer.c's `decode_layer`: one layer's weight addresses and shapes."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _WEIGHTS + _TABLES]
        + [(name, ctypes.c_int64) for name in _SIZES]
        + [(name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")]
    )


class FusedDecodeLayer:
    """Holds one layer's spec and the tensors it points into (kept alive with it)."""

    def __init__(self, spec: DecodeLayerSpec, tensors: list[torch.Tensor], rotary: nn.Module):
        self.spec, self._tensors, self.rotary = spec, tensors, rotary
        self._call = None

    @classmethod
    def build(
        cls, *, input_norm, qkv, q_norm, k_norm, rotary, attn, o, post_norm, gate_up, down
    ) -> "FusedDecodeLayer | None":  # fmt: skip
        """The fused layer for these parts, or None where it cannot run them (no AMX, a
        linear not on AMX, more than one tensor-parallel rank, an unsupported head shape)."""
        linears = (qkv, o, gate_up, down)
        if not (
            cpu_kernels.amx_ready()
            and all(getattr(m, "amx", False) for m in linears)
            and all(getattr(m, "tp", None) is None or m.tp.size == 1 for m in linears)
            and attn.kernel_ok
            and input_norm.weight.dtype == torch.bfloat16
        ):
            return None
        tensors = [
            input_norm.weight, qkv.weight, qkv.bias, None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight, o.weight, post_norm.weight,
            gate_up.weight, down.weight, rotary.cos, rotary.sin,
        ]  # fmt: skip
        if any(t is not None and not t.is_contiguous() for t in tensors):
            return None
        spec = DecodeLayerSpec(
            *(None if t is None else t.data_ptr() for t in tensors),
            input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
            down.weight.shape[1],
            input_norm.eps, input_norm.eps if q_norm is None else q_norm.eps, attn.scale,
        )  # fmt: skip
        return cls(spec, [t for t in tensors if t is not None], rotary)

    @staticmethod
    def takes(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can run fused: every row decodes, in order, few enough rows."""
        d = meta.decode
        return (
            d is not None
            and d.rows is None
            and not meta.prefills
            and x.shape[0] <= AMX_MAX_ROWS
            and x.dtype == torch.bfloat16
        )

    def __call__(
        self, positions, x: torch.Tensor, residual: torch.Tensor | None, kv_layer, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward: x (T, H), residual (T, H) or None (first layer) ->
        (out, residual), residual updated in place. kv_layer (2, P, S, nkv, hd)."""
        self.rotary.check(positions)
        d = meta.decode
        n = x.shape[0]
        first = residual is None
        if first:
            residual = x
        if not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError("decode layer: x and residual must be contiguous")
        out = torch.empty_like(x)
        pool = kv_layer.data_ptr()
        if self._call is None:
            cpu_kernels.usable(x)  # builds the library on first use
            self._call = cpu_kernels.kernel("tk_decode_layer_bf16")
        status = self._call(
            ctypes.byref(self.spec), x.data_ptr(), residual.data_ptr(), first, out.data_ptr(), n,
            positions.data_ptr(), meta.slot_mapping.data_ptr(), pool,
            pool + kv_layer.stride(0) * kv_layer.element_size(), d.block_table.data_ptr(),
            d.block_table.stride(0), d.context_lens.data_ptr(), d.page_size, d.window or 0,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode layer: no memory for its activations")
        return out, residual
