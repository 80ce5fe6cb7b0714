"""Random-weight Llama-shaped model folders for benchmarks (fixed seed, safetensors)."""

from pathlib import Path

import torch


def save_random_llama(out: Path, fields: dict, dtype: torch.dtype, seed: int = 0) -> int:
    """Saves LlamaForCausalLM(LlamaConfig(**fields)) in `dtype` to `out`; returns weight bytes."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())
