"""Random-weight Llama-shaped model folders for benchmarks (fixed seed, safetensors): dense
Llama, a Mixtral-style mixture of experts (`model_type` "mixtral" in the fields) or a
Scout-shaped Llama 4 ("llama4_text")."""

from pathlib import Path

import torch

# Fields every benchmark model shares; each picks its size on top (llama_fields(...)).
_COMMON = dict(
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def llama_fields(
    vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, **extra
) -> dict:
    """LlamaConfig fields of a benchmark model."""
    sizes = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return {**_COMMON, **sizes, **extra}


def mixtral_fields(experts: int, top_k: int, **llama) -> dict:
    """MixtralConfig fields: llama_fields(...)'s, each expert of `intermediate` size."""
    return dict(
        llama_fields(**llama), model_type="mixtral", num_local_experts=experts,
        num_experts_per_tok=top_k,
    )  # fmt: skip


def llama4_fields(experts: int, chunk: int, **llama) -> dict:
    """Llama4TextConfig fields of a Scout-shaped model: every layer routes to `experts` (top
    1, sigmoid, the weight on the input) beside a shared expert, both of `intermediate` size;
    3 layers in 4 chunked (`chunk` tokens) with RoPE and L2-normed q and k, every 4th global
    NoPE with the query temperature (transformers' defaults, as Scout's config has them)."""
    fields = llama_fields(**llama)
    return dict(
        fields, model_type="llama4_text", num_local_experts=experts, num_experts_per_tok=1,
        interleave_moe_layer_step=1, intermediate_size_mlp=2 * fields["intermediate_size"],
        attention_chunk_size=chunk, head_dim=fields["hidden_size"] // fields["num_attention_heads"],
    )  # fmt: skip


def save_random_llama(out: Path, fields: dict, dtype: torch.dtype, seed: int = 0) -> int:
    """Saves a random model of `fields` (LlamaConfig's, or another model_type's) in `dtype` to
    `out`; returns weight bytes."""
    import transformers

    torch.manual_seed(seed)
    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() * p.element_size() for p in model.parameters())
