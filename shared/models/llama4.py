"""Llama 4 text models (Scout, Maverick), as transformers' modeling_llama4 computes them, served
text-only from Llama4ForCausalLM and Llama4ForConditionalGeneration checkpoints (the latter's
vision tower and projector are skipped, never loaded).

What differs from Llama (llama.py, whose skeleton and forward passes these classes share):
- RoPE layers rotate interleaved pairs (complex numbers), attend within their chunk
  (`attention_chunk_size`) and, with `use_qk_norm`, L2-normalise q and k AFTER the rotation;
- NoPE layers (`no_rope_layers`) attend globally and, with `attn_temperature_tuning`, scale q
  by log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 at position p;
- the layers in `moe_layers` route each token to experts (sigmoid top-k weight on the expert's
  input) beside a shared expert; the others are a dense MLP of `intermediate_size_mlp`.
Per-layer masks come from layer_attention.py. Decode steps of bf16 models on the C kernels run
all layers in the fused decoder's one call (layers/decode_layer.py), as the other families."""

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from kernels.cpu import library
from kernels.cpu.norm import rms_norm
from shared.models.config import ModelConfig
from shared.models.layer_attention import LayerAttention
from shared.models.layers.attention import AttentionMetadata, PagedAttention
from shared.models.layers.attention_backend import AttentionBackend
from shared.models.layers.decode_layer import layer_spec
from shared.models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from shared.models.layers.moe import DOWN_T, GATE_UP_T, SIGMOID, FusedMoE
from shared.models.layers.norm import RMSNorm
from shared.models.layers.rotary import InterleavedRotaryEmbedding, QueryTemperature
from shared.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, qkv_heads
from shared.parallel.group import TPGroup

# checkpoint name prefixes of Llama4ForConditionalGeneration's non-text parts
_NOT_TEXT = ("vision_model.", "multi_modal_projector.")


class L2Norm(nn.Module):
    """x / rms(x) over the last dim, no weight; statistics in float32 as transformers'
    Llama4TextL2Norm. On the C kernels: their RMSNorm with a weight of ones (1 * x rounds to
    x), which the fused decoder runs too, so both give the same bits."""

    def __init__(self, size: int, eps: float, dtype):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(size, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if library.usable(x):
            return rms_norm(x, self.weight, self.eps)
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: LayerAttention,
        rotary: InterleavedRotaryEmbedding,
        dtype,
        tp: TPGroup,
        backend: AttentionBackend,
    ):
        super().__init__()
        hd, l4 = cfg.head_dim, cfg.llama4
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, hd, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, dtype, tp
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_heads * hd, cfg.hidden_size, cfg.qkv_bias, dtype, tp
        )
        self.rotary = rotary if layer.rope else None
        # transformers gives only RoPE layers the L2 norm and only NoPE ones the temperature
        l2 = l4.use_qk_norm and layer.rope
        self.qk_norm = L2Norm(hd, cfg.rms_norm_eps, dtype) if l2 else None
        tuned = l4.attn_temperature_tuning and not layer.rope
        self.temperature = QueryTemperature(l4.floor_scale, l4.attn_scale) if tuned else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, hd, hd**-0.5, backend)
        self.split = [self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd]

    def forward(self, positions, x, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = qkv_heads(self, x)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q), self.qk_norm(k)
        if self.temperature is not None:
            q = (q * self.temperature(positions)).to(q.dtype)
        out = self.attn(q, k, v, kv_layer, meta)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, -1))


class Llama4MoE(nn.Module):
    """Routed experts (sigmoid top-k, the weight on the expert's input) plus a shared expert
    (a dense SwiGLU of intermediate_size), summed. (T, H) -> (T, H). Under TP both leave
    partial sums and one all-reduce adds them (the routed experts' own under --ep)."""

    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, False, dtype)
        self.experts = FusedMoE(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
            dtype, tp, scoring=SIGMOID, renormalize=False, apply_weights_on_input=True,
            reduce=False,
        )  # fmt: skip
        shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared, dtype, tp, reduce=False)

    def fused_parts(self) -> dict:
        """What layer_spec takes of this MLP (moe.c's sigmoid routing, then the shared expert)."""
        return dict(router=self.router, experts=self.experts, shared=self.shared_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared, routed = self.shared_expert(x), self.experts(x, self.router(x))
        if self.experts.ep is not None:  # the routed sum arrives whole from its ranks
            return self.tp.all_reduce(shared) + routed
        return self.tp.all_reduce(shared + routed)


class Llama4DecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer's forward over Llama 4's attention and feed-forward (`mlp` here is the
    checkpoint's `feed_forward`: a dense MLP, or experts in the MoE layers)."""

    def __init__(self, cfg: ModelConfig, index: int, rotary, dtype, tp: TPGroup, backend):
        nn.Module.__init__(self)  # Llama's parts are not these: only its forward is shared
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        layer = cfg.layer_attention[index]
        self.self_attn = Llama4Attention(cfg, layer, rotary, dtype, tp, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.moe_layers and cfg.moe_layers[index]:
            self.mlp = Llama4MoE(cfg, dtype, tp)
        else:  # dense layers are wider than the shared expert
            dense = replace(cfg, intermediate_size=cfg.llama4.intermediate_size_mlp)
            self.mlp = LlamaMLP(dense, dtype, tp)

    def decode_spec(self):
        """This layer's part of a FusedDecoder (its L2 norms after the rotation, the NoPE
        layers' temperature), or None where it cannot run fused."""
        a, parts = self.self_attn, getattr(self.mlp, "fused_parts", None)
        if parts is None:
            return None
        return layer_spec(
            input_norm=self.input_layernorm, qkv=a.qkv_proj, q_norm=a.qk_norm, k_norm=a.qk_norm,
            rotary=a.rotary, attn=a.attn, o=a.o_proj, post_norm=self.post_attention_layernorm,
            norm_after_rope=True, temperature=a.temperature,
            **parts(),
        )  # fmt: skip


class Llama4ForCausalLM(LlamaForCausalLM):
    """Llama4ForCausalLM and Llama4ForConditionalGeneration checkpoints (text only)."""

    # Llama's, and the experts' stacked tensors as Llama 4 stores them (transposed: gate_up
    # (E, H, 2I), down (E, I, H)), under the names checkpoint_name gives them
    stacked_params = {
        **LlamaForCausalLM.stacked_params,
        "w13": ("w13", (None, GATE_UP_T)),
        "w2": ("w2", (None, DOWN_T)),
    }

    def layer_maker(self, cfg: ModelConfig, dtype, tp: TPGroup, attention) -> Callable:
        if cfg.llama4 is None:
            raise ValueError(f"{cfg.architecture} needs a llama4 config (model_type llama4*)")
        rotary = InterleavedRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return lambda i: Llama4DecoderLayer(cfg, i, rotary, dtype, tp, attention)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model; None for the vision tower's and projector's
        (a Llama4ForConditionalGeneration nests the text model under `language_model.`)."""
        if name.startswith(_NOT_TEXT):
            return None
        name = name.removeprefix("language_model.").replace(".feed_forward.", ".mlp.")
        return name.replace(".experts.gate_up_proj", ".experts.w13").replace(
            ".experts.down_proj", ".experts.w2"
        )
