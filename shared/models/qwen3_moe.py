"""Qwen3-MoE: Qwen3 (Llama with q/k RMSNorm) whose MLPs are routed experts (softmax top k,
renormalised iff norm_topk_prob), except the dense layers config.json names (mlp_only_layers,
decoder_sparse_step: ModelConfig.moe_layers)."""

from torch import nn

from shared.models.config import ModelConfig
from shared.models.layers.moe import DOWN, GATE, GATE_UP, UP, MoEMLP
from shared.models.llama import LlamaForCausalLM, dense_mlp
from shared.parallel.group import TPGroup


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    # experts.{e}.X (one expert) or experts.X (all, as transformers holds them) -> FusedMoE's
    expert_params = {
        "gate_proj": ("w13", GATE),
        "up_proj": ("w13", UP),
        "down_proj": ("w2", DOWN),
        "gate_up_proj": ("w13", GATE_UP),
    }

    @staticmethod
    def make_mlp(cfg: ModelConfig, index: int, dtype, tp: TPGroup) -> nn.Module:
        if not cfg.moe_layers[index]:
            return dense_mlp(cfg, index, dtype, tp)
        return MoEMLP(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
            cfg.moe_intermediate_size, cfg.norm_topk_prob, dtype, tp,
        )  # fmt: skip
