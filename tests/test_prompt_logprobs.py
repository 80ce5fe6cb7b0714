"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' float32 log_softmax of the
logits at each prompt position: chunk by chunk, beside requests that do not ask, with the
prefix cache on (hits skipped), after preemption (none twice), on a colocated reservation whose
prefix was cached, with pipeline stages, tensor-parallel and data-parallel ranks, and through
the offline LLM."""

import pytest
import torch

from shared.engine.llm import LLM
from shared.engine.prompt_logprobs import score_prompts
from shared.engine.request import PromptTargets
from shared.errors import InvalidRequestError
from shared.sampling.params import MAX_LOGPROBS, SamplingParams

from engine_helpers import LOGPROB_TOL, make_prompts, new_engine, run_all
from tiny_models import load_hf

TOP = 5
ASK = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP)
PLAIN = SamplingParams(temperature=0, max_tokens=4)
LENGTHS = [1, 7, 30, 45]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def references(model):
    """(prompts, each one's transformers log_softmax at its positions but the last (P - 1, V))."""
    prompts = make_prompts(LENGTHS)
    hf = load_hf(model)
    with torch.no_grad():
        refs = [
            torch.log_softmax(hf(torch.tensor([p])).logits[0, :-1].float(), -1) for p in prompts
        ]
    return prompts, refs


def assert_matches(values, prompt: list[int], ref: torch.Tensor, top: int = TOP) -> None:
    """values: one TokenLogprob per prompt token from the second on, equal to ref (P - 1, V):
    the token's logprob, and the top `top` (its ids the reference's up to ties)."""
    close = dict(atol=LOGPROB_TOL, rtol=0)
    assert [v.token_id for v in values] == prompt[1:]
    if not values:
        return
    rows = torch.arange(len(values))
    chosen = torch.tensor([v.logprob for v in values])  # (P - 1,)
    torch.testing.assert_close(chosen, ref[rows, prompt[1:]], **close)
    top_ids = torch.tensor([v.top_ids for v in values])  # (P - 1, top)
    top_values = torch.tensor([v.top_logprobs for v in values])  # (P - 1, top)
    assert top_ids.shape == (len(values), top)
    ref_at_ours = ref.gather(1, top_ids)
    torch.testing.assert_close(top_values, ref_at_ours, **close)
    ties = dict(atol=2 * LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(ref_at_ours, ref.topk(top, dim=-1).values, **ties)


def run_collecting(engine) -> dict[str, list[list]]:
    """Runs to the end; request id -> the prompt logprobs of each StepOutput that had some."""
    chunks: dict[str, list[list]] = {}
    while engine.has_unfinished():
        for s in engine.step():
            if s.prompt_logprobs:
                chunks.setdefault(s.request.request_id, []).append(s.prompt_logprobs)
    return chunks


def test_chunked_prefill_beside_requests_that_do_not_ask(model, references):
    """A 16-token budget: the 30 and 45-token prompts score theirs over several steps, each
    step's StepOutput carrying that chunk's; the others' prompts score nothing."""
    prompts, refs = references
    engine = new_engine(model, max_num_batched_tokens=16)
    asks = [engine.add_request(f"a{i}", p, ASK) for i, p in enumerate(prompts)]
    plain = [engine.add_request(f"p{i}", p, PLAIN) for i, p in enumerate(prompts)]
    chunks = run_collecting(engine)
    for i, (req, prompt, ref) in enumerate(zip(asks, prompts, refs)):
        assert_matches(req.prompt_logprobs, prompt, ref)
        streamed = [v for chunk in chunks.get(f"a{i}", []) for v in chunk]
        assert streamed == req.prompt_logprobs
    assert len(chunks["a3"]) >= 3  # 44 values, at most 16 a step
    assert all(r.prompt_logprobs == [] for r in plain)
    assert not any(rid.startswith("p") for rid in chunks)
    assert [r.output_token_ids for r in asks] == [r.output_token_ids for r in plain]
    assert engine.num_pages_used == 0


def test_prefix_cache_hits_are_skipped_but_pages_still_published(model, references):
    prompts, refs = references
    engine = new_engine(model, enable_prefix_caching=True)
    first = engine.add_request("first", prompts[3], ASK)
    run_all(engine)
    again = engine.add_request("again", prompts[3], ASK)
    run_all(engine)
    assert engine.prefix_stats()["hit_tokens"] == 0  # neither looked its prefix up in the cache
    plain = engine.add_request("plain", prompts[3], PLAIN)
    run_all(engine)
    assert engine.prefix_stats()["hit_tokens"] == 32  # first's 2 full pages were published
    for req in (first, again):
        assert_matches(req.prompt_logprobs, prompts[3], refs[3])
    assert plain.output_token_ids == first.output_token_ids


def test_preemption_recomputes_without_adding_any_twice(model, references):
    """A pool of 6 pages (96 token slots) for 4 prompts of 1-45 tokens decoding 24 more, in
    8-token chunks: requests are preempted mid-prompt and mid-decode and recomputed."""
    prompts, refs = references
    engine = new_engine(model, num_pages=6, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=TOP, ignore_eos=True)
    reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    chunks = run_collecting(engine)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to run out"
    for i, (req, prompt, ref) in enumerate(zip(reqs, prompts, refs)):
        assert_matches(req.prompt_logprobs, prompt, ref)
        assert [v for chunk in chunks.get(str(i), []) for v in chunk] == req.prompt_logprobs
    assert engine.num_pages_used == 0


def test_colocated_reservation_computes_its_cached_prefix_too(model, references):
    """A decode worker's reservation holds the prompt's cached pages (a prefill worker would
    skip writing them); computing it here (start_local) for prompt logprobs scores every
    position all the same. A prefill-only request scores them all too."""
    prompts, refs = references
    engine = new_engine(model, enable_prefix_caching=True)
    engine.add_request("warm", prompts[3], PLAIN)
    run_all(engine)
    assert engine.reserve("local", prompts[3], ASK).cached_tokens == 32
    assert engine.start_local("local")
    prefill = engine.add_request("prefill", prompts[3], ASK, prefill_only=True)
    local = engine.requests["local"]
    run_all(engine)
    for req in (local, prefill):
        assert_matches(req.prompt_logprobs, prompts[3], refs[3])
    assert len(prefill.output_token_ids) == 1
    assert engine.num_pages_used == 0


def test_a_remote_prefill_s_prompt_logprobs_are_kept_not_recomputed(model, references):
    """Decode side of a handoff: the prefill worker's prompt logprobs arrive with the first
    token and stay on the request, so a recompute after preemption scores none of the prompt
    again and may start on the prefix cache."""
    prompts, _ = references
    prefill = new_engine(model)
    done = prefill.add_request("r", prompts[3], ASK, prefill_only=True)
    run_all(prefill)
    decode = new_engine(model, enable_prefix_caching=True)
    decode.reserve("r", prompts[3], ASK)
    req = decode.start_remote("r", done.output_token_ids[0], None, tuple(done.prompt_logprobs))
    assert req.prompt_logprobs == done.prompt_logprobs and not req.needs_prompt_logprobs
    assert req.prompt_targets(0, len(prompts[3])) is None
    decode.abort("r")


@pytest.mark.parametrize("tp,pp,dp", [(1, 2, 1), (2, 1, 1), (1, 1, 2)])
def test_parallel_ranks_equal_one_rank(model, references, tp, pp, dp):
    """PP=2: the last stage scores the prompts and sends the values back with the samples;
    TP=2: rank 0 scores them from the gathered logits (every rank joins the gather); DP=2: each
    rank computes its own requests, rank 0 scores them all from the gathered hidden states."""
    prompts, refs = references
    engine = new_engine(
        model, tp=tp, pp=pp, dp=dp, allow_oversubscribe=True, max_num_batched_tokens=16
    )
    try:
        asks = [engine.add_request(f"a{i}", p, ASK) for i, p in enumerate(prompts)]
        plain = engine.add_request("plain", prompts[2], PLAIN)
        chunks = run_collecting(engine)
    finally:
        engine.close()
    single = new_engine(model, max_num_batched_tokens=16)
    ones = [single.add_request(f"a{i}", p, ASK) for i, p in enumerate(prompts)]
    run_all(single)
    for req, one, prompt, ref in zip(asks, ones, prompts, refs):
        assert_matches(req.prompt_logprobs, prompt, ref)
        assert [v.token_id for v in req.prompt_logprobs] == [
            v.token_id for v in one.prompt_logprobs
        ]
        ours = torch.tensor([[v.logprob, *v.top_logprobs] for v in req.prompt_logprobs]).view(-1)
        theirs = torch.tensor([[v.logprob, *v.top_logprobs] for v in one.prompt_logprobs]).view(-1)
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOL, rtol=0)
    assert plain.prompt_logprobs == [] and "plain" not in chunks
    assert len(chunks["a3"]) >= 3


def test_offline_llm_returns_them(model, references):
    prompts, refs = references
    with LLM(model, dtype="float32", num_pages=64, max_num_batched_tokens=16) as llm:
        asked, plain = llm.generate([prompts[2], prompts[2]], [ASK, PLAIN])
    assert_matches(asked.prompt_logprobs, prompts[2], refs[2])
    assert plain.prompt_logprobs is None
    assert asked.token_ids == plain.token_ids


def test_top_zero_keeps_only_the_prompt_tokens(model, references):
    prompts, refs = references
    engine = new_engine(model)
    req = engine.add_request("z", prompts[1], SamplingParams(max_tokens=1, prompt_logprobs=0))
    run_all(engine)
    assert_matches(req.prompt_logprobs, prompts[1], refs[1], top=0)


def test_slices_bound_the_logits(monkeypatch):
    """score_prompts in 3-row slices (the rows of two requests, top 2 and top 4, straddle the
    slice ends): each compute_logits call gets at most 3 rows, and every value is the
    log_softmax of the whole batch's logits."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)  # (H,) -> (V,)
    hidden = torch.randn(12, 8)  # (T, H)
    rows = [(0, 1, PromptTargets(4, [5, 6, 7, 8, 9], 2)), (2, 7, PromptTargets(0, [1, 2, 3], 4))]
    calls = []

    def logits(h):
        calls.append(len(h))
        return head(h)

    with torch.no_grad():
        chunks = score_prompts(hidden, rows, logits, 50, max_rows=3)
        ref = torch.log_softmax(head(hidden), -1)  # (T, V)
    assert calls == [3, 3, 2]
    assert [(c.index, c.first) for c in chunks] == [(0, 4), (2, 0)]
    for (_, row, targets), chunk in zip(rows, chunks):
        n = targets.num_top
        for r, (token, v) in enumerate(zip(targets.target_ids, chunk.values), start=row):
            assert v.token_id == token
            assert v.logprob == pytest.approx(float(ref[r, token]), abs=1e-6)
            top = ref[r].topk(n)
            assert v.top_ids == tuple(top.indices.tolist())
            assert v.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 1.5, "3"])
def test_bad_prompt_logprobs_name_the_field(bad):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
