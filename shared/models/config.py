"""ModelConfig: a Hugging Face config.json normalised once into the fields the engine reads."""

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelFolderError
from shared.models.layer_attention import LayerAttention, layers_from_hf


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a decoder-only model, read from config.json."""

    architecture: str  # architectures[0]: the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF rope_scaling (None, or with "rope_type")
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on each q and k head
    layer_attention: tuple[LayerAttention, ...]  # each layer's mask and RoPE, in layer order
    torch_dtype: str  # the checkpoint's stored dtype, e.g. "bfloat16"
    raw: dict  # the whole config.json, for family-specific fields
    llama4: "Llama4Fields | None" = None  # Llama 4 text models only (below)
    mla: "MLAFields | None" = None  # multi-head latent attention (DeepSeek-V3, Kimi K2) only

    # --- Mixture of experts (Mixtral, Qwen3-MoE, Llama 4): _moe_fields; num_experts 0: dense ---
    num_experts: int = 0  # routed experts of a MoE layer (num_local_experts / num_experts)
    num_experts_per_tok: int = 0  # the experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum 1 (Mixtral)
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or the dense MLP
    shared_expert_intermediate_size: int = 0  # an always-on shared expert's width; 0: none
    # grouped routing (DeepSeek-V3): experts in n_group groups, each token's top k taken
    # from its topk_group best groups; the routed weights times routed_scaling_factor
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelFolderError(str(path), "missing (a model folder needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFolderError(str(path), f"not valid JSON ({e})") from e
        if not isinstance(raw, dict):
            raise ModelFolderError(str(path), "must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        raw = dict(raw.get("text_config") or {}, **raw) if "text_config" in raw else raw

        def need(key: str):
            if key not in raw:
                raise ModelFolderError(source, f"missing field {key!r}")
            return raw[key]

        archs = raw.get("architectures") or []
        if not archs or not isinstance(archs, list):
            raise ModelFolderError(source, "missing field 'architectures'")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = raw.get("head_dim") or hidden // num_heads
        model_type = raw.get("model_type", "")
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        # transformers 5 keeps rope_theta in rope_parameters, also beside rope_type "default"
        rope_theta = raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        num_layers = int(need("num_hidden_layers"))
        cfg = cls(
            architecture=str(archs[0]),
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            layer_attention=layers_from_hf(raw, num_layers, source),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            raw=raw,
            **_moe_fields(raw, model_type, num_layers),
            llama4=Llama4Fields.from_raw(raw) if model_type.startswith("llama4") else None,
            mla=MLAFields.from_raw(raw, source) if "kv_lora_rank" in raw else None,
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelFolderError(
                source, "num_attention_heads must be a multiple of num_key_value_heads"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelFolderError(source, f"{name} must be positive")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelFolderError(source, "num_experts_per_tok must be in [1, num_experts]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ModelFolderError(source, "moe_intermediate_size must be positive")


def _moe_fields(raw: dict, model_type: str, num_layers: int) -> dict:
    """The MoE fields of a config.json with experts ({} without). Mixtral: every layer routes,
    to experts as wide as intermediate_size, the top k renormalised. Qwen3-MoE: experts of
    moe_intermediate_size, renormalised iff norm_topk_prob; layer i is dense where
    mlp_only_layers lists it or (i + 1) is not a multiple of decoder_sparse_step."""
    num_experts = int(
        raw.get("num_local_experts") or raw.get("num_experts") or raw.get("n_routed_experts") or 0
    )
    if not num_experts:
        return {}
    if model_type.startswith("llama4"):
        return _llama4_moe_fields(raw, num_experts, num_layers)
    if "n_routed_experts" in raw:
        return _deepseek_moe_fields(raw, num_experts, num_layers)
    mixtral = model_type == "mixtral"
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    width = raw.get("intermediate_size") if mixtral else raw.get("moe_intermediate_size")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(width or raw.get("intermediate_size") or 0),
        norm_topk_prob=mixtral or bool(raw.get("norm_topk_prob", False)),
        moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def _llama4_moe_fields(raw: dict, num_experts: int, num_layers: int) -> dict:
    """Llama 4: the layers of `moe_layers`, else every interleave_moe_layer_step-th (the
    step-1'th first), route top-k by sigmoid to experts of intermediate_size, beside a shared
    expert of the same width; the others are dense (intermediate_size_mlp)."""
    moe = raw.get("moe_layers")
    if moe is None:
        step = int(raw.get("interleave_moe_layer_step", 1))
        moe = range(step - 1, num_layers, step)
    moe = {int(i) for i in moe}
    if any(not 0 <= i < num_layers for i in moe):
        raise ModelFolderError(
            "config.json", f"moe_layers {sorted(moe)} outside 0..{num_layers - 1}"
        )
    width = int(raw["intermediate_size"])
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
        moe_intermediate_size=width,
        moe_layers=tuple(i in moe for i in range(num_layers)),
        shared_expert_intermediate_size=width,
    )


def _deepseek_moe_fields(raw: dict, num_experts: int, num_layers: int) -> dict:
    """DeepSeek-V3 and Kimi K2: layers from first_k_dense_replace on (every moe_layer_freq-th)
    route sigmoid scores, biased by e_score_correction_bias for the choice, in groups, beside
    n_shared_experts shared experts (one SwiGLU of n_shared_experts x moe_intermediate_size)."""
    first, freq = int(raw.get("first_k_dense_replace") or 0), int(raw.get("moe_layer_freq") or 1)
    width = int(raw.get("moe_intermediate_size") or 0)
    n_group = int(raw.get("n_group") or 1)
    if num_experts % n_group or not 0 < int(raw.get("topk_group") or 1) <= n_group:
        raise ModelFolderError(
            "config.json",
            f"n_routed_experts {num_experts} in n_group {n_group} groups, topk_group "
            f"{raw.get('topk_group')}: need equal groups and 1 <= topk_group <= n_group",
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
        moe_intermediate_size=width,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        moe_layers=tuple(i >= first and i % freq == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=width * int(raw.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=int(raw.get("topk_group") or 1),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )


# --- Multi-head latent attention (DeepSeek-V3, Kimi K2) ------------------------------------


@dataclass(frozen=True)
class MLAFields:
    """MLA's dimensions, as transformers' DeepseekV3Config reads them. Per head, q and k have
    a no-RoPE part (qk_nope_head_dim) and a RoPE part (qk_rope_head_dim); k's no-RoPE part and v
    (v_head_dim) come from one latent per token (kv_lora_rank) through kv_b_proj, and its RoPE
    part is one vector shared by every head: the KV cache holds latent + RoPE part only."""

    q_lora_rank: int | None  # q through q_a_proj -> norm -> q_b_proj; None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # RoPE on interleaved pairs (DeepSeek's checkpoints), else half-split

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_raw(cls, raw: dict, source: str) -> "MLAFields":
        try:
            fields = cls(
                q_lora_rank=int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
                kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
                qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]),
                rope_interleave=bool(raw.get("rope_interleave", True)),
            )
        except KeyError as e:
            raise ModelFolderError(source, f"missing field {e.args[0]!r} (MLA)") from e
        if min(fields.kv_lora_rank, fields.qk_rope_head_dim, fields.v_head_dim) <= 0:
            raise ModelFolderError(source, "kv_lora_rank, qk_rope_head_dim, v_head_dim: positive")
        return fields


# --- Llama 4 (text) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Llama4Fields:
    """What Llama 4's text config adds, read as transformers' Llama4TextConfig reads it."""

    use_qk_norm: bool  # L2 norm (no weight, eps = rms_norm_eps) on q and k of RoPE layers
    attn_temperature_tuning: bool  # NoPE layers scale q by a function of the position
    floor_scale: float  # temperature tuning: log(floor((p + 1) / floor_scale) + 1) ...
    attn_scale: float  # ... * attn_scale + 1
    intermediate_size_mlp: int  # the dense (non-MoE) layers' MLP width (MoE: ModelConfig's)

    @classmethod
    def from_raw(cls, raw: dict) -> "Llama4Fields":
        return cls(
            use_qk_norm=bool(raw.get("use_qk_norm", True)),
            attn_temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
            floor_scale=float(raw.get("floor_scale", 8192)),
            attn_scale=float(raw.get("attn_scale", 0.1)),
            intermediate_size_mlp=int(raw.get("intermediate_size_mlp", 16384)),
        )


# -------------------------------------------------------------------------------------------


def generation_eos_ids(model_dir: str | Path) -> frozenset[int]:
    """EOS ids of generation_config.json (what HF generate stops on), else of config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            raw = json.loads(path.read_text())
            # a multimodal config.json (Llama 4) has its text model's ids in text_config
            eos = raw.get("eos_token_id") or (raw.get("text_config") or {}).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as e:
            raise ModelFolderError(str(path), f"not valid JSON ({e})") from e
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()
