"""DeepSeek-V3 and Kimi K2 / K2.5 (text), as transformers' modeling_deepseek_v3 computes them.

What differs from Llama (llama.py, whose skeleton, decoder-layer and forward passes these
classes share):
- attention is multi-head latent attention (layers/latent_attention.py): q through a low-rank
  pair (q_a_proj -> RMSNorm -> q_b_proj, or one q_proj when q_lora_rank is null), K and V from
  one latent per token (kv_a_proj_with_mqa -> kv_a_layernorm), a RoPE part shared by the heads,
  rotated on interleaved pairs with YaRN scaling; the KV cache holds latent + RoPE part only;
- the layers from first_k_dense_replace on route each token (grouped_topk: sigmoid scores with
  a correction bias, experts in groups, weights times routed_scaling_factor) beside shared
  experts; the first layers are a dense MLP;
- checkpoints may hold the multi-token-prediction layers (num_nextn_predict_layers, numbered
  from num_hidden_layers): skipped, as transformers does. Kimi K2.5's
  (KimiK25ForConditionalGeneration) nest the text model under `language_model.`; its vision
  tower and projector are skipped, never loaded."""

import re
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from shared.models.config import ModelConfig
from shared.models.layers.attention import AttentionMetadata
from shared.models.layers.latent_attention import LatentAttention, LatentUpProjection
from shared.models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from shared.models.layers.moe import DOWN, GATE, GATE_UP, UP, FusedMoE, grouped_topk
from shared.models.layers.norm import RMSNorm
from shared.models.layers.rotary import (
    InterleavedRotaryEmbedding,
    rope_attention_factor,
    yarn_mscale,
)
from shared.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from shared.parallel.group import TPGroup

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not the config's
_NOT_TEXT = ("vision_tower.", "mm_projector.", "multi_modal_projector.")  # Kimi K2.5
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = cfg.mla.qk_head_dim**-0.5
    s = cfg.rope_scaling or {}
    if s.get("mscale_all_dim"):
        scale *= yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
    return scale


class DeepseekV3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary, dtype, tp: TPGroup):
        super().__init__()
        m, hidden = cfg.mla, cfg.hidden_size
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")  # this rank's
        q_out = cfg.num_heads * m.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None  # one q path
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, dtype, tp)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, cfg.qkv_bias, dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, q_out, False, dtype, tp)
        self.split = [m.kv_lora_rank, m.qk_rope_head_dim]
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, sum(self.split), cfg.qkv_bias, dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(
            cfg.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank, dtype, tp
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * m.v_head_dim, hidden, cfg.qkv_bias, dtype, tp
        )
        self.rotary = rotary
        self.attn = LatentAttention(
            m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, softmax_scale(cfg)
        )

    def forward(self, positions, x, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.num_heads, -1)  # (T, nh, Dn + Dr)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(self.split, dim=-1)
        latent = self.kv_a_layernorm(latent)  # (T, R)
        q_nope, q_rope = q.split([self.attn.nope_dim, self.attn.rope_dim], dim=-1)
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope[:, None, :])
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = self.attn(q, latent, k_rope[:, 0], kv_layer, meta, self.kv_b_proj)  # (T, nh, Dv)
        return self.o_proj(out.reshape(T, -1))


class GroupedTopKRouter(nn.Module):
    """The router `gate`: logits of x in float32 (its weight kept float32, as transformers
    keeps it), then grouped_topk with the learnt correction bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        shape = (cfg.num_experts, cfg.hidden_size)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_experts), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> (weights (T, k) float32, expert ids (T, k))."""
        c = self.cfg
        logits = x.float() @ self.weight.t()  # (T, E)
        return grouped_topk(
            logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )  # fmt: skip


class DeepseekV3MoE(nn.Module):
    """Routed experts plus the shared experts (one SwiGLU), summed. (T, H) -> (T, H). Under TP
    both leave partial sums that one all-reduce adds (the routed experts' own under --ep)."""

    def __init__(self, cfg: ModelConfig, dtype, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = GroupedTopKRouter(cfg)
        self.experts = FusedMoE(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
            dtype, tp, reduce=False,
        )  # fmt: skip
        self.shared_experts = None
        if cfg.shared_expert_intermediate_size:
            shared = replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_experts = LlamaMLP(shared, dtype, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts.forward_routed(x, *self.gate(x))
        whole = self.experts.ep is not None  # the routed sum arrives whole from its ranks
        if self.shared_experts is None:
            return routed if whole else self.tp.all_reduce(routed)
        shared = self.shared_experts(x)
        return self.tp.all_reduce(shared) + routed if whole else self.tp.all_reduce(routed + shared)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer's forward over MLA and DeepSeek's MoE (or dense MLP)."""

    def __init__(self, cfg: ModelConfig, index: int, rotary, dtype, tp: TPGroup):
        nn.Module.__init__(self)  # Llama's parts are not these: only its forward is shared
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekV3Attention(cfg, rotary, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        moe = cfg.moe_layers and cfg.moe_layers[index]
        self.mlp = DeepseekV3MoE(cfg, dtype, tp) if moe else LlamaMLP(cfg, dtype, tp)

    def decode_spec(self):
        return None  # decode_layer.c has no latent attention


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepseekV3ForCausalLM checkpoints (DeepSeek-V3, Kimi K2) and KimiK25ForConditionalGeneration
    ones (text only)."""

    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    # experts.{e}.X (one expert, as checkpoints store them) or experts.X (all, transformers 5)
    expert_params = {
        "gate_proj": ("w13", GATE),
        "up_proj": ("w13", UP),
        "down_proj": ("w2", DOWN),
        "gate_up_proj": ("w13", GATE_UP),
    }

    def layer_maker(self, cfg: ModelConfig, dtype, tp: TPGroup, attention) -> Callable:
        """attention: unused (MLA attends in torch, layers/latent_attention.py)."""
        m = cfg.mla
        if m is None:
            raise ValueError(f"{cfg.architecture} needs an MLA config (kv_lora_rank, ...)")
        rotary = InterleavedRotaryEmbedding(
            m.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, m.rope_interleave,
            rope_attention_factor(cfg.rope_scaling),
        )  # fmt: skip
        return lambda i: DeepseekV3DecoderLayer(cfg, i, rotary, dtype, tp)

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model; None for the multi-token-prediction
        layers and Kimi K2.5's vision tower and projector."""
        if name.startswith(_NOT_TEXT):
            return None
        name = name.removeprefix("language_model.")
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.config.num_layers:
            return None
        return name
