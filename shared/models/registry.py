"""Model families by Hugging Face architecture name (config.json `architectures[0]`)."""

import importlib

from shared.errors import UnsupportedArchitectureError

# architecture -> "module:class". Mistral and the Qwens are Llama with flags from ModelConfig.
_MODELS = {
    "LlamaForCausalLM": "shared.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "shared.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "shared.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "shared.models.llama:LlamaForCausalLM",
    "MixtralForCausalLM": "shared.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "shared.models.qwen3_moe:Qwen3MoeForCausalLM",
    # Llama 4: the multimodal checkpoints are served text-only (their text_config)
    "Llama4ForCausalLM": "shared.models.llama4:Llama4ForCausalLM",
    "Llama4ForConditionalGeneration": "shared.models.llama4:Llama4ForCausalLM",
    # DeepSeek-V3 and Kimi K2 (MLA + grouped-routing MoE); Kimi K2.5 served text-only
    "DeepseekV3ForCausalLM": "shared.models.deepseek_v3:DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": "shared.models.deepseek_v3:DeepseekV3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise UnsupportedArchitectureError(architecture, supported_architectures())
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)
