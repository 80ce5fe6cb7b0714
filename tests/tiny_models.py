"""Tiny model folders built in tests: a BPE tokenizer trained on a fixed corpus and a
random-initialised Hugging Face model of each family, saved as safetensors. Fixed seeds: each
family's is its position in FAMILIES (so add new families at the end), so that no two families
share weights (mistral without a sliding window would otherwise be llama, byte for byte)."""

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Über naïve café — 東京 and ünïcödé ✓ 🙂.",
    "import os\nimport sys\nfor i in range(10):\n    print(i, os.path.join('a', 'b'))\n",
    "Once upon a time there was a tiny language model that served tokens all day long.",
] * 20
VOCAB_SIZE = 384

FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
        rope_theta=500000.0,
    ),
    "llama_tied": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),
    # --- mixture of experts: Mixtral (top 2 renormalised), Qwen3-MoE (layer 1 dense) ---
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
}

# --- Llama 4 (text): every quirk at test lengths (prompts of up to 60 tokens + 32 new) ---
LLAMA4 = dict(
    architectures=["Llama4ForCausalLM"],
    model_type="llama4_text",
    num_hidden_layers=4,
    no_rope_layers=[1, 1, 0, 1],  # layer 2: NoPE (global); the others RoPE (chunked)
    attention_chunk_size=8,  # most prompts cross several chunk boundaries
    use_qk_norm=True,
    attn_temperature_tuning=True,
    floor_scale=4,  # q of NoPE layers x 1.0 .. 1.32 over positions 0 .. 92
    attn_scale=0.1,
    intermediate_size=96,  # the MoE layers' experts and shared expert
    intermediate_size_mlp=128,  # the dense layers
    moe_layers=[],  # all dense: "llama4_moe" has the experts
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
FAMILIES["llama4"] = LLAMA4
# layers 1 and 3 (interleave step 2) route to 4 experts, top-1, beside a shared expert
# (attn_scale 0.12: at 0.1 the reference meets a near-tie on one of make_prompts()'s prompts)
FAMILIES["llama4_moe"] = dict(
    LLAMA4, moe_layers=None, interleave_moe_layer_step=2, num_local_experts=4, attn_scale=0.12
)
# --- DeepSeek-V3 (MLA + grouped routing): every quirk at test sizes --------------------------
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    num_hidden_layers=3,
    num_key_value_heads=4,  # = num_attention_heads, as the real configs (MLA has no KV heads)
    first_k_dense_replace=1,  # layer 0 dense, layers 1-2 routed
    n_routed_experts=8,
    n_group=4,  # 4 groups of 2 experts, the best 2 groups kept
    topk_group=2,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,  # != qk_nope_head_dim: no shape may assume they agree
    # YaRN over an original context of 64: prompts + outputs (up to ~90 positions) exceed it;
    # mscale_all_dim != mscale: attention factor and softmax scale both != 1
    rope_scaling=dict(
        type="yarn",
        factor=4.0,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.8,
        original_max_position_embeddings=64,
    ),
    rope_theta=10000.0,
    num_nextn_predict_layers=0,
)
FAMILIES["deepseek_v3"] = DEEPSEEK_V3
# one q_proj; 2 groups of 4, the best kept, top 3 of its experts (at top 2 a prompt meets a
# routing tie within float32 rounding)
FAMILIES["deepseek_v3_no_q_lora"] = dict(
    DEEPSEEK_V3, q_lora_rank=None, n_group=2, topk_group=1, num_experts_per_tok=3
)
# ------------------------------------------------------------------------------------------


def build_tokenizer(out: Path) -> None:
    """Byte-level BPE tokenizer + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def hf_config(family: str, **overrides) -> dict:
    cfg = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.5,  # logits of std ~4; engine_helpers rejects references with near-ties
        torch_dtype="float32",
    )
    cfg.update(FAMILIES[family])
    cfg.update(overrides)
    return cfg


def build_model(out: Path, family: str = "llama", **overrides) -> Path:
    """Save a random-initialised HF model of `family` plus tokenizer into `out`."""
    import transformers

    out = Path(out)
    cfg_dict = hf_config(family, **overrides)
    config_cls = transformers.AutoConfig.for_model(cfg_dict.pop("model_type")).__class__
    config = config_cls(**cfg_dict)
    torch.manual_seed(list(FAMILIES).index(family))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    soften_attention(model, config.hidden_size)
    randomize_router_bias(model)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    build_tokenizer(out)
    return out


def soften_attention(model, hidden_size: int) -> None:
    """q and k projections at std hidden_size**-0.5: attention scores (over RMS-normed inputs)
    of std ~1, as in trained models. At initializer_range=0.5 they have std ~16: attention
    close to an argmax whose near-tied scores amplify float32 rounding: transformers' own cached
    and uncached forwards then differ by 1.1e-4 in logprobs (llama), against 1.7e-5 at std ~1."""
    config = model.config
    fan_in = {  # MLA's q/k projections (DeepSeek-V3) and its router: std 1 / sqrt(inputs)
        "q_b_proj.weight": getattr(config, "q_lora_rank", None),
        "kv_b_proj.weight": getattr(config, "kv_lora_rank", None),
        "kv_a_proj_with_mqa.weight": hidden_size,
        "mlp.gate.weight": hidden_size,
    }
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.normal_(0.0, hidden_size**-0.5)
            for suffix, inputs in fan_in.items():
                if name.endswith(suffix) and inputs:
                    weight.normal_(0.0, inputs**-0.5)


def randomize_router_bias(model) -> None:
    """DeepSeek-V3's e_score_correction_bias starts at zero in transformers; random here, so
    that the bias changes which experts are chosen (but not their weights)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)


def load_hf(model_dir: Path, dtype=torch.float32):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()
