"""DeepSeek-V3 / Kimi K2.5 (multi-head latent attention, grouped-routing MoE) against
transformers: the router alone, greedy tokens and float32 logprobs with chunked prefill and
staggered arrivals (with and without q_lora_rank, YaRN past the original context, a random
correction bias, the first layer dense), the absorbed decode against the expanded one, the
latent KV's bytes, bf16 within a tolerance, offline (tp, pp) = (2, 1), (1, 2) and --ep, a
prefill worker of (2, 1) handing latent pages to a decode worker of (1, 2) (`tison up`:
tests/test_moe_models.py), and
Kimi K2.5's checkpoint layout (language_model. prefix, vision tensors, multi-token-prediction
layers skipped)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.engine.llm import LLM
from shared.engine.shard import model_kv_spec
from shared.errors import ModelFolderError
from shared.kv.spec import MLAKVSpec
from shared.models.config import ModelConfig
from shared.models.deepseek_v3 import DeepseekV3MoE
from shared.models.layers.moe import grouped_topk
from shared.models.llama import LlamaMLP
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer

from engine_helpers import (
    SHAPES,
    assert_data_parallel,
    assert_logprobs_match,
    bf16_logprob_errors,
    hf_greedy_logits,
    make_prompts,
    new_engine,
    reference_getter,
    run_all,
    run_staggered,
)
from services_harness import (
    Services,
    assert_completions_equal,
    start_prefill_tp2_decode_pp2,
    wait_metric,
)

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
FAMILIES = ["deepseek_v3", "deepseek_v3_no_q_lora"]
PROMPT_LENGTHS = [1, 7, 17, 30, 45]  # 17+ span pages of 16; 30 and 45 prefill in chunks of 24
GREEDY_LOGPROBS = SamplingParams(temperature=0, max_tokens=24, logprobs=5)


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    """family -> (model folder, prompts, greedy outputs, the float32 logits of each output)."""
    return reference_getter(tiny_model_factory, PROMPT_LENGTHS, 24)


def test_config_reads_mla_and_grouped_routing(references):
    cfg = ModelConfig.from_dir(references("deepseek_v3")[0])
    m = cfg.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim) == (
        32,
        16,
        16,
        8,
    )
    assert m.v_head_dim == 24 and m.rope_interleave
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 4, 2)
    assert cfg.moe_layers == (False, True, True)  # first_k_dense_replace = 1
    assert cfg.shared_expert_intermediate_size == 32 and cfg.routed_scaling_factor == 2.5
    assert ModelConfig.from_dir(references("deepseek_v3_no_q_lora")[0]).mla.q_lora_rank is None


@pytest.mark.parametrize(
    "n_group,topk_group,renormalize", [(4, 2, True), (8, 3, False), (1, 1, True)]
)
def test_grouped_topk_equals_the_transformers_router(n_group, topk_group, renormalize):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=2.827,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(64, 32)
    logits, ref_weights, ref_ids = router(x)
    weights, ids = grouped_topk(
        logits, router.e_score_correction_bias, 3, n_group, topk_group, renormalize, 2.827
    )
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)  # the same experts, in any order
    assert torch.equal(order.values, ref_order.values)
    assert torch.allclose(
        weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_staggered_greedy_and_logprobs_match_transformers(references, family):
    """Requests join while others run (mixed prefill + decode steps), prompts in chunks; every
    token equals transformers' greedy one, its logprobs (top 5 too) float32's within tolerance;
    the decode steps run absorbed (the default)."""
    model_dir, prompts, refs, ref_logits = references(family)
    engine = new_engine(model_dir, max_num_batched_tokens=24, num_pages=64)
    requests = run_staggered(engine, prompts, GREEDY_LOGPROBS)
    for req, tokens, logits in zip(requests, refs, ref_logits):
        assert_logprobs_match(req, tokens, logits)
    assert engine.num_pages_used == 0
    kinds = [type(layer.mlp) for layer in engine.model.model.layers]
    assert kinds == [LlamaMLP, DeepseekV3MoE, DeepseekV3MoE]
    assert all(layer.self_attn.attn.absorb for layer in engine.model.model.layers)


def test_half_split_rope_matches_transformers(tiny_model_factory):
    """rope_interleave false: the RoPE part rotates its halves (rotate_half), not pairs."""
    model_dir = tiny_model_factory("deepseek_v3", rope_interleave=False)
    assert not ModelConfig.from_dir(model_dir).mla.rope_interleave
    prompts = make_prompts([7, 30])
    refs = hf_greedy_logits(model_dir, prompts, max_new_tokens=16)
    engine = new_engine(model_dir, num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5)
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    run_all(engine)
    for req, (tokens, logits) in zip(requests, refs):
        assert_logprobs_match(req, tokens, logits)


def test_absorbed_decode_equals_the_expanded_one(references):
    """Decode rows through W_UK-absorbed queries over the latent pages give the tokens and (to
    float32 rounding) the logprobs of decode rows whose latents are expanded into keys and
    values, as prefill does."""
    model_dir, prompts, _, _ = references("deepseek_v3")
    outputs = {}
    for absorb in (True, False):
        engine = new_engine(model_dir, num_pages=64)
        for layer in engine.model.model.layers:
            layer.self_attn.attn.absorb = absorb
        reqs = [engine.add_request(str(i), p, GREEDY_LOGPROBS) for i, p in enumerate(prompts)]
        run_all(engine)
        outputs[absorb] = [(r.output_token_ids, r.output_logprobs) for r in reqs]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outputs[True], outputs[False]):
        assert tokens == ref_tokens
        for ours, ref in zip(logprobs, ref_logprobs):
            assert abs(ours.logprob - ref.logprob) < 1e-4
            assert ours.top_ids == ref.top_ids
            assert max(abs(a - b) for a, b in zip(ours.top_logprobs, ref.top_logprobs)) < 1e-4


def test_latent_kv_bytes_per_token(references):
    """The MLA pool holds kv_lora_rank + qk_rope_head_dim values a token and layer: Kimi K2.5's
    512 + 64 in bf16 over 61 layers are 70,272 bytes a token (MHA of its 64 heads x 192 would
    be 3,000,000)."""
    raw = json.loads((FIXTURES / "kimi-k2.5.json").read_text())
    kimi = ModelConfig.from_dict(raw)
    spec = model_kv_spec(kimi, 16, torch.bfloat16)
    assert isinstance(spec, MLAKVSpec)
    assert spec.layer_token_bytes(0) == (512 + 64) * 2
    assert spec.page_size_bytes // 16 == 70_272
    model_dir = references("deepseek_v3")[0]
    engine = new_engine(model_dir, num_pages=8)
    assert engine.kv.nbytes == 8 * 16 * 3 * (16 + 8) * 4  # pages x page x layers x R+Dr x fp32
    assert engine.kv.layer(0).shape == (8, 16, 24)


def test_bfloat16_logprobs_close_to_transformers(references):
    """bf16: the engine's logprobs (top 5 at each of 8 steps) within 0.3 nats of transformers'
    float32 on the same tokens, and no further from it than transformers' own bf16 is, + 0.12
    (the bounds of the other MoE families, tests/test_moe_models.py). Transformers' bf16 is no
    reference here: on this model it is up to 10 nats off its float32 (measured, avx512_bf16:
    at the 12th prompt position, in prefill), where ours stays within 0.17: our router runs
    in float32 from the bf16 hidden state as theirs, but our attention and experts round at
    other places, and a near-tied group or expert choice flips in theirs."""
    model_dir = references("deepseek_v3")[0]
    prompt = make_prompts([12])[0]
    engine = new_engine(model_dir, dtype="bfloat16")
    errors = bf16_logprob_errors(engine, model_dir, prompt)
    assert errors["ours-fp32"] < 0.3, errors
    assert errors["ours-fp32"] <= errors["bf16-fp32"] + 0.12, errors


@pytest.mark.parametrize("tp,pp,ep,dp", SHAPES)
def test_parallel_shapes_equal_transformers(references, tp, pp, ep, dp):
    """Heads of q, kv_b_proj and o split across 2 TP ranks (the latent cache whole on each),
    layers across 2 stages (the dense layer and one MoE layer on the first), whole experts
    on 2 ranks (--ep), or 2 data-parallel ranks with a latent cache each (--dp); chunked
    prefill."""
    model_dir, prompts, refs, _ = references("deepseek_v3")
    with LLM(
        model_dir, dtype="float32", tp=tp, pp=pp, ep=ep, dp=dp, allow_oversubscribe=True,
        max_num_batched_tokens=24,
    ) as llm:  # fmt: skip
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
        assert [o.token_ids for o in outs] == refs
        if dp > 1:
            assert_data_parallel(llm.engine, dp)


@pytest.mark.parametrize("kv_transport", ["shm", "tcp"])
async def test_prefill_tp2_to_decode_pp2_equals_offline(
    references, tmp_path, kv_transport, monkeypatch
):
    """Latent pages move from a prefill worker of (2, 1) (both ranks hold the whole latent: the
    first sends) to a decode worker of (1, 2) (each stage its layers), over shm and tcp."""
    monkeypatch.setenv("TISON_KV_SECRET", "test-secret")  # the workers inherit it: TCP is on
    model_dir = references("deepseek_v3")[0]
    prompts = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. " * 2]
    with LLM(model_dir, dtype="float32") as llm:
        expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    with Services(tmp_path, model_dir) as s:
        start_prefill_tp2_decode_pp2(s, model_dir, kv_transport)
        await assert_completions_equal(s, model_dir.name, prompts, expected, 16)
        if kv_transport == "tcp":  # the decode worker's TCP server took the pages
            what = "KV bytes received over TCP"
            await wait_metric(s, "tison_kv_transfer_bytes", lambda n: n > 0, what, "decode")


def as_kimi_k25(model_dir: Path, out: Path) -> Path:
    """The folder rewritten in Kimi K2.5's layout: a KimiK25ForConditionalGeneration config
    with the model's as text_config, its tensors under language_model., a vision tower and a
    projector beside them, and a multi-token-prediction layer after the last one."""
    shutil.copytree(model_dir, out)
    text = json.loads((out / "config.json").read_text())
    text["num_nextn_predict_layers"] = 1
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"vt_hidden_size": 8, "vt_num_hidden_layers": 1},
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(out / "model.safetensors")
    tensors = {f"language_model.{name}": t for name, t in state.items()}
    last = text["num_hidden_layers"]
    for name, t in state.items():  # the MTP layer: a copy of layer 1, numbered after the last
        if name.startswith("model.layers.1."):
            tensors[f"language_model.model.layers.{last}." + name.split(".", 3)[3]] = t.clone()
    tensors["vision_tower.encoder.blocks.0.mlp.fc0.weight"] = torch.zeros(8, 8)
    tensors["mm_projector.proj.0.weight"] = torch.zeros(8, 8)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_kimi_k25_layout_loads_text_only(references, tmp_path):
    model_dir, prompts, refs, _ = references("deepseek_v3")
    kimi = as_kimi_k25(model_dir, tmp_path / "kimi")
    assert ModelConfig.from_dir(kimi).architecture == "KimiK25ForConditionalGeneration"
    with LLM(kimi, dtype="float32") as llm:
        outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=24))
    assert [o.token_ids for o in outs] == refs[:3]


def test_a_tiktoken_tokenizer_without_tokenizer_json_is_named(references, tmp_path):
    """Kimi's folders ship tiktoken.model (and Python code to read it), no tokenizer.json."""
    folder = tmp_path / "kimi"
    shutil.copytree(references("deepseek_v3")[0], folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tiktoken.model").write_text("")
    with pytest.raises(ModelFolderError, match=r"tokenizer\.json.*tiktoken\.model"):
        Tokenizer.from_dir(folder)
