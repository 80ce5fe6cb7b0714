"""The decoder layers of a decode step in one C call (decode_layer.c), on every CPU tier.

Op by op, every op of a layer pays a Python module call, a ctypes call, a tensor allocation and
a thread-team wake-up, and the Python between the kernels runs on caches that the weights
stream has just flushed: ~250 us a layer here, a quarter of a batch-32 step. The fused call
runs the same kernels in the same order inside one OpenMP region, so its output is the
op-by-op output bit for bit. It takes steps whose rows all decode, bfloat16, one tensor-
parallel rank (no all-reduce inside) and linears on the C linear (linear_bf16.c); everything
else stays op by op."""

import ctypes

import torch

from shared.kv.cache import KVCache
from shared.models.layers import cpu_kernels
from shared.models.layers.attention import AttentionMetadata

_POINTERS = (
    "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down",
    "cos", "sin",
)  # fmt: skip
_SIZES = ("hidden", "heads", "kv_heads", "head_dim", "intermediate")


class DecodeLayerSpec(ctypes.Structure):
    """decode_layer.c's `decode_layer`: one layer's weight addresses and shapes."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_int64) for name in _SIZES]
        + [(name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")]
    )


def layer_spec(
    *, input_norm, qkv, q_norm, k_norm, rotary, attn, o, post_norm, gate_up, down
) -> tuple[DecodeLayerSpec, list[torch.Tensor]] | None:
    """One decoder layer's spec and the tensors it points into, or None where the fused call
    cannot run it (a linear not on the C linear, more than one tensor-parallel rank, an
    unsupported head shape)."""
    linears = (qkv, o, gate_up, down)
    if not (
        all(getattr(m, "c_linear", False) for m in linears)
        and all(getattr(m, "tp", None) is None or m.tp.size == 1 for m in linears)
        and attn.kernel_ok
        and input_norm.weight.dtype == torch.bfloat16
    ):
        return None
    tensors = [
        input_norm.weight, qkv.weight, qkv.bias, None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight, o.weight, post_norm.weight, gate_up.weight,
        down.weight, rotary.cos, rotary.sin,
    ]  # fmt: skip
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    spec = DecodeLayerSpec(
        *(None if t is None else t.data_ptr() for t in tensors),
        input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
        down.weight.shape[1], input_norm.eps, input_norm.eps if q_norm is None else q_norm.eps,
        attn.scale,
    )  # fmt: skip
    return spec, [t for t in tensors if t is not None]


class FusedDecoder:
    """A stage's decoder layers, for decode steps: their specs, in order, and the tensors the
    specs point into (kept alive with them)."""

    def __init__(self, specs: list[tuple[DecodeLayerSpec, list[torch.Tensor]]], rotary):
        self.specs = (DecodeLayerSpec * len(specs))(*(spec for spec, _ in specs))
        self._tensors = [t for _, tensors in specs for t in tensors]
        self.rotary = rotary
        self._call = cpu_kernels.kernel("tk_decode_layers_bf16")  # loaded: the linears use it

    @staticmethod
    def takes(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can run fused: every row decodes, in order, few enough rows."""
        d = meta.decode
        return (
            d is not None
            and d.rows is None
            and not meta.prefills
            and x.shape[0] <= cpu_kernels.linear_max_rows()
            and x.dtype == torch.bfloat16
        )

    def __call__(
        self, positions, x: torch.Tensor, residual: torch.Tensor | None, kv: KVCache, meta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the layers op by op: x (T, H), residual (T, H) or None (first layer) ->
        (last layer's output, residual), residual updated in place (x itself when None)."""
        self.rotary.check(positions)
        d = meta.decode
        first = residual is None
        if first:
            residual = x
        if not (x.is_contiguous() and residual.is_contiguous()):
            raise ValueError("decode layers: x and residual must be contiguous")
        out = torch.empty_like(x)
        pool = kv.data  # (L, 2, P, S, nkv, hd)
        status = self._call(
            self.specs, len(self.specs), x.data_ptr(), residual.data_ptr(), first,
            out.data_ptr(), x.shape[0], positions.data_ptr(), meta.slot_mapping.data_ptr(),
            pool.data_ptr(), pool.stride(0), pool.stride(1), d.block_table.data_ptr(),
            d.block_table.stride(0), d.context_lens.data_ptr(), d.page_size, d.window or 0,
            torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("decode layers: no memory for their activations")
        return out, residual
