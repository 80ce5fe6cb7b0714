"""Llama family (Llama 2/3, Mistral, Qwen2, Qwen3 differ only in flags of ModelConfig):
qkv_bias (Qwen2), qk_norm (Qwen3), rope_scaling llama3, tied embeddings, and per layer its
attention mask (global, sliding window, chunked) and whether it applies RoPE."""

from collections.abc import Callable

import torch
from torch import nn

from kernels.cpu.decode_layer import Embedding, LMHead
from shared.kv.cache import KVCache
from shared.models.config import ModelConfig
from shared.models.layer_attention import CHUNKED, GLOBAL, SLIDING, LayerAttention
from shared.models.layers.activation import SiluAndMul
from shared.models.layers.attention import AttentionMetadata, PagedAttention
from shared.models.layers.attention_backend import AttentionBackend, select_backend
from shared.models.layers.decode_layer import FusedDecoder, layer_spec
from shared.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shared.models.layers.fused_call import FusedCall
from shared.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shared.models.layers.norm import RMSNorm
from shared.models.layers.rotary import RotaryEmbedding
from shared.parallel.group import SINGLE, TPGroup
from shared.parallel.pipeline import WHOLE_MODEL, PPStage


def qkv_heads(attn: nn.Module, x: torch.Tensor):
    """x (T, H) through attn.qkv_proj, split into q (T, nh, hd), k and v (T, nkv, hd)."""
    T = x.shape[0]
    q, k, v = attn.qkv_proj(x).split(attn.split, dim=-1)
    return (
        q.view(T, attn.num_heads, -1),
        k.view(T, attn.num_kv_heads, -1),
        v.view(T, attn.num_kv_heads, -1),
    )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: LayerAttention,
        rotary: RotaryEmbedding,
        dtype,
        tp: TPGroup,
        backend: AttentionBackend,
    ):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, dtype, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, False, dtype, tp)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = rotary if layer.rope else None  # NoPE layers (Llama 4) rotate nothing
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5, backend)
        self.split = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]

    def forward(self, positions, x, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = qkv_heads(self, x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, kv_layer, meta)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, -1))


class LlamaMLP(nn.Module):
    """SwiGLU; reduce=False: each TP rank's partial sum (see RowParallelLinear)."""

    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup, reduce: bool = True):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], False, dtype, tp
        )
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, dtype, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def fused_parts(self) -> dict:
        """What layer_spec takes of this MLP (the fused decoder's dense SwiGLU)."""
        return dict(gate_up=self.gate_up_proj, down=self.down_proj)


def dense_mlp(cfg: ModelConfig, index: int, dtype, tp: TPGroup) -> nn.Module:
    """Every layer's MLP in the dense families: LlamaForCausalLM.make_mlp by default."""
    return LlamaMLP(cfg, dtype, tp)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        rotary,
        dtype,
        tp: TPGroup,
        backend,
        mlp: nn.Module | None = None,  # (T, H) -> (T, H); None: the dense LlamaMLP
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        layer = cfg.layer_attention[index]
        self.self_attn = LlamaAttention(cfg, layer, rotary, dtype, tp, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, dtype, tp) if mlp is None else mlp

    def decode_spec(self):
        """This layer's part of a FusedDecoder, or None where it cannot run fused."""
        a, mlp = self.self_attn, self.mlp
        parts = getattr(mlp, "fused_parts", None)  # a dense SwiGLU or softmax-routed experts
        if parts is None:
            return None
        return layer_spec(
            input_norm=self.input_layernorm, qkv=a.qkv_proj, q_norm=a.q_norm, k_norm=a.k_norm,
            rotary=a.rotary, attn=a.attn, o=a.o_proj, post_norm=self.post_attention_layernorm,
            **parts(),
        )  # fmt: skip

    def forward(self, positions, x, residual, kv_layer, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_layer, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Module):
    """Placeholder for a layer owned by another pipeline stage (keeps global layer numbers)."""


class LlamaModel(nn.Module):
    """The decoder stack of a stage: embedding (first stage), its layers, the final norm (last
    stage). make_layer(i) builds decoder layer i: each family its own (Llama 4, DeepSeek-V3
    share this skeleton and its forward)."""

    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup, stage: PPStage, make_layer: Callable):
        super().__init__()
        self.stage = stage
        # only the first stage embeds and only the last one normalises: others hold neither
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
            if stage.is_first
            else None
        )
        self.layers = nn.ModuleList(
            make_layer(i) if stage.owns(i) else PPMissingLayer() for i in range(cfg.num_layers)
        )
        self.masks = [layer.mask for layer in cfg.layer_attention]  # each layer's metadata key
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype) if stage.is_last else None
        self.start = stage.start_layer
        self.end = cfg.num_layers if stage.end_layer is None else stage.end_layer
        self.fused: FusedDecoder | None = None  # see prepare_fused_decode
        # the most rows a fused step takes (0: never fused); steps of at most this many tokens
        # give their prompt tokens as decode rows (shared/engine/batch.py's prefills_as_rows)
        self.fused_rows = 0

    def prepare_fused_decode(self) -> None:
        """Once the weights are final: decode steps run all layers in one C call, where each
        layer can run there, attending globally, in a sliding window or in chunks (the call
        takes each distinct mask's tables: FusedDecoder.build)."""
        masks = self.masks[self.start : self.end]
        if any(m.kind not in (GLOBAL, SLIDING, CHUNKED) for m in masks):
            return
        parts = [self.layers[i].decode_spec() for i in range(self.start, self.end)]
        embed = self.embed_tokens  # its rows gathered in the call where it is whole, bf16
        whole = embed is not None and embed.tp.size == 1 and embed.weight.dtype == torch.bfloat16
        self.fused = FusedDecoder.build(parts, masks, embed.weight if whole else None)
        self.fused_rows = 0 if self.fused is None else self.fused.max_rows

    def forward(
        self, input_ids, positions, kv: KVCache, meta, hidden=None, residual=None, after_layer=None
    ):
        """First stage: input_ids (T,); later stages: hidden/residual (T, H) from the previous.
        meta: the step's StepMetadata, each layer reading its mask's part. after_layer(i) runs
        once layer i has written its KV (to stream it out; after the one call, fused)."""
        if self.stage.is_first:
            hidden, residual = self._embedded(input_ids, meta), None
        if isinstance(hidden, Embedding) or (
            self.fused is not None and self.fused.takes(hidden, meta)
        ):
            # the last stage's norm in the same call: as a module call of its own it ran on the
            # caches that the weights' stream had just flushed (~50 us of a ~4.5 ms step)
            norm = None if self.norm is None else (self.norm.weight, self.norm.eps)
            hidden, residual = self.fused(positions, hidden, residual, kv, meta, norm)
            if after_layer is not None:  # every layer's KV is written by now
                for i in range(self.start, self.end):
                    after_layer(i)
            return (hidden, residual) if norm is None else (hidden, None)
        for i in range(self.start, self.end):
            hidden, residual = self.layers[i](
                positions, hidden, residual, kv.layer(i - self.start), meta.of(self.masks[i])
            )
            if after_layer is not None:
                after_layer(i)
        return self._finish(hidden, residual)

    def decode_head(self, input_ids, positions, kv: KVCache, meta, hidden, residual, head) -> None:
        """The last stage's decode step on to its LM head in the fused call, for a step that
        the fused decoder `fits`: head (an LMHead) filled as forward, the final norm and the
        head would fill it op by op."""
        if self.stage.is_first:
            hidden, residual = self._embedded(input_ids), None
        self.fused(positions, hidden, residual, kv, meta, (self.norm.weight, self.norm.eps), head)

    def _embedded(self, input_ids, meta=None):
        """The first stage's layer input: the tokens' embedding rows, as an Embedding that the
        fused call gathers where its decoder holds the table (FusedDecoder.embedding) and takes
        the step (meta None: known to; saves a module call on flushed caches, ~35 us of a
        batch-1 step), else looked up here."""
        fused = self.fused
        if fused is not None and fused.embedding is not None:
            if meta is None or fused.fits(len(input_ids), meta):
                return Embedding(fused.embedding, input_ids)
        return self.embed_tokens(input_ids)

    def _finish(self, hidden, residual):
        """The last stage normalises; the others hand (hidden, residual) on."""
        if not self.stage.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, None


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our merged parameter piece, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    renamed_modules: dict[str, str] = {}  # checkpoint module name -> ours (loader.py)
    expert_params: dict[str, tuple[str, str]] = {}  # MoE families: see loader.py's _target
    make_mlp = staticmethod(dense_mlp)  # (cfg, index, dtype, tp) -> layer index's MLP

    def __init__(
        self,
        cfg: ModelConfig,
        dtype=torch.float32,
        tp: TPGroup = SINGLE,
        stage: PPStage = WHOLE_MODEL,
        attention: AttentionBackend | None = None,  # None: select_backend's for a CPU model
    ):
        super().__init__()
        self.config = cfg
        attention = attention or select_backend("cpu", dtype)
        self.model = LlamaModel(cfg, dtype, tp, stage, self.layer_maker(cfg, dtype, tp, attention))
        self.lm_head = None
        if stage.is_last:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, tp)
            if cfg.tie_word_embeddings and stage.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def layer_maker(self, cfg: ModelConfig, dtype, tp: TPGroup, attention) -> Callable:
        """index -> this family's decoder layer `index` (all sharing one rotary embedding)."""
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        return lambda i: LlamaDecoderLayer(
            cfg, i, rotary, dtype, tp, attention, self.make_mlp(cfg, i, dtype, tp)
        )

    def forward(
        self, input_ids, positions, kv: KVCache, meta, hidden=None, residual=None, after_layer=None
    ):
        return self.model(input_ids, positions, kv, meta, hidden, residual, after_layer)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) final hidden states of the sampled rows -> (N, vocab)."""
        return self.lm_head(hidden)

    def decode_call(self, kv: KVCache, rows: int, max_pages: int) -> FusedCall | None:
        """The whole model's decode steps in one C call over persistent inputs, for up to
        `rows` rows with tables up to `max_pages` wide (FusedCall); None where decode_logits
        could not take them: no fused decoder, the embedding or the head not whole on this
        rank or the head not on the C linear."""
        head, fused = self.lm_head, self.model.fused
        if head is None or head.tp.size > 1 or not getattr(head, "c_linear", False):
            return None
        if fused is None or fused.embedding is None or fused.tp is not None:
            return None
        norm = self.model.norm
        rows = min(rows, fused.max_rows)
        return FusedCall(fused, kv, rows, max_pages, (norm.weight, norm.eps), head.weight)

    def decode_logits(
        self, input_ids, positions, kv: KVCache, meta, rows, greedy: bool, hidden=None,
        residual=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # fmt: skip
        """A decode step of the last stage in one C call through the final norm, the LM head
        and, where greedy, the argmax: (logits (N, vocab) of the final hidden states' rows
        `rows` (N,) int64, their argmax (N,) or None), what forward then compute_logits and
        argmax give; None, with nothing computed, where that call does not take the step (no
        fused decoder, the head on several ranks or not on the C linear, a step it cannot
        run). On that call the ~0.2 ms of Python between the layers' call, the head and the
        sampler's argmax, on caches that the weights' stream has flushed, goes."""
        head, fused = self.lm_head, self.model.fused
        if head is None or head.tp.size > 1 or not getattr(head, "c_linear", False):
            return None
        if fused is None or not fused.fits(len(positions), meta):
            return None
        logits = torch.empty(len(rows), head.weight.shape[0], dtype=head.weight.dtype)
        tokens = torch.empty(len(rows), dtype=torch.int64) if greedy else None
        filled = LMHead(head.weight, rows, logits, tokens)
        self.model.decode_head(input_ids, positions, kv, meta, hidden, residual, filled)
        return logits, tokens
