"""A stage's decoder layers, for decode steps, in one C call (kernels/cpu/decode_layer.py), on
every CPU tier. It takes steps whose rows all decode, bfloat16, linears on the C linear
(kernels/cpu/linear.py), on one tensor-parallel rank or on several whose group all-reduces
through shared memory (the C all-reduce then runs inside the call, where the op-by-op layers
all-reduce); layers may attend with different masks (global, sliding, chunked; each page group
of capped chunked layers counts as one: up to MAX_MASKS), each layer on its own view of the
pool; RoPE by tables, on interleaved pairs (Llama 4) or none (NoPE, with or without Llama 4's
query temperature); an MLP is dense or routed experts with softmax top-k (Mixtral, Qwen3-MoE)
or Llama 4's sigmoid top-1 beside a shared expert (not expert parallelism); everything else
stays op by op."""

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import decode_layer as c
from kernels.cpu.decode_layer import (
    MAX_MASKS,
    DecodeLayerSpec,
    Embedding,
    LMHead,
    decode_layers,
    step_mask,
)
from kernels.cpu.linear import linear_max_rows
from shared.kv.cache import KVCache
from shared.models.layer_attention import AttentionMask
from shared.models.layers.attention import StepMetadata
from shared.models.layers.moe import SIGMOID, SOFTMAX
from shared.models.layers.rotary import (
    InterleavedRotaryEmbedding,
    QueryTemperature,
    RotaryEmbedding,
)
from shared.parallel.group import TPGroup


def _experts_fit(experts) -> bool:
    """Whether decode_layer.c runs these FusedMoE experts: on the C linear, each rank all
    experts (no expert parallelism), softmax routing with each output weighted, or sigmoid
    top-1 with the weight on the input (Llama 4)."""
    softmax = experts.scoring == SOFTMAX and not experts.apply_weights_on_input
    sigmoid = experts.scoring == SIGMOID and experts.apply_weights_on_input
    return (
        experts.c_linear
        and experts.ep is None
        and (softmax or sigmoid)
        and experts.w13.is_contiguous()
        and experts.w2.is_contiguous()
    )


def _tp_group(modules, o, mlp_reduces: bool) -> "TPGroup | None | bool":
    """The tensor-parallel group a layer's modules split over: None for one rank; False where
    the fused call cannot all-reduce for them: several groups, a group without shared memory,
    or partial sums not all-reduced where decode_layer.c does (o's output, the MLP's)."""
    groups = {id(g): g for m in modules if (g := getattr(m, "tp", None)) is not None}
    groups = [g for g in groups.values() if g.size > 1]
    if not groups:
        return None
    if len(groups) > 1 or groups[0].shm is None or not (o.reduce and mlp_reduces):
        return False
    return groups[0]


def _rope_kind(rotary) -> int | None:
    """decode_layer.c's ROPE_* for a layer's rotary embedding (None: one it lacks)."""
    if rotary is None:
        return c.ROPE_NONE
    if isinstance(rotary, RotaryEmbedding):
        return c.ROPE_TABLES
    if isinstance(rotary, InterleavedRotaryEmbedding) and rotary.interleaved:
        return c.ROPE_PAIRS
    return None


@dataclass
class LayerPart:
    """One layer's part of a FusedDecoder: its spec, the tensors the spec points into, and
    what the step must give it: its rotary embedding (tables to check, or pairs' cos/sin to
    compute), its query temperature (Llama 4's NoPE layers) or None, and the tensor-parallel
    group it all-reduces over (None: one rank)."""

    spec: DecodeLayerSpec
    tensors: list[torch.Tensor]
    rotary: RotaryEmbedding | InterleavedRotaryEmbedding | None
    temperature: QueryTemperature | None = None
    tp: TPGroup | None = None


def layer_spec(
    *, input_norm, qkv, q_norm, k_norm, rotary, attn, o, post_norm,
    gate_up=None, down=None, router=None, experts=None, shared=None,
    norm_after_rope=False, temperature=None,
) -> LayerPart | None:  # fmt: skip
    """One decoder layer's part, or None where the fused call cannot run it (a linear not on
    the C linear, tensor-parallel ranks it cannot all-reduce for, an unsupported head shape,
    rotation or routing). rotary: tables, interleaved pairs or None (NoPE); q_norm and k_norm
    (modules with weight and eps) before the rotation, or after with norm_after_rope (Llama
    4's L2 norms, weights of ones); temperature: NoPE layers' factor on q. Its MLP: gate_up and
    down (dense), or router (H -> E) and experts (a FusedMoE), beside `shared` (a dense MLP
    with gate_up_proj and down_proj) or not: under TP then both leave partial sums whose sum
    the layer all-reduces (Llama 4's)."""
    moe = experts is not None
    linears = (qkv, o, router) if moe else (qkv, o, gate_up, down)
    if shared is None:
        mlp_reduces = experts.reduce if moe else down.reduce
    else:
        linears += (shared.gate_up_proj, shared.down_proj)
        mlp_reduces = not (experts.reduce or shared.down_proj.reduce)
    rope = _rope_kind(rotary)
    tp = _tp_group(linears + ((experts,) if moe else ()), o, mlp_reduces)
    if (moe and not _experts_fit(experts)) or rope is None or tp is False:
        return None
    if temperature is not None and rope != c.ROPE_NONE:  # decode_layer.c: NoPE layers only
        return None
    if not (
        all(getattr(m, "c_linear", False) for m in linears)
        and all(getattr(m, "bias", None) is None for m in linears if m is not qkv)
        and attn.kernel_ok
        and input_norm.weight.dtype == torch.bfloat16
    ):
        return None
    tables = rope == c.ROPE_TABLES
    tensors = [
        input_norm.weight, qkv.weight, qkv.bias, None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight, o.weight, post_norm.weight,
        None if moe else gate_up.weight, None if moe else down.weight,
        rotary.cos if tables else None, rotary.sin if tables else None,
        router.weight if moe else None, experts.w13 if moe else None,
        experts.w2 if moe else None, None if shared is None else shared.gate_up_proj.weight,
        None if shared is None else shared.down_proj.weight,
    ]  # fmt: skip
    if any(t is not None and not t.is_contiguous() for t in tensors):
        return None
    routing = (0,) * 4
    if moe:
        scoring = c.ROUTE_SIGMOID if experts.scoring == SIGMOID else c.ROUTE_SOFTMAX
        routing = (experts.num_experts, experts.top_k, scoring, int(experts.renormalize))
    spec = DecodeLayerSpec(
        *(None if t is None else t.data_ptr() for t in tensors),
        input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim,
        experts.w2.shape[2] if moe else down.weight.shape[1],
        0 if shared is None else shared.down_proj.weight.shape[1], *routing,
        0, rope, int(norm_after_rope), int(temperature is not None),
        input_norm.eps, input_norm.eps if q_norm is None else q_norm.eps, attn.scale,
    )  # fmt: skip
    tensors = [t for t in tensors if t is not None]
    return LayerPart(spec, tensors, rotary, temperature, tp)


class FusedDecoder:
    """A stage's decoder layers, for decode steps: their specs, in order, the masks they attend
    with (spec.mask indexes `masks`), and the tensors the specs point into (kept alive)."""

    def __init__(
        self,
        parts: list[LayerPart],
        masks: list[AttentionMask],
        embedding: torch.Tensor | None = None,
    ):
        """parts: each layer's (as `build` checks they fit one call), masks: each layer's;
        embedding: the first stage's whole table (V, H) bf16, whose rows the call gathers
        (an Embedding input), or None."""
        self.specs = (DecodeLayerSpec * len(parts))(*(part.spec for part in parts))
        self.masks = list(dict.fromkeys(masks))  # distinct, in layer order
        for spec, mask in zip(self.specs, masks):
            spec.mask = self.masks.index(mask)
        self._tensors = [t for part in parts for t in part.tensors]
        rotaries = {id(p.rotary): p.rotary for p in parts if p.rotary is not None}.values()
        tables = [r for r in rotaries if isinstance(r, RotaryEmbedding)]
        # the C call checks each position against the tables (0: no layer reads one)
        self.max_positions = min((len(r.cos) for r in tables), default=0)
        self.pairs = next((r for r in rotaries if isinstance(r, InterleavedRotaryEmbedding)), None)
        # the NoPE layers' factor: one function of the position for all (one model config)
        self.temperature = next((p.temperature for p in parts if p.temperature), None)
        self.tp = next((p.tp for p in parts), None)  # every layer's (build checks); None: one rank
        self.max_rows = self._max_rows()
        self.embedding = embedding
        self._pools: tuple = ()  # (the KV cache, its layers' K and V pool addresses)

    @classmethod
    def build(
        cls, parts: list, masks: list[AttentionMask], embedding: torch.Tensor | None = None
    ) -> "FusedDecoder | None":
        """A FusedDecoder of these layers (each layer's part, or None, and mask), or None where
        one call cannot take them: a layer that cannot run fused, more than MAX_MASKS masks,
        layers of different tensor-parallel groups, or interleaved RoPE of more than one
        embedding (the step gives one cos/sin)."""
        if not parts or any(part is None for part in parts) or len(set(masks)) > MAX_MASKS:
            return None
        if len({id(part.tp) for part in parts}) > 1:
            return None
        pairs = {id(p.rotary) for p in parts if isinstance(p.rotary, InterleavedRotaryEmbedding)}
        return cls(parts, masks, embedding) if len(pairs) <= 1 else None

    def _max_rows(self) -> int:
        """The most rows a fused step takes: the C linear's (which beats F.linear up to there),
        and under TP as many as an all-reduce's slot holds."""
        rows = linear_max_rows()
        if self.tp is not None:
            rows = min(rows, self.tp.shm.c.slot_bytes // (self.specs[0].hidden * 2))
        return rows

    def takes(self, x: torch.Tensor, meta: StepMetadata) -> bool:
        """Whether this step, of input x (T, H), can run fused (x bf16 and `fits`)."""
        return x.dtype == torch.bfloat16 and self.fits(x.shape[0], meta)

    def fits(self, num_rows: int, meta: StepMetadata) -> bool:
        """Whether a step of num_rows rows can run fused: every row decodes (a prompt's tokens
        too, as shared/engine/batch.py's prefills_as_rows makes them), in order, with each
        mask's keys from a page's start, few enough rows."""
        if num_rows > self.max_rows:
            return False
        for mask in self.masks:
            m = meta.of(mask)
            d = m.decode
            if d is None or d.rows is not None or m.prefills or d.first_key is not None:
                return False
        return True

    def __call__(
        self,
        positions,
        x: torch.Tensor | Embedding,
        residual: torch.Tensor | None,
        kv: KVCache,
        meta,
        final_norm: tuple[torch.Tensor, float] | None = None,
        head: LMHead | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the layers op by op: x (T, H), residual (T, H) or None (first layer) ->
        (last layer's output, residual), residual updated in place (x itself when None).
        x an Embedding (first layer): its rows, gathered inside the call into a new residual.
        final_norm (weight, eps): the last stage's RMSNorm too, and head its LM head after it
        (decode_layers')."""
        metas = [meta.of(mask) for mask in self.masks]
        masks = [
            step_mask(m.slot_mapping, m.decode.block_table, m.decode.context_lens, m.decode.window)
            for m in metas
        ]
        cs = None if self.pairs is None else self.pairs.cos_sin_rows(positions)
        temperature = None if self.temperature is None else self.temperature(positions).flatten()
        first = residual is None
        if first:
            if isinstance(x, Embedding):  # (T, H), filled by the call
                residual = torch.empty(len(x.ids), x.weight.shape[1], dtype=x.weight.dtype)
            else:
                residual = x
        out = decode_layers(
            self.specs, x, residual, first, positions, self.pools_of(kv), masks,
            metas[0].decode.page_size, cs, temperature, None if self.tp is None else self.tp.shm.c,
            final_norm, head, self.max_positions,
        )  # fmt: skip
        return out, residual

    def pools_of(self, kv) -> tuple[ctypes.Array, ctypes.Array]:
        """Each layer's K and V pool addresses in kv (its layer(i) views), kept per pool."""
        if not self._pools or self._pools[0] is not kv:
            layers = [kv.layer(i) for i in range(len(self.specs))]  # (2, P, S, nkv, hd) each
            addresses = tuple(
                (ctypes.c_void_p * len(layers))(*(layer[j].data_ptr() for layer in layers))
                for j in (0, 1)
            )
            self._pools = (kv, addresses)
        return self._pools[1]
