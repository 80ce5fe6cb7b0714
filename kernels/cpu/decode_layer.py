"""The decoder layers of a decode step in one C call (decode_layer.c), Llama family, bfloat16.

Op by op, every op of a layer pays a Python module call, a ctypes call, a tensor allocation and
a thread-team wake-up, and the Python between the kernels runs on caches that the weights
stream has just flushed: ~250 us a layer here, a quarter of a batch-32 step. The fused call
runs the same kernels in the same order inside one OpenMP region, so its output is the
op-by-op output bit for bit."""

import ctypes
from typing import NamedTuple

import torch

from kernels.cpu import library
from kernels.cpu.all_reduce import ShmReduce, failure

_POINTERS = (
    "input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down",
    "cos", "sin", "router", "w13", "w2", "shared_gate_up", "shared_down",
)  # fmt: skip
_SIZES = (
    "hidden", "heads", "kv_heads", "head_dim", "intermediate", "shared_intermediate", "experts",
    "top_k", "scoring", "renormalize", "mask", "rope", "norm_after_rope", "temperature",
)  # fmt: skip
ROPE_NONE, ROPE_TABLES, ROPE_PAIRS = 0, 1, 2  # decode_layer.c's ROPE_*
ROUTE_SOFTMAX, ROUTE_SIGMOID = 0, 1  # kernels.h's ROUTE_*
MAX_MASKS = 4  # decode_layer.c's


class DecodeLayerSpec(ctypes.Structure):
    """decode_layer.c's `decode_layer`: one layer's weight addresses (bf16 tensors, contiguous;
    qkv_bias, q_norm, k_norm, cos and sin may be None) and shapes. Its MLP is dense (gate_up,
    down) or, with `router` set, routed experts (moe.c: w13 (E, 2I, H), w2 (E, H, I), top_k,
    `scoring` ROUTE_*, renormalize 0 or 1; `intermediate` is then an expert's I) beside a
    shared expert (shared_gate_up, shared_down, shared_intermediate) or not. `mask`: which of
    the step's masks the layer attends with; `rope` ROPE_*; norm_after_rope: q_norm and k_norm
    after the rotation (Llama 4's L2 norms), else before (Qwen3's); temperature: q times the
    step's factor of its row."""

    _fields_ = (
        [(name, ctypes.c_void_p) for name in _POINTERS]
        + [(name, ctypes.c_int64) for name in _SIZES]
        + [(name, ctypes.c_float) for name in ("eps", "qk_eps", "scale")]
    )


class StepMask(ctypes.Structure):
    """decode_layer.c's `step_mask`: one attention mask's decode rows in its layers' pool."""

    _fields_ = [
        ("slots", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("table_stride", ctypes.c_int64),
        ("window", ctypes.c_int64),
    ]


class DecodeHead(ctypes.Structure):
    """decode_layer.c's `decode_head`: the LM head after the final norm."""

    _fields_ = [
        ("weight", ctypes.c_void_p),
        ("vocab", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
        ("m", ctypes.c_int64),
        ("logits", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
    ]


class DecodeEmbed(ctypes.Structure):
    """decode_layer.c's `decode_embed`: the first layer's input as embedding rows."""

    _fields_ = [("table", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("ids", ctypes.c_void_p)]


class Embedding(NamedTuple):
    """decode_layers' first input as the rows weight[ids]: weight (V, H) bf16, ids (T,) int64
    (the step's tokens), gathered inside the call (F.embedding's rows)."""

    weight: torch.Tensor
    ids: torch.Tensor

    def spec(self, hidden: int) -> DecodeEmbed:
        """The C struct, once the tensors' shapes and types are checked."""
        weight, ids = self
        if not (
            weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] == hidden
            and weight.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"decode layers: the embedding must be contiguous bf16 (V, {hidden})")
        if not (ids.dtype == torch.int64 and ids.dim() == 1 and ids.is_contiguous()):
            raise ValueError("decode layers: the token ids must be contiguous int64 (T,)")
        return DecodeEmbed(weight.data_ptr(), weight.shape[0], ids.data_ptr())


class LMHead(NamedTuple):
    """decode_layers' LM head: logits (M, V) bf16 <- the final norm's output rows `rows` (M,)
    int64, each in [0, T) (None: all T rows, M = T) times weight (V, H) bf16, and tokens (M,)
    int64 <- each row's argmax (None: no argmax). logits and tokens are filled in place."""

    weight: torch.Tensor
    rows: torch.Tensor | None
    logits: torch.Tensor
    tokens: torch.Tensor | None = None

    def spec(self, num_rows: int, hidden: int) -> DecodeHead:
        """The C struct, once the tensors' shapes and types are checked."""
        weight, rows, logits, tokens = self
        m = num_rows if rows is None else len(rows)
        shaped = weight.dim() == 2 and weight.shape[1] == hidden
        if not (weight.dtype == torch.bfloat16 and shaped and weight.is_contiguous()):
            raise ValueError(
                f"decode layers: the head's weight must be contiguous bf16 (V, {hidden})"
            )
        want = (
            ("rows", rows, torch.int64, (m,)),
            ("logits", logits, torch.bfloat16, (m, weight.shape[0])),
            ("tokens", tokens, torch.int64, (m,)),
        )
        for name, t, dtype, shape in want:
            if t is not None and not (t.dtype == dtype and t.shape == shape and t.is_contiguous()):
                raise ValueError(
                    f"decode layers: the head's {name} must be contiguous {dtype} {shape}"
                )
        return DecodeHead(
            weight.data_ptr(), weight.shape[0], None if rows is None else rows.data_ptr(), m,
            logits.data_ptr(), None if tokens is None else tokens.data_ptr(),
        )  # fmt: skip


def step_mask(
    slots: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor, window: int | None
) -> StepMask:
    """A mask's rows: new K/V to slots (T,) int64; row t attends to its pages block_table[t]
    (T, Pmax) int32, context_lens[t] (T,) int32 keys, the last `window` of them when set. The
    tensors must outlive the call."""
    return StepMask(
        slots.data_ptr(), block_table.data_ptr(), context_lens.data_ptr(),
        block_table.stride(0), window or 0,
    )  # fmt: skip


def decode_layers(
    specs: ctypes.Array,
    x: torch.Tensor | Embedding,
    residual: torch.Tensor,
    first: bool,
    positions: torch.Tensor,
    pools: tuple[ctypes.Array, ctypes.Array],
    masks: list[StepMask],
    page_size: int,
    rope_cs: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    tp: ShmReduce | None = None,
    final_norm: tuple[torch.Tensor, float] | None = None,
    head: LMHead | None = None,
    max_positions: int = 0,
) -> torch.Tensor:
    """The layers of `specs` (a DecodeLayerSpec array), one new token a row: x (T, H) ->
    the last layer's output (T, H); residual (T, H) updated in place as the op-by-op layers
    do (first: it is x itself, the first layer's input). x an Embedding: the first layer's
    input is its rows, gathered into residual (needs first). Layer i's K and V pools
    (P*S, nkv, hd) are at pools[0][i] and pools[1][i]; it attends as masks[spec.mask] says;
    new tokens at positions (T,) int64, each below max_positions where that is > 0 (the rows
    of the layers' rotary tables, which the C kernels read unchecked). rope_cs (T, hd)
    float32: each row's cosines then sines (interleaved RoPE layers); temperature (T,)
    float32: each row's factor on q (layers that ask). tp: the tensor-parallel group's
    all-reduce (one rank's layers: None); x's bytes must fit its slots. final_norm (weight
    (H,) bf16, eps): the model's last RMSNorm in the same call, as the last stage runs it op
    by op: the output is norm(last layer's output + residual), and residual that sum. head:
    the LM head on that output too (LMHead; needs final_norm). IndexError for a position or
    token id out of range; RuntimeError where a peer is gone or late."""
    embed = None
    if isinstance(x, Embedding):
        if not first or residual.shape != (len(x.ids), specs[0].hidden):
            raise ValueError("decode layers: an embedding is the first layer's input (T, H)")
        embed, x = x.spec(specs[0].hidden), residual
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("decode layers: x and residual must be contiguous")
    for name, t, shape in (("rope_cs", rope_cs, 2), ("temperature", temperature, 1)):
        if t is not None and not (
            t.dtype == torch.float32 and t.dim() == shape and len(t) == len(x)
            and t.is_contiguous()
        ):  # fmt: skip
            raise ValueError(f"decode layers: {name} must be contiguous float32, a row a token")
    if tp is not None and x.numel() * x.element_size() > tp.slot_bytes:
        raise ValueError(f"decode layers: {tuple(x.shape)} rows exceed an all-reduce's slot")
    if not 1 <= len(masks) <= MAX_MASKS:
        raise ValueError(f"decode layers: {len(masks)} masks (1 to {MAX_MASKS})")
    norm, eps = final_norm if final_norm is not None else (None, 0.0)
    if norm is not None and not (
        norm.dtype == torch.bfloat16 and norm.shape == (x.shape[1],) and norm.is_contiguous()
    ):
        raise ValueError("decode layers: final_norm must be a contiguous bf16 (hidden,) weight")
    if head is not None and norm is None:
        raise ValueError("decode layers: the LM head needs final_norm")
    head_spec = None if head is None else head.spec(x.shape[0], x.shape[1])
    out = torch.empty_like(x)
    status = library.kernel("tk_decode_layers_bf16")(
        specs, len(specs), x.data_ptr(), None if embed is None else ctypes.byref(embed),
        residual.data_ptr(), first, out.data_ptr(), x.shape[0], positions.data_ptr(),
        max_positions, None if rope_cs is None else rope_cs.data_ptr(),
        None if temperature is None else temperature.data_ptr(), pools[0],
        pools[1], (StepMask * len(masks))(*masks), len(masks), page_size,
        None if tp is None else ctypes.byref(tp), None if norm is None else norm.data_ptr(), eps,
        None if head_spec is None else ctypes.byref(head_spec), torch.get_num_threads(),
    )  # fmt: skip
    if status == -3:
        raise RuntimeError(f"decode layers: {failure(tp)}")
    if status == -4:
        raise IndexError(f"decode layers: a position outside [0, {max_positions}) (rotary tables)")
    if status == -5:
        raise IndexError(f"decode layers: a token id outside the embedding's {embed.vocab} rows")
    if status != 0:
        raise MemoryError("decode layers: no memory for their activations")
    return out
