"""The decoder layers of a decode step in one C call (decode_layer.c), Llama family, bfloat16.

Op by op, every op of a layer pays a Python module call, a ctypes call, a tensor allocation and
a thread-team wake-up, and the Python between the kernels runs on caches that the weights
stream has just flushed: ~250 us a layer here, a quarter of a batch-32 step. The fused call
runs the same kernels in the same order inside one OpenMP region, so its output is the
op-by-op output bit for bit."""

import ctypes

import torch

from kernels.cpu import library

_POINTERS = (
    "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down",
    "cos", "sin", "router", "w13", "w2",
)  # fmt: skip
_SIZES = (
    "hidden", "heads", "kv_heads", "head_dim", "intermediate", "experts", "top_k", "renormalize",
)  # fmt: skip


class DecodeLayerSpec(ctypes.Structure):
    """decode_layer.c's `decode_layer`: one layer's weight addresses (bf16 tensors, contiguous;
    qkv_bias, q_norm and k_norm may be None) and shapes. Its MLP is dense (gate_up, down) or,
    with `router` set, routed experts (moe.c: w13 (E, 2I, H), w2 (E, H, I), softmax top_k,
    renormalize 0 or 1; `intermediate` is then an expert's I)."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_int64) for name in _SIZES]
        + [(name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")]
    )


def decode_layers(
    specs: ctypes.Array,
    x: torch.Tensor,
    residual: torch.Tensor,
    first: bool,
    positions: torch.Tensor,
    slots: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    window: int | None,
) -> torch.Tensor:
    """The layers of `specs` (a DecodeLayerSpec array), one new token a row: x (T, H) ->
    the last layer's output (T, H); residual (T, H) updated in place as the op-by-op layers
    do (first: it is x itself, the first layer's input). Layer i's K/V pages are pool[i]
    (L, 2, P, S, nkv, hd); the new K/V go to slots (T,) int64 at positions (T,) int64; row t
    attends to its pages block_table[t] (T, Pmax) int32, context_lens[t] (T,) int32 keys, the
    last `window` of them when a window is set."""
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("decode layers: x and residual must be contiguous")
    out = torch.empty_like(x)
    status = library.kernel("tk_decode_layers_bf16")(
        specs, len(specs), x.data_ptr(), residual.data_ptr(), first, out.data_ptr(), x.shape[0],
        positions.data_ptr(), slots.data_ptr(), pool.data_ptr(), pool.stride(0), pool.stride(1),
        block_table.data_ptr(), block_table.stride(0), context_lens.data_ptr(), page_size,
        window or 0, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode layers: no memory for their activations")
    return out
