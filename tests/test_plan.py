"""`tison plan` and the footprint calculator under it (shared/engine/footprint.py): each rank's
bytes equal the shard the engine loads (every family, TP ranks, --ep, a quantized Kimi
K2.5-shaped checkpoint); the published totals and checkpoint sizes of the fixture models; the
published deployments (Kimi K2.5 on 8 x H100, Llama 4 Scout on 2 x H200) and hand-computed
figures of Llama 3.1 8B and DeepSeek-V3; the engine's KV pool under a memory budget equal to
the plan's; the vision towers the engine skips, counted as transformers builds them."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.cli import main
from shared.engine.footprint import EXPERTS, rank_footprint
from shared.engine.llm import LLM
from shared.models.config import ModelConfig
from shared.models.layers.attention_backend import TorchBackend
from shared.models.loader import load_model, load_weights
from shared.models.quant import open_checkpoint
from shared.models.registry import model_class
from shared.parallel.group import TPGroup
from shared.parallel.pipeline import WHOLE_MODEL
from shared.parallel.shape import ParallelConfig
from shared.plan.devices import DEVICES, GiB
from shared.plan.planner import plan_devices, plan_shape
from shared.plan.report import build_report
from shared.plan.vision import vision_parameters

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
H100, H200 = DEVICES["h100-80gb"].memory_bytes, DEVICES["h200-141gb"].memory_bytes
RESERVE = 4 * GiB
BF16 = torch.bfloat16


def fixture(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(fixture(name))


def held_bytes(model) -> int:
    """Bytes of a loaded model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


# --- the calculator equals what the engine loads ---------------------------------------------


DENSE = ["llama", "llama_tied", "qwen2", "qwen3"]
MOE = ["mixtral", "qwen3_moe", "llama4_moe", "deepseek_v3", "deepseek_v3_no_q_lora"]
SHARDS = [(f, tp, False) for f in DENSE + MOE for tp in (1, 2)] + [(f, 2, True) for f in MOE]


@pytest.mark.parametrize("family,tp,ep", SHARDS)
def test_each_rank_holds_what_the_footprint_says(tiny_model_factory, family, tp, ep):
    model_dir = tiny_model_factory(family)
    cfg = ModelConfig.from_dir(model_dir)
    shape = ParallelConfig(tp=tp, ep=ep, allow_oversubscribe=True)
    for rank in range(tp):
        group = TPGroup(rank, tp, expert_parallel=ep)
        model = load_model(model_dir, cfg, torch.float32, tp=group)
        assert held_bytes(model) == rank_footprint(cfg, shape, rank, torch.float32).weight_bytes


@pytest.mark.parametrize("family", MOE)
def test_each_data_parallel_rank_holds_what_the_footprint_says(tiny_model_factory, family):
    """--dp 2: every rank the whole model but half of each MoE layer's experts."""
    model_dir = tiny_model_factory(family)
    cfg = ModelConfig.from_dir(model_dir)
    shape = ParallelConfig(dp=2, allow_oversubscribe=True)
    for rank in range(2):
        model = load_model(model_dir, cfg, torch.float32, tp=TPGroup(experts=TPGroup(rank, 2)))
        assert held_bytes(model) == rank_footprint(cfg, shape, rank, torch.float32).weight_bytes


def test_pipeline_stages_hold_what_the_footprint_says(tiny_model_factory):
    model_dir = tiny_model_factory("deepseek_v3")
    cfg = ModelConfig.from_dir(model_dir)
    shape = ParallelConfig(pp=2, allow_oversubscribe=True)
    for rank in range(2):
        stage = shape.stage_of(rank, cfg.num_layers)
        model = load_model(model_dir, cfg, torch.float32, stage=stage)
        fp = rank_footprint(cfg, shape, rank, torch.float32)
        assert held_bytes(model) == fp.weight_bytes
        assert fp.layers == (stage.start_layer, stage.end_layer)


@pytest.mark.parametrize(
    "family,tp,pp,dp",
    [
        ("llama", 1, 1, 1),
        ("llama", 2, 1, 1),
        ("deepseek_v3", 1, 2, 1),
        ("llama4_moe", 1, 2, 1),
        ("deepseek_v3", 1, 1, 2),
    ],
)
def test_the_engine_pool_under_a_memory_budget_is_the_plans(tiny_model_factory, family, tp, pp, dp):
    """`tison plan --gpu cpu --memory M` predicts the pool an engine given memory_bytes=M
    allocates (each rank: its weights, the reserve, its part of the pool; Llama 4's capped
    chunked layers: unit pages, a stage's layout on each; data-parallel ranks: a pool each)."""
    model_dir = tiny_model_factory(family)
    memory, reserve = 24 << 20, 2 << 20
    report = build_report(model_dir, "cpu", tp * pp * dp, memory, reserve, 256, 1, "float32")
    shape = (tp, pp, False, dp)
    planned = next(s for s in report["shapes"] if (s["tp"], s["pp"], s["ep"], s["dp"]) == shape)
    with LLM(
        model_dir, dtype="float32", tp=tp, pp=pp, dp=dp, memory_bytes=memory,
        memory_reserve_bytes=reserve, allow_oversubscribe=True,
    ) as llm:  # fmt: skip
        engine = llm.engine
        assert engine.kv.num_pages == planned["engine_pages"]
        assert engine.allocator.num_pages == dp * planned["engine_pages"]
        assert engine.kv.nbytes == planned["engine_pages"] * engine.kv.spec.page_size_bytes


def test_a_budget_the_weights_fill_is_refused(tiny_model_factory):
    from shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="memory_bytes.*leaves no KV page"):
        LLM(tiny_model_factory("llama"), dtype="float32", memory_bytes=1 << 20)


# --- a Kimi K2.5-shaped checkpoint: real dimensions, 2 layers, 8 experts, INT4 ---------------


def kimi_shaped_config() -> dict:
    raw = fixture("kimi-k2.5")
    text = dict(raw["text_config"], num_hidden_layers=2, first_k_dense_replace=0,
                n_routed_experts=8, vocab_size=1024)  # fmt: skip
    return dict(raw, text_config=text, vision_config=None)


def write_kimi_shaped(out: Path) -> Path:
    """Kimi K2.5's exact layout: language_model. names, the routed experts INT4 (int32
    weight_packed [out, in/8], bf16 weight_scale [out, in/32], int32 weight_shape), the rest
    bf16; random values (the test checks bytes and shapes, not outputs)."""
    raw = kimi_shaped_config()
    cfg = ModelConfig.from_dict(raw)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    with torch.device("meta"):
        plain = model_class(cfg.architecture)(cfg, BF16, attention=TorchBackend())
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in plain.named_parameters():
        if ".experts." in name:
            continue
        name = name.replace("gate_up_proj", "gate_proj")  # split below
        value = (torch.randn(p.shape, generator=g) * 0.02).to(BF16)
        if name.endswith("gate_proj.weight"):
            half = p.shape[0] // 2
            tensors[f"language_model.{name}"] = value[:half].clone()
            tensors[f"language_model.{name.replace('gate_proj', 'up_proj')}"] = value[half:].clone()
        else:
            tensors[f"language_model.{name}"] = value
    m = cfg.moe_intermediate_size
    for layer in range(cfg.num_layers):
        for e in range(cfg.num_experts):
            for kind, (rows, cols) in {"gate_proj": (m, 7168), "up_proj": (m, 7168),
                                       "down_proj": (7168, m)}.items():  # fmt: skip
                stem = f"language_model.model.layers.{layer}.mlp.experts.{e}.{kind}"
                packed = torch.randint(-(2**31), 2**31 - 1, (rows, cols // 8), dtype=torch.int32,
                                       generator=g)  # fmt: skip
                tensors[stem + ".weight_packed"] = packed
                tensors[stem + ".weight_scale"] = torch.full((rows, cols // 32), 1e-3, dtype=BF16)
                tensors[stem + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_kimi_k25_shaped_int4_checkpoint_loads_the_planned_bytes(tmp_path):
    """Loaded (dequantized, bf16) at TP ranks 0 and 1 of 2, each rank holds the footprint's
    bytes; packed, the footprint's routed experts are the checkpoint's stored INT4 bytes."""
    folder = write_kimi_shaped(tmp_path / "kimi")
    raw = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.mla.kv_lora_rank, cfg.mla.q_lora_rank) == (7168, 512, 1536)
    shape = ParallelConfig(tp=2, allow_oversubscribe=True)
    for rank in range(2):
        model = model_class(cfg.architecture)(cfg, BF16, TPGroup(rank, 2), WHOLE_MODEL,
                                              TorchBackend())  # fmt: skip
        checkpoint = open_checkpoint(folder, cfg.raw)
        load_weights(model, checkpoint, WHOLE_MODEL, str(folder))  # bf16, unpacked for oneDNN
        checkpoint.close()
        assert held_bytes(model) == rank_footprint(cfg, shape, rank, BF16).weight_bytes
        del model
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = sum(
            math.prod(f.get_slice(n).get_shape()) * (2 if n.endswith("scale") else 4)
            for n in f.keys()
            if ".experts." in n
        )
    whole = rank_footprint(cfg, ParallelConfig(), 0, BF16, packed=True)
    assert whole.by_component[EXPERTS] == stored


# --- the fixture models: published totals and checkpoint sizes ---------------------------------


def test_vision_towers_are_counted_as_transformers_builds_them():
    from transformers import Llama4Config
    from transformers.models.kimi_k25 import configuration_kimi_k25, modeling_kimi_k25
    from transformers.models.llama4 import modeling_llama4

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    raw = fixture("llama-4-scout")
    c = Llama4Config(text_config=raw["text_config"], vision_config=raw["vision_config"])
    with torch.device("meta"):
        llama4 = count(modeling_llama4.Llama4VisionModel(c.vision_config),
                       modeling_llama4.Llama4MultiModalProjector(c))  # fmt: skip
    assert vision_parameters(raw) == llama4 == 871_932_416
    raw = fixture("kimi-k2.5")
    kept = {k: v for k, v in raw.items() if k not in ("auto_map", "quantization_config")}
    c = configuration_kimi_k25.Kimi_K25Config(**kept)
    with torch.device("meta"):
        kimi = count(modeling_kimi_k25.Kimi_K25VisionModel._from_config(c.vision_config),
                     modeling_kimi_k25.Kimi_K25MultimodalProjection(c))  # fmt: skip
    assert vision_parameters(raw) == kimi == 471_143_920


def test_parameter_counts_and_checkpoint_sizes_match_the_published_ones():
    """Llama 3.1 8B: 8.03B, exactly its 16,060,522,496-byte checkpoint in bf16. Scout: 109B with
    its vision tower, ~217-219 GB in bf16. DeepSeek-V3: 671B (its multi-token-prediction layer,
    which the engine skips, aside). Kimi K2.5: its 595.2 GB checkpoint (INT4 routed experts
    with their scales, the rest bf16; our router is float32: counted as stored, bf16) -- its
    parameters come to 1.027T, not the ~1.04T sometimes quoted, which that size rules out."""
    llama = rank_footprint(config("llama-3.1-8b"), ParallelConfig(), 0, BF16)
    assert llama.parameters == 8_030_261_248 and 2 * llama.parameters == 16_060_522_496
    scout = rank_footprint(config("llama-4-scout"), ParallelConfig(), 0, BF16)
    total = scout.parameters + vision_parameters(fixture("llama-4-scout"))
    assert abs(total / 109e9 - 1) < 0.005 and 217e9 <= 2 * total <= 219e9
    deepseek = rank_footprint(config("deepseek-v3"), ParallelConfig(), 0, BF16)
    assert abs(deepseek.parameters / 671e9 - 1) < 0.005
    kimi_cfg = config("kimi-k2.5")
    kimi = rank_footprint(kimi_cfg, ParallelConfig(), 0, BF16, packed=True)
    router_fp32 = kimi.by_component["router"] // 2  # what bf16 routers would save
    on_disk = kimi.weight_bytes - router_fp32 + 2 * vision_parameters(fixture("kimi-k2.5"))
    assert abs(on_disk / 595.2e9 - 1) < 0.005
    assert abs((kimi.parameters + vision_parameters(fixture("kimi-k2.5"))) / 1.027e12 - 1) < 0.005


# --- the published deployments and hand-computed figures --------------------------------------


def test_kimi_k25_needs_8_h100s_with_over_30_gib_of_kv():
    cfg = config("kimi-k2.5")
    assert not any(p.fits for p in plan_devices(cfg, 7, H100, RESERVE, BF16, 8192))
    plans = {p.label: p for p in plan_devices(cfg, 8, H100, RESERVE, BF16, 8192)}
    tp8 = plans["tp=8 pp=1 ep"]
    assert tp8.fits and tp8.kv_bytes > 30 * GiB
    # MLA under tensor parallelism: every GPU holds every token's latent (70,272 B)
    assert tp8.kv_token_bytes == 8 * 70_272
    assert tp8.kv_tokens == (H100 - tp8.weight_bytes - RESERVE) // 70_272


def test_llama4_scout_fits_2_h200s_with_over_56_gib_and_1_2m_tokens():
    """Chunked layers capped at their chunk: 49,152 B a token (12 global layers x 8 KV heads x
    128 x 2 x 2 B), 24,576 on each of 2 TP ranks."""
    cfg = config("llama-4-scout")
    plan = plan_shape(cfg, ParallelConfig(tp=2, allow_oversubscribe=True), H200, RESERVE, BF16,
                      8192)  # fmt: skip
    assert plan.fits and plan.kv_bytes > 56 * GiB
    assert plan.kv_token_bytes == 49_152 and plan.kv_tokens > 1_200_000
    assert plan.kv_tokens == (H200 - plan.weight_bytes - RESERVE) // 24_576


def test_llama_31_8b_by_hand():
    """One H100: 2 x V x H (embedding, LM head) + 32 x (attention 4096 x (4096 + 2 x 1024 +
    4096), MLP 3 x 4096 x 14336, 2 norms) + the final norm, in bf16, plus the RoPE tables (cos
    and sin, 131,072 positions x 128, bf16); KV 2 x 8 x 128 x 32 x 2 B a token."""
    cfg = config("llama-3.1-8b")
    H, V, L = 4096, 128_256, 32
    params = 2 * V * H + L * (H * (H + 2 * 1024 + H) + 3 * H * 14_336 + 2 * H) + H
    tables = 2 * 131_072 * 128 * 2
    plan = plan_shape(cfg, ParallelConfig(), H100, RESERVE, BF16, 8192)
    assert plan.weight_bytes == 2 * params + tables
    assert plan.kv_token_bytes == 131_072
    assert plan.kv_tokens == (H100 - 2 * params - tables - RESERVE) // 131_072
    assert plan.max_concurrency == (H100 - 2 * params - tables - RESERVE) // (131_072 * 8192)


def test_deepseek_v3_fp8_by_hand():
    """8 x H200 at tp=8: each GPU holds 1/8 of every routed expert's intermediate dimension
    (256 rows of 2048), in FP8 with a float32 scale per 128 x 128 block; MLA's KV (70,272 B a
    token) is whole on every GPU."""
    cfg = config("deepseek-v3")
    plan = plan_shape(cfg, ParallelConfig(tp=8, allow_oversubscribe=True), H200, RESERVE, BF16,
                      8192)  # fmt: skip
    rows, H = 2048 // 8, 7168
    linear = rows * H + 4 * math.ceil(rows / 128) * math.ceil(H / 128)  # gate, up; down alike
    experts = (61 - 3) * 256 * 3 * linear
    assert plan.stages[0].by_component[EXPERTS] == experts
    assert plan.kv_token_bytes == 8 * 70_272
    assert plan.kv_tokens == (H200 - plan.weight_bytes - RESERVE) // 70_272


def test_deepseek_v3_data_parallel_attention_holds_each_token_once():
    """8 x H200 with data-parallel attention: each GPU holds the whole attention and dense
    layers, 1/8 of the routed experts, and the latent of its own tokens only, so the 8 GPUs hold
    8 times one GPU's tokens: over 5 times what tp=8 holds, where every GPU holds every
    token's latent."""
    cfg = config("deepseek-v3")
    dp8 = plan_shape(cfg, ParallelConfig(dp=8, allow_oversubscribe=True), H200, RESERVE, BF16,
                     8192)  # fmt: skip
    tp8 = plan_shape(cfg, ParallelConfig(tp=8, allow_oversubscribe=True), H200, RESERVE, BF16,
                     8192)  # fmt: skip
    assert dp8.label == "tp=1 pp=1 dp=8" and dp8.devices == 8 and dp8.fits
    assert dp8.kv_token_bytes == 70_272
    assert dp8.kv_tokens == 8 * ((H200 - dp8.weight_bytes - RESERVE) // 70_272)
    assert dp8.weight_bytes > tp8.weight_bytes and dp8.kv_tokens > 5 * tp8.kv_tokens
    labels = [p.label for p in plan_devices(cfg, 8, H200, RESERVE, BF16, 8192)]
    assert "tp=1 pp=1 dp=8" in labels


# --- the command ---------------------------------------------------------------------------------


def test_tison_plan_prints_the_table_and_json(capsys):
    assert main(["plan", str(CONFIGS / "kimi-k2.5.json"), "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "fewest devices: 8" in out and "tp=8 pp=1 ep" in out and "suggested: prefill" in out
    assert main(["plan", str(CONFIGS / "llama-4-scout.json"), "--gpu", "h200-141gb", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fewest_devices"] == 2 and report["kv_bytes_per_token"] == 49_152
    assert report["parameters"]["vision_not_loaded"] == 871_932_416


def test_tison_plan_errors_name_the_flag(capsys, tmp_path):
    assert main(["plan", str(CONFIGS / "llama-3.1-8b.json"), "--gpu", "cpu"]) == 2
    assert "--memory" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
