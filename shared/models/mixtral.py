"""Mixtral: Llama's attention and decoder layers with routed experts as every layer's MLP
(softmax, top 2, renormalised). Checkpoints name the MLP block_sparse_moe and each expert's
gate, down and up projections w1, w2, w3."""

from shared.models.config import ModelConfig
from shared.models.layers.moe import DOWN, GATE, GATE_UP, UP, MoEMLP
from shared.models.llama import LlamaForCausalLM
from shared.parallel.group import TPGroup


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_modules = {"block_sparse_moe": "mlp"}
    # experts.{e}.X (one expert) or experts.X (all, as transformers holds them) -> FusedMoE's
    expert_params = {
        "w1": ("w13", GATE),
        "w3": ("w13", UP),
        "w2": ("w2", DOWN),
        "gate_up_proj": ("w13", GATE_UP),
        "down_proj": ("w2", DOWN),
    }

    @staticmethod
    def make_mlp(cfg: ModelConfig, index: int, dtype, tp: TPGroup) -> MoEMLP:
        return MoEMLP(
            cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
            cfg.moe_intermediate_size, True, dtype, tp,
        )  # fmt: skip
