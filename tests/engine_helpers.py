"""Shared helpers of the engine tests: prompts, HF greedy references, running an engine."""

import torch

from kernels.cpu.decode_layer import Embedding
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.models.layers.decode_layer import FusedDecoder
from shared.models.layers.fused_call import FusedCall
from shared.models.layers.moe import FusedMoE
from shared.sampling.params import SamplingParams

from tiny_models import load_hf

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 30, 45, 60]
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32)
# float32 logprobs of the engine and transformers agree within this (nats, absolute): the
# largest difference measured on the tiny models is 3.1e-5 (portable tier; at most 2.1e-5 at
# the other tiers and on the torch ops), so 1e-4 leaves 3x for other CPUs' rounding.
LOGPROB_TOL = 1e-4
# Every greedy choice of a reference beats the runner-up logit by this much: two tokens' logprobs
# each within LOGPROB_TOL cannot swap, so greedy parity does not hinge on float32 rounding.
MIN_TOP_GAP = 2 * LOGPROB_TOL


# (tp, pp, ep, dp) of the MoE families' parallel parity tests: 2 TP ranks, 2 stages, 2 TP ranks
# holding whole experts, 2 data-parallel ranks (each its own requests; experts whole on them)
SHAPES = [(2, 1, False, 1), (1, 2, False, 1), (2, 1, True, 1), (1, 1, False, 2)]


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0, vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy_logits(
    model_dir, prompts: list[list[int]], max_new_tokens: int = 32, eos: int = 2
) -> list[tuple[list[int], torch.Tensor]]:
    """transformers generate(do_sample=False) per prompt: the new tokens, cut after the first EOS
    (the engine stops there), and the float32 logits (n, V) each was chosen from. Fails if a
    choice is a near-tie (top-1 - top-2 below MIN_TOP_GAP): the model cannot test parity there."""
    hf = load_hf(model_dir)
    refs = []
    for i, p in enumerate(prompts):
        out = hf.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, len(p) :].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new
        logits = torch.cat(out.logits[: len(new)])  # (n, V)
        top2 = logits.topk(2, dim=-1).values
        gaps = top2[:, 0] - top2[:, 1]
        step = int(gaps.argmin())
        assert gaps[step] > MIN_TOP_GAP, (
            f"near-tie in the reference of prompt {i} at step {step}: top-1 - top-2 = "
            f"{float(gaps[step]):.2g} <= MIN_TOP_GAP ({MIN_TOP_GAP})"
        )
        refs.append((new, logits))
    return refs


def reference_getter(make_dir, lengths=PROMPT_LENGTHS, max_new_tokens: int = 32):
    """name -> (model folder, prompts, transformers' greedy outputs, the float32 logits of
    each output), computed once per name; make_dir(name) builds the folder."""
    cache = {}

    def get(name):
        if name not in cache:
            model_dir, prompts = make_dir(name), make_prompts(lengths)
            refs = hf_greedy_logits(model_dir, prompts, max_new_tokens=max_new_tokens)
            cache[name] = model_dir, prompts, [r for r, _ in refs], [x for _, x in refs]
        return cache[name]

    return get


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int = 32) -> list[list[int]]:
    """hf_greedy_logits without the logits."""
    return [new for new, _ in hf_greedy_logits(model_dir, prompts, max_new_tokens)]


def new_engine(model_dir, **options) -> LLMEngine:
    options.setdefault("dtype", "float32")
    options.setdefault("num_pages", 256)  # 4k token slots: the default pool takes 0.5 s to zero
    return LLMEngine(EngineConfig(model_dir=model_dir, **options))


def run_all(engine: LLMEngine, outputs: dict | None = None) -> dict[str, list[int]]:
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for s in engine.step():
            outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
    return outputs


def run_staggered(engine: LLMEngine, prompts, params, outputs: dict | None = None) -> list:
    """Each prompt joins after the earlier ones ran 3 steps (so steps mix prefill chunks and
    decode rows), then all run to the end. Returns the requests; `outputs` (request id ->
    tokens) collects every step's new tokens."""
    outputs = {} if outputs is None else outputs
    requests = []
    for i, p in enumerate(prompts):
        requests.append(engine.add_request(str(i), p, params))
        for _ in range(3):
            for s in engine.step():
                outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
    run_all(engine, outputs)
    return requests


def attention_backends(engine: LLMEngine) -> set[str]:
    """The names of the attention backends rank 0's layers run on."""
    return {layer.self_attn.attn.backend.name for layer in engine.model.model.layers}


def bf16_logprobs_and_hf(
    engine: LLMEngine, model_dir, prompt: list[int], max_tokens: int = 8
) -> tuple[torch.Tensor, dict[torch.dtype, torch.Tensor]]:
    """The engine's greedy logprobs (top 5 and the chosen token at each step; NaN elsewhere)
    and transformers' log_softmax at bf16 and float32 on the same tokens, each (steps + 1, V)."""
    req = engine.add_request(
        "a",
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5, ignore_eos=True),
    )
    run_all(engine)
    tokens = torch.tensor([prompt + req.output_token_ids])
    ref = {}
    for dtype in (torch.bfloat16, torch.float32):
        with torch.no_grad():
            logits = load_hf(model_dir, dtype=dtype)(tokens).logits[0].float()
        ref[dtype] = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 :]
    ours = torch.full_like(ref[torch.float32], float("nan"))
    for step, lp in enumerate(req.output_logprobs):
        for token, value in [(lp.token_id, lp.logprob), *zip(lp.top_ids, lp.top_logprobs)]:
            ours[step, token] = value
    return ours, ref


def bf16_logprob_errors(engine: LLMEngine, model_dir, prompt: list[int]) -> dict[str, float]:
    """The largest absolute difference over the logprobs a bf16 engine returned (greedy, 8
    tokens, top 5): "ours-bf16", "ours-fp32" and "bf16-fp32" (transformers' own)."""
    ours, ref = bf16_logprobs_and_hf(engine, model_dir, prompt)
    seen = ~ours.isnan()

    def worst(a, b):
        return (a - b)[seen].abs().max().item()

    bf16, fp32 = ref[torch.bfloat16], ref[torch.float32]
    return {
        "ours-bf16": worst(ours, bf16),
        "ours-fp32": worst(ours, fp32),
        "bf16-fp32": worst(bf16, fp32),
    }


def assert_logprobs_match(req, tokens: list[int], logits: torch.Tensor) -> None:
    """A finished request's greedy tokens equal the reference's, and its logprobs (the chosen
    token's and the top 5) equal log_softmax(logits) (n, V) within LOGPROB_TOL; its top-5 ids
    are the reference's up to ties: the engine's j-th id has the reference's j-th logprob."""
    close = dict(atol=LOGPROB_TOL, rtol=0)
    assert req.output_token_ids == tokens
    ref = torch.log_softmax(logits, dim=-1)  # (n, V)
    chosen = torch.tensor([lp.logprob for lp in req.output_logprobs])  # (n,)
    torch.testing.assert_close(chosen, ref[torch.arange(len(tokens)), tokens], **close)
    top_ids = torch.tensor([lp.top_ids for lp in req.output_logprobs])  # (n, 5)
    top = torch.tensor([lp.top_logprobs for lp in req.output_logprobs])  # (n, 5)
    ref_at_ours = ref.gather(1, top_ids)  # (n, 5)
    torch.testing.assert_close(top, ref_at_ours, **close)
    ties = dict(atol=2 * LOGPROB_TOL, rtol=0)  # swapped ids: each logprob off by LOGPROB_TOL
    torch.testing.assert_close(ref_at_ours, ref.topk(5, dim=-1).values, **ties)


def count_fused_calls(monkeypatch, gathered: list[bool] | None = None) -> list[int]:
    """From now on in the test, each fused decode call (a FusedDecoder's, or a decode-only
    step's FusedCall over the persistent inputs) appends its row count to the list, and to
    `gathered` whether it gathered its embedding rows itself (an Embedding input)."""
    calls: list[int] = []
    original, persistent = FusedDecoder.__call__, FusedCall.__call__

    def counted(self, *args, **kwargs):
        calls.append(len(args[0]))  # positions: one a row
        if gathered is not None:
            gathered.append(isinstance(args[1], Embedding))
        return original(self, *args, **kwargs)

    def counted_persistent(self, num_rows, *args):
        calls.append(num_rows)
        if gathered is not None:
            gathered.append(True)  # the call's input is always its ids' embedding rows
        return persistent(self, num_rows, *args)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)
    monkeypatch.setattr(FusedCall, "__call__", counted_persistent)
    return calls


def op_by_op(engine: LLMEngine) -> None:
    """Every step of `engine` from now on runs its layers op by op: neither its fused decoder
    nor the one call of decode-only steps (the runner's persistent inputs)."""
    engine.model.model.fused = None
    engine.runner.decode = None


def assert_data_parallel(engine: LLMEngine, dp: int) -> None:
    """Every one of dp ranks admitted requests into its own pool, which holds no page now, and
    rank 0 holds 1/dp of each MoE layer's experts."""
    pools = engine.allocator.pools
    assert len(pools) == dp and all(p.stats.queried_requests for p in pools)
    assert all(p.num_used == 0 for p in pools)
    moe = [m for m in engine.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.w13.shape[0] * dp == m.num_experts for m in moe)
