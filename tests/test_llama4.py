"""Llama 4 text models (shared/models/llama4.py) against transformers, float32 greedy token for
token: tiny random models keeping every quirk at test lengths (tiny_models.LLAMA4: chunks of 8
under prompts of up to 60 tokens, a NoPE layer with temperature tuning at floor_scale 4, L2
qk-norm, llama3 RoPE scaling; "llama4_moe" routes layers 1 and 3 to experts), from a
Llama4ForCausalLM and from a Llama4ForConditionalGeneration checkpoint (vision weights skipped),
on both attention backends, at TP=2 and PP=2, in bf16; and Llama 4 Scout's shape (its real
config, 4 of its 48 layers, on the meta device): parameters per rank and KV bytes per token."""

import json
from pathlib import Path

import pytest
import torch

from shared.checkpoint import Checkpoint
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.shard import model_kv_groups, model_kv_spec, rank_kv_spec
from shared.errors import InvalidRequestError
from shared.kv.chunk_cache import (
    chunk_groups,
    chunk_pages_per_seq,
    group_slots,
    layer_groups,
    unit_slots,
)
from shared.kv.pages import pages_for
from shared.models.config import ModelConfig, generation_eos_ids
from shared.models.layer_attention import CHUNKED, GLOBAL_MASK, AttentionMask
from shared.models.layers import rotary
from shared.models.layers.moe import FusedMoE
from shared.models.llama4 import Llama4ForCausalLM, Llama4MoE
from shared.parallel.group import TPGroup
from shared.parallel.shape import ParallelConfig

from compilers import needs_compiler
from engine_helpers import (
    GREEDY_32,
    SHAPES,
    assert_data_parallel,
    attention_backends,
    bf16_logprobs_and_hf,
    hf_greedy,
    make_prompts,
    new_engine,
    run_all,
    run_staggered,
)
from tiny_models import build_tokenizer, hf_config, soften_attention

SCOUT = Path(__file__).parent / "fixtures" / "configs" / "llama-4-scout.json"
CHUNK8 = AttentionMask(CHUNKED, 8)


@pytest.fixture(scope="module")
def moe(tiny_model_factory):
    model_dir = tiny_model_factory("llama4_moe")
    prompts = make_prompts()
    return model_dir, prompts, hf_greedy(model_dir, prompts)


def test_layers_as_transformers_builds_them(moe):
    model_dir, _, _ = moe
    engine = new_engine(model_dir)
    layers = engine.model.model.layers
    assert [a.mask for a in engine.model_config.layer_attention] == [CHUNK8] * 2 + [
        GLOBAL_MASK,
        CHUNK8,
    ]
    assert [layer.self_attn.rotary is not None for layer in layers] == [True, True, False, True]
    assert [layer.self_attn.qk_norm is not None for layer in layers] == [1, 1, 0, 1]
    assert [layer.self_attn.temperature is not None for layer in layers] == [0, 0, 1, 0]
    assert [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in layers] == [
        False,
        True,
        False,
        True,
    ]
    assert engine.model.model.fused is None


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu_kernels", marks=needs_compiler)])
def test_greedy_matches_transformers(moe, backend):
    """Requests join while others decode; prompts prefill in chunks of the 24-token budget;
    every layer's KV in one pool (cap_chunked_kv off)."""
    model_dir, prompts, refs = moe
    engine = new_engine(
        model_dir, max_num_batched_tokens=24, attention_backend=backend, cap_chunked_kv=False
    )
    assert attention_backends(engine) == {backend}
    outputs: dict = {}
    run_staggered(engine, prompts, GREEDY_32, outputs)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.num_pages_used == 0


def _capped_engine(model_dir, **options):
    return new_engine(model_dir, page_size=4, cap_chunked_kv=True, max_num_seqs=8, **options)


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu_kernels", marks=needs_compiler)])
def test_capped_chunked_kv_matches_transformers(moe, backend):
    """cap_chunked_kv: chunked layers hold pages from their window on (chunks of 8, pages of 4:
    at most 3 while decoding, the chunk and a 24-token step while prefilling), the global ones
    every token; requests join mid-run and prefill in chunks of the 24-token budget."""
    model_dir, prompts, refs = moe
    engine = _capped_engine(model_dir, max_num_batched_tokens=24, attention_backend=backend)
    assert attention_backends(engine) == {backend}
    outputs: dict = {}
    most_full = most_chunked_decoding = 0

    def step():
        nonlocal most_full, most_chunked_decoding
        for s in engine.step():
            outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
        for req in engine.scheduler.running:
            groups = req.chunk_page_ids  # 3 groups (1 global, 3 chunked layers), as long
            assert len(groups) == 3 and len({len(g) for g in groups}) == 1
            assert len(groups[0]) <= 2 + 6 + 2
            most_full = max(most_full, len(req.page_ids))
            if req.num_computed_tokens > req.num_prompt_tokens:  # decoded a token at least
                most_chunked_decoding = max(most_chunked_decoding, len(groups[0]))

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
        for _ in range(3):
            step()
    while engine.has_unfinished():
        step()
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert most_chunked_decoding <= 3 < most_full
    assert engine.num_pages_used == 0


def test_capped_chunked_kv_survives_preemption(moe):
    """56 pages of 4 for prompts of up to 60 tokens and 32 more: one sequence's chunked
    layers take up to 3 x 8 of them, so the pool holds 128 tokens of one; the newest requests
    are preempted, all their pages freed, and recomputed to the same tokens."""
    model_dir, prompts, refs = moe
    engine = _capped_engine(model_dir, num_pages=56, max_num_batched_tokens=16)
    assert engine.pool_tokens == (56 - 3 * chunk_pages_per_seq(8, 4, 16)) * 4 == 128
    reqs = [engine.add_request(str(i), p, GREEDY_32) for i, p in enumerate(prompts)]
    outputs = run_all(engine)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert any(r.num_preemptions for r in reqs)
    assert engine.num_pages_used == 0


def test_capped_layers_share_one_page_budget(moe):
    """One pool of unit pages: a page holds one layer's page of tokens (1 global layer, 3
    chunked ones in 3 groups), as many as the budget holds; whichever kind the requests need
    takes the free pages. A capped layout refuses the handoffs it does not serve."""
    model_dir, _, _ = moe
    engine = _capped_engine(
        model_dir, num_pages=None, kv_cache_bytes=4 << 20, max_num_batched_tokens=24
    )
    kv, unit = engine.kv, engine.kv_spec.page_size_bytes // engine.kv_spec.num_layers
    assert engine.kv_groups == (1, 2, 0, 3) and kv.spec.num_layers == 1
    assert kv.num_pages == engine.allocator.num_pages and kv.nbytes == kv.num_pages * unit
    assert kv.nbytes <= 4 << 20 < kv.nbytes + unit
    # the router's TOO_LONG limit (heartbeat): one sequence beside its chunked pages
    assert engine.load()["max_sequence_tokens"] == engine.pool_tokens < kv.num_pages * 4
    with pytest.raises(InvalidRequestError, match="hold no sequence"):
        _capped_engine(model_dir, num_pages=3)  # a page of tokens takes 4
    with pytest.raises(InvalidRequestError, match="cap_chunked_kv"):
        EngineConfig(model_dir=model_dir, cap_chunked_kv=True, kv_push=True)
    assert EngineConfig(model_dir=model_dir, kv_shm_path="/dev/shm/x").caps_chunked_kv


def test_a_capped_reservation_holds_the_window_then_computes_here(moe):
    """A decode worker's reservation holds the chunked layers' pages of the first decoded
    token's window only (chunks of 8, pages of 4); computed here after all (start_local),
    the prompt takes its chunked pages as it goes, and the tokens are transformers'."""
    model_dir, prompts, refs = moe
    engine = _capped_engine(model_dir, max_num_batched_tokens=16)
    i = max(range(len(prompts)), key=lambda j: len(prompts[j]))
    length = len(prompts[i])
    got = engine.reserve("r", prompts[i], GREEDY_32)
    first = length // 8 * 8 // 4
    assert got.chunk_first_page == first and length > 16
    assert [len(g) for g in got.chunk_page_ids] == [pages_for(length + 1, 4) - first] * 3
    assert len(got.page_ids) == pages_for(length + 1, 4)
    assert engine.handoff_bytes("r") == sum(
        (length - first * 4 if kind == CHUNKED else length) * engine.kv_spec.layer_token_bytes(n)
        for n, kind in enumerate(a.mask.kind for a in engine.model_config.layer_attention)
    )
    assert engine.start_local("r")
    assert run_all(engine)["r"] == refs[i]
    assert engine.num_pages_used == 0


def test_capped_chunked_kv_with_the_prefix_cache_matches_transformers(moe):
    """Prompts sharing a prefix with one computed earlier start on its cached pages, and on
    each page group's pages of the window there: 30 shared tokens end inside a chunk (28
    cached: pages 0-6, the window's page 6 of each group too), 32 at a chunk's start (no
    window), the whole prompt again (all but its last page). Tokens are transformers'."""
    model_dir, prompts, _ = moe
    base, tail = prompts[-1][:40], prompts[-2][:10]
    asked = [base, base[:30] + tail, base[:32] + tail, base]
    refs = hf_greedy(model_dir, asked)
    engine = _capped_engine(model_dir, max_num_batched_tokens=24)
    assert engine.prefix_cache is not None
    cached = []
    for i, p in enumerate(asked):  # one at a time: each finds the earlier ones' pages
        req = engine.add_request(str(i), p, GREEDY_32)
        engine.step()
        cached.append(req.num_cached_pages if req.num_computed_tokens else 0)
        assert run_all(engine, {str(i): list(req.output_token_ids)})[str(i)] == refs[i]
    hits = engine.prefix_stats()["hit_tokens"]
    assert hits == (7 + 8 + 9) * 4, (cached, hits)
    assert engine.num_pages_used == 0
    stored, _ = engine.kv_events()  # the main pages' names only (the router's index)
    assert len(stored) == len(set(stored)) and engine.prefix_cache.stats.cached_pages > len(stored)


def test_chunk_groups_fit_every_stage():
    """R is the same on every rank (page ids are): the fewest groups that make the largest
    unit page smallest. Here stage 0 holds 2 chunked layers, stage 1 a global and a chunked
    one: 2 groups give units of one layer on both (3 would too, at a dearer window)."""
    stages = [(True, True), (False, True)]
    assert chunk_groups(stages) == 2 and unit_slots(stages[0], 2) == unit_slots(stages[1], 2) == 1
    assert [layer_groups(c, 2) for c in stages] == [(1, 2), (0, 1)]
    assert group_slots((1, 2, 0, 1)) == (2, [0, 0, 0, 1])
    assert chunk_groups([(True, True, True, False)]) == 3  # the tiny model, one stage


def _half_split(x, cos, sin):  # Llama's RoPE layout, on Llama 4's per-pair cos/sin
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    half = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * s


def _without(engine, quirk, monkeypatch):
    model = engine.model.model
    for layer in model.layers:
        if quirk == "qk norm":
            layer.self_attn.qk_norm = None
        if quirk == "temperature":
            layer.self_attn.temperature = None
    if quirk == "chunks":
        model.masks = [GLOBAL_MASK] * len(model.masks)
        engine.runner.masks = (GLOBAL_MASK,)
    if quirk == "interleaved rope":
        monkeypatch.setattr(rotary, "_rotate_pairs", _half_split)


@pytest.mark.parametrize("quirk", ["chunks", "interleaved rope", "qk norm", "temperature"])
def test_each_quirk_is_needed(moe, quirk, monkeypatch):
    """Without any one of them the tokens differ: the parity above tests each."""
    model_dir, prompts, refs = moe
    engine = new_engine(model_dir)
    _without(engine, quirk, monkeypatch)
    for i, p in enumerate(prompts[-3:]):  # 30, 45, 60 tokens
        engine.add_request(str(i), p, GREEDY_32)
    outputs = run_all(engine)
    assert [outputs[str(i)] for i in range(3)] != refs[-3:]


@pytest.mark.parametrize("tp,pp,ep,dp", SHAPES)
def test_parallel_greedy_matches_transformers(moe, tp, pp, ep, dp):
    """TP splits heads, the dense and shared MLPs and each expert's intermediate dim (or with
    --ep gives each rank 2 whole experts, the weight on their input); PP puts layers 0-1
    (chunked; dense, MoE) and 2-3 (global NoPE, chunked MoE) on two stages; --dp gives each of
    2 ranks its own requests and pool, and 2 whole experts. The chunked layers' KV is capped on
    every rank (pages of 4 under chunks of 8): the step plans carry each request's chunked
    pages to the other ranks."""
    model_dir, prompts, refs = moe
    with LLM(
        model_dir, dtype="float32", tp=tp, pp=pp, ep=ep, dp=dp, allow_oversubscribe=True,
        num_pages=256, page_size=4, max_num_batched_tokens=24,
    ) as llm:  # fmt: skip
        assert llm.engine.chunk_groups == (2 if pp == 2 else 3)  # capped
        outs = llm.generate(prompts[1::2], GREEDY_32)
        assert [o.token_ids for o in outs] == refs[1::2]
        assert llm.engine.num_pages_used == 0
        if dp > 1:
            assert_data_parallel(llm.engine, dp)


def test_bfloat16_logprobs_close_to_transformers(moe):
    """bf16: the engine's logprobs (top 5 at each of 8 steps) within 0.25 nats of transformers'
    bf16 log_softmax on the same tokens for the 30-token prompt (0.19-0.21 measured at each
    tier, as Llama's 0.12-0.16 in test_engine_parity: logits reach ~|16|, one bf16 step is
    0.06-0.125), and on average over five prompts as close to the float32 one as transformers'
    bf16 is, +0.01 nats (measured at portable / avx2 / avx512_bf16: 0.057 / 0.059 / 0.057
    against 0.061 / 0.064 / 0.061). One prompt's mean moves by ~0.01 either way with any
    rounding (the L2 norm's summation order against torch's mean, a span cut of decode
    attention), so it is the five prompts' mean that is held: the 16-token one is left out,
    where transformers' own bf16 picks another token (a 3.6-nat gap). Pages of 4, so that each
    chunk of 8 starts a page as Scout's 8,192-token chunks do at any page size: every decode
    step runs in the fused decoder's one call."""
    model_dir, prompts, _ = moe
    engine = new_engine(model_dir, dtype="bfloat16", page_size=4)
    assert engine.model.model.fused is not None
    ours_gaps, hf_gaps = [], []
    for i in (2, 4, 5, 6, 7):  # 7 to 60 tokens: up to eight chunks, the NoPE temperature
        ours, ref = bf16_logprobs_and_hf(engine, model_dir, prompts[i])
        seen = ~ours.isnan()
        bf16, f32 = ref[torch.bfloat16][seen], ref[torch.float32][seen]
        if i == 5:  # 30 tokens
            assert (ours[seen] - bf16).abs().max() < 0.25
        ours_gaps.append((ours[seen] - f32).abs())
        hf_gaps.append((bf16 - f32).abs())
    hf_mean = torch.cat(hf_gaps).mean()
    assert torch.cat(ours_gaps).mean() <= hf_mean + 0.01, "less exact than HF bf16"


# --- a Llama4ForConditionalGeneration checkpoint, served text-only ---------------------------


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """transformers' Llama4ForConditionalGeneration: llama4_moe's text config and a one-layer
    vision tower; its config.json nests the text model's fields (eos included) in text_config."""
    import transformers

    out = tmp_path_factory.mktemp("model-llama4-multimodal")
    text = hf_config("llama4_moe")
    for key in ("architectures", "model_type", "torch_dtype"):
        text.pop(key)
    vision = dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
        projector_output_dim=64,
    )  # fmt: skip
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(7)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    soften_attention(model, text["hidden_size"])
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out)
    prompts = make_prompts([17, 45])
    refs = []
    for p in prompts:  # its text model (its own text-only forward fails in transformers 5.24)
        seq = model.language_model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[
            0
        ]
        new = seq[len(p) :].tolist()
        refs.append(new[: new.index(2) + 1] if 2 in new else new)
    return out, prompts, refs


def test_multimodal_checkpoint_serves_its_text_model(multimodal, tmp_path):
    model_dir, prompts, refs = multimodal
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["architectures"] == ["Llama4ForConditionalGeneration"]
    assert "eos_token_id" not in raw and raw["text_config"]["eos_token_id"] == 2
    (tmp_path / "config.json").write_text(json.dumps(raw))  # no generation_config.json
    assert generation_eos_ids(tmp_path) == generation_eos_ids(model_dir) == {2}
    checkpoint = Checkpoint.open(model_dir)
    names = list(checkpoint.names())
    checkpoint.close()
    assert any(n.startswith("vision_model.") for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)
    assert all(n.startswith(("language_model.", "vision_model.", "multi_modal_")) for n in names)
    engine = new_engine(model_dir)
    assert engine.model_config.hidden_size == 64 and engine.model_config.moe_layers == (
        False,
        True,
        False,
        True,
    )
    ours = [name for name, _ in engine.model.named_parameters()]
    assert not any("vision" in n or "projector" in n for n in ours)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
    outputs = run_all(engine)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs


# --- Llama 4 Scout's shape, checkpoint-free --------------------------------------------------


def scout_config(num_layers: int | None = None) -> ModelConfig:
    raw = json.loads(SCOUT.read_text())
    if num_layers is not None:
        raw["text_config"]["num_hidden_layers"] = num_layers
    return ModelConfig.from_dict(raw, source=str(SCOUT))


def expected_parameters(cfg: ModelConfig, tp: int) -> int:
    """Parameters one rank of tp holds, from the config: column/row-parallel linears, the
    vocabulary and each expert's intermediate dim split; norms and the router replicated."""
    H, hd, l4 = cfg.hidden_size, cfg.head_dim, cfg.llama4
    attention = H * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) // tp
    E = cfg.num_experts
    moe = H * E + 3 * H * cfg.intermediate_size * (E + 1) // tp
    dense = 3 * H * l4.intermediate_size_mlp // tp
    layers = sum(
        attention + 2 * H + (moe if cfg.moe_layers[i] else dense) for i in range(cfg.num_layers)
    )
    vocab = -(-cfg.vocab_size // tp) * H  # the last shard padded
    return layers + 2 * vocab + H  # + embedding, LM head, final norm


@pytest.mark.parametrize("tp", [1, 2])
def test_scout_parameters_per_rank(tp):
    """Scout (hidden 5120, 40/8 heads, 16 experts of 8192 + a shared one in every layer, vocab
    202048) with 4 layers on the meta device: 10,877,383,680 parameters at TP=1 (transformers'
    count), 5,438,878,720 on each rank at TP=2. All 48 layers: 107,769,861,120 (TP=1)."""
    cfg = scout_config(4)
    assert cfg.moe_layers == (True,) * 4
    with torch.device("meta"):
        model = Llama4ForCausalLM(cfg, dtype=torch.bfloat16, tp=TPGroup(rank=0, size=tp))
    count = sum(p.numel() for p in model.parameters())
    assert count == expected_parameters(cfg, tp)
    assert count == {1: 10_877_383_680, 2: 5_438_878_720}[tp]
    assert expected_parameters(scout_config(), 1) == 107_769_861_120


def test_scout_parameters_match_transformers():
    import transformers

    raw = json.loads(SCOUT.read_text())["text_config"]
    with torch.device("meta"):
        hf = transformers.Llama4ForCausalLM(
            transformers.Llama4TextConfig(**dict(raw, num_hidden_layers=4))
        )
    assert sum(p.numel() for p in hf.parameters()) == expected_parameters(scout_config(4), 1)


def test_scout_rope_frequencies_match_transformers():
    """llama3 scaling with low = high frequency factor (1.0): one threshold, no smoothing band."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = json.loads(SCOUT.read_text())["text_config"]
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.Llama4TextConfig(**raw))
    cfg = scout_config()
    ours = rotary.InterleavedRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq, rtol=0, atol=0)


def test_scout_kv_bytes_per_token():
    """bf16 K and V of 8 heads of 128 in each of 48 layers: 196,608 bytes (192 KiB) a token,
    every layer keeping every token. Chunked layers (36 of 48) need only their chunk (8192):
    capped, a 131,072-token sequence would hold 12 x 131,072 + 36 x 8,192 layer-tokens of
    4,096 bytes, 7.125 GiB, not 24 GiB: with cap_chunked_kv (shared/kv/chunk_cache.py) the
    chunked layers hold a sequence's window only, 49,152 bytes a token at that length, in one
    pool of pages of 12 layers (shared/kv/chunk_cache.py)."""
    cfg = scout_config()
    spec = model_kv_spec(cfg, page_size=16, dtype=torch.bfloat16)
    assert spec.page_size_bytes // 16 == 196_608 == cfg.num_layers * 2 * 8 * 128 * 2
    chunked = sum(a.mask.kind == CHUNKED for a in cfg.layer_attention)
    assert chunked == 36
    per_layer = spec.layer_token_bytes(0)
    capped = ((cfg.num_layers - chunked) * 131_072 + chunked * 8192) * per_layer
    assert capped == int(7.125 * 2**30) and 131_072 * spec.page_size_bytes // 16 == 24 * 2**30
    window = chunk_pages_per_seq(8192, 16, 2048) * 16  # the most a capped chunked layer holds
    assert window == 8192 + 2048 + 32
    growth = (cfg.num_layers - chunked) * per_layer  # bytes a token adds past the window
    assert growth == 49_152 == spec.page_size_bytes // 16 // 4
    held = ((cfg.num_layers - chunked) * 131_072 + chunked * window) * per_layer
    assert held // 131_072 == 60_708  # 131,072 tokens of context, at most one step's more
    # capped, one pool: unit pages of 12 layers, the global ones and 3 groups of chunked ones
    groups, kv_groups = model_kv_groups(cfg, ParallelConfig())
    assert groups == 3 and kv_groups[:8] == (1, 1, 1, 0, 1, 1, 1, 0) and kv_groups[-1] == 0
    assert group_slots(kv_groups)[0] * per_layer == growth  # a token's bytes past the window
    assert model_kv_groups(cfg, ParallelConfig(pp=2))[0] == 3  # 6 layers a page on each stage
    # pp=8: 6 layers a stage, 1 or 2 of them global: 3 groups of up to 2 (pages of 2 layers)
    groups, kv_groups = model_kv_groups(cfg, ParallelConfig(pp=8))
    assert groups == 3 and max(group_slots(kv_groups[s : s + 6])[0] for s in range(0, 48, 6)) == 2
    # at TP=2 (capped too, any T x P shape) each rank holds 4 of the 8 KV heads: half of each
    rank = rank_kv_spec(spec, ParallelConfig(tp=2), 1)
    assert rank.page_size_bytes // 16 == 98_304 and rank.layer_token_bytes(0) == per_layer // 2


class _CountingGroup:
    """A stand-in process group that counts all-reduces (each rank's partial sum stays)."""

    calls = 0

    def allreduce(self, tensors):
        _CountingGroup.calls += 1
        return self

    def wait(self):
        pass


def test_a_moe_layer_all_reduces_once_under_tp(moe):
    """The shared expert's and the routed experts' partial sums travel in one all-reduce."""
    cfg = ModelConfig.from_dir(moe[0])
    layer = Llama4MoE(cfg, torch.float32, TPGroup(0, 2, _CountingGroup()))
    layer(torch.randn(3, cfg.hidden_size))
    assert _CountingGroup.calls == 1
