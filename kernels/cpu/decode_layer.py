"""The decoder layers of a decode step in one C call (decode_layer.c), Llama family, bfloat16.

Op by op, every op of a layer pays a Python module call, a ctypes call, a tensor allocation and
a thread-team wake-up, and the Python between the kernels runs on caches that the weights
stream has just flushed: ~250 us a layer here, a quarter of a batch-32 step. The fused call
runs the same kernels in the same order inside one OpenMP region, so its output is the
op-by-op output bit for bit."""

import ctypes
from collections.abc import Sequence
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
_ROWS = 7  # the row count's place among tk_decode_layers_bf16's arguments


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
    _check(status, tp, max_positions, embed)
    return out


def _check(status: int, tp, max_positions: int, embed: DecodeEmbed | None) -> None:
    """tk_decode_layers_bf16's status as the exception it means (none for 0)."""
    if status == -3:
        raise RuntimeError(f"decode layers: {failure(tp)}")
    if status == -4:
        raise IndexError(f"decode layers: a position outside [0, {max_positions}) (rotary tables)")
    if status == -5:
        raise IndexError(f"decode layers: a token id outside the embedding's {embed.vocab} rows")
    if status != 0:
        raise MemoryError("decode layers: no memory for their activations")


def int_array(t: torch.Tensor) -> ctypes.Array:
    """A contiguous CPU int64 or int32 tensor's memory as a ctypes array (which keeps it
    alive): a step's rows written (a[:n] = ints) and read (a[:n]) with no torch or numpy
    call, whose code costs ~30 us a step on the caches the weights' stream has flushed."""
    kinds = {torch.int64: ctypes.c_int64, torch.int32: ctypes.c_int32}
    if t.dtype not in kinds or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"int_array: expected a contiguous CPU int64 or int32 tensor, got {t}")
    return (kinds[t.dtype] * t.numel()).from_buffer(t.numpy())


class DecodeCall:
    """decode_layers for steps whose inputs sit in tensors allocated once and rewritten in
    place (the engine's persistent decode inputs, shared/engine/decode_inputs.py): every
    argument is checked and converted once, and a step passes only its row count T; its rows
    are the first T of each tensor. The whole model on one rank: the first layer's input is
    the embedding rows of `ids`, and the call runs on through the final norm and the LM head
    into `logits` (R, V) and, on greedy steps, their argmax into `tokens` (R,).

    Per step, decode_layers checks its tensors and builds ~20 ctypes arguments in Python that
    runs on caches the weights' stream has just flushed: ~50 us of a ~3.8 ms batch-1 step."""

    def __init__(
        self,
        specs: ctypes.Array,
        embedding: torch.Tensor,  # (V, H) bf16
        ids: torch.Tensor,  # (R,) int64
        positions: torch.Tensor,  # (R,) int64
        pools: tuple[ctypes.Array, ctypes.Array],
        masks: list[StepMask],  # each over (R,) slots and context lengths, a table of R rows
        page_size: int,
        final_norm: tuple[torch.Tensor, float],
        head: torch.Tensor,  # (V, H) bf16
        rope_cs: torch.Tensor | None = None,  # (R, hd) float32
        temperature: torch.Tensor | None = None,  # (R,) float32
        max_positions: int = 0,
    ):
        hidden, rows = specs[0].hidden, len(ids)
        self.residual = torch.empty(rows, hidden, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.residual)
        self.logits = torch.empty(rows, head.shape[0], dtype=torch.bfloat16)  # (R, V)
        self.tokens = torch.empty(rows, dtype=torch.int64)
        self.rows = rows
        if len(positions) != rows or positions.dtype != torch.int64:
            raise ValueError("decode call: positions must be int64, a row each of ids'")
        for name, t, shape in (("rope_cs", rope_cs, 2), ("temperature", temperature, 1)):
            if t is not None and not (
                t.dtype == torch.float32 and t.dim() == shape and len(t) == rows
                and t.is_contiguous()
            ):  # fmt: skip
                raise ValueError(f"decode call: {name} must be contiguous float32, a row each")
        if not 1 <= len(masks) <= MAX_MASKS:
            raise ValueError(f"decode call: {len(masks)} masks (1 to {MAX_MASKS})")
        norm, eps = final_norm
        if not (norm.dtype == torch.bfloat16 and norm.shape == (hidden,) and norm.is_contiguous()):
            raise ValueError("decode call: final_norm must be a contiguous bf16 (hidden,) weight")
        self._embed = Embedding(embedding, ids).spec(hidden)
        self._head = LMHead(head, None, self.logits, self.tokens).spec(rows, hidden)
        self._tokens = self._head.tokens
        self.masks = (StepMask * len(masks))(*masks)  # their table_stride: each step's
        self._max_positions = max_positions
        self._args = [  # tk_decode_layers_bf16's, its row count and threads set per step
            specs, len(specs), self.residual.data_ptr(), ctypes.byref(self._embed),
            self.residual.data_ptr(), True, self.out.data_ptr(), 0, positions.data_ptr(),
            max_positions, None if rope_cs is None else rope_cs.data_ptr(),
            None if temperature is None else temperature.data_ptr(), pools[0], pools[1],
            self.masks, len(masks), page_size, None, norm.data_ptr(), eps,
            ctypes.byref(self._head), 0,
        ]  # fmt: skip
        self._tensors = (ids, positions, rope_cs, temperature, embedding, head, norm)  # alive

    def __call__(self, num_rows: int, strides: Sequence[int], greedy: bool) -> None:
        """Runs the first num_rows rows, row t of mask i's table at strides[i] * t: fills
        logits[:num_rows] and, if greedy, tokens[:num_rows]. IndexError for a position or
        token id out of range."""
        if not 0 < num_rows <= self.rows:  # an int: len(a tensor) is a torch call
            raise ValueError(f"decode call: {num_rows} rows (1 to {self.rows})")
        for mask, stride in zip(self.masks, strides):
            mask.table_stride = stride
        self._head.m = num_rows
        self._head.tokens = self._tokens if greedy else None
        args = self._args
        args[_ROWS], args[-1] = num_rows, torch.get_num_threads()
        status = library.kernel("tk_decode_layers_bf16")(*args)
        _check(status, None, self._max_positions, self._embed)
