"""Greedy output of the engine equals transformers' generate token for token (float32)."""

import pytest
import torch

from shared.sampling.params import SamplingParams

from engine_helpers import GREEDY_32, hf_greedy, make_prompts, new_engine, run_all
from tiny_models import FAMILIES, load_hf


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache = {}

    def get(family):
        if family not in cache:
            model_dir = tiny_model_factory(family)
            cache[family] = (model_dir, make_prompts(), hf_greedy(model_dir, make_prompts()))
        return cache[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_prompts_match_transformers(references, family):
    model_dir, prompts, refs = references(family)
    engine = new_engine(model_dir)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
    outputs = run_all(engine)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_staggered_arrivals_match_transformers(references, family):
    """Requests join while others run (mixed prefill + decode steps), with chunked prefill."""
    model_dir, prompts, refs = references(family)
    engine = new_engine(model_dir, max_num_batched_tokens=24)
    outputs: dict = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
        for _ in range(3):  # let the earlier ones run a few steps first
            for s in engine.step():
                outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
    run_all(engine, outputs)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.num_pages_used == 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_preemption_with_tiny_pool_matches_transformers(references, family):
    model_dir, prompts, refs = references(family)
    engine = new_engine(model_dir, num_pages=12)  # 192 token slots for 8 requests of up to 92
    requests = [engine.add_request(str(i), p, GREEDY_32) for i, p in enumerate(prompts)]
    outputs = run_all(engine)
    assert sum(r.num_preemptions for r in requests) > 0, "the pool was meant to run out"
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.num_pages_used == 0


def test_bfloat16_logprobs_close_to_transformers(tiny_model_factory):
    """bf16: the engine's raw logprobs (top 5 at each of 8 steps) vs transformers' bf16
    log_softmax on the same tokens. Tolerance: 0.1 nats absolute (bf16 keeps 8 mantissa bits;
    logits here reach ~|20|, so one rounding step is ~0.08)."""
    model_dir = tiny_model_factory("llama")
    prompt = make_prompts([12])[0]
    engine = new_engine(model_dir, dtype="bfloat16")
    req = engine.add_request(
        "a", prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    )
    run_all(engine)
    hf = load_hf(model_dir, dtype=torch.bfloat16)
    tokens = prompt + req.output_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)
    worst = 0.0
    for step, lp in enumerate(req.output_logprobs):
        row = ref[len(prompt) - 1 + step]
        chosen = req.output_token_ids[step]
        worst = max(worst, abs(lp.logprob - row[chosen].item()))
        for token, value in lp.top:
            worst = max(worst, abs(value - row[token].item()))
    assert worst < 0.1, f"max |logprob difference| {worst:.3f}"
