"""The fused decoder (kernels/cpu/decode_layer.c): a decode step's layers in one C call
give the op-by-op layers' output bit for bit, for every family's variant (MoE layers: the same
tokens, logprobs within a tolerance), on one and two threads, with requests joining while
others decode (steps of few tokens, prompts included, run fused; longer ones op by op), at
every tier this CPU runs."""

import ctypes

import pytest
import torch

from kernels.cpu import isa, library
from kernels.cpu.linear import linear_max_rows
from loadtest.bench_step_overhead import FUSED, OP_SECONDS, OPS
from shared.models.layers.decode_layer import FusedDecoder
from shared.models.layers.fused_call import FusedCall
from shared.sampling.params import SamplingParams

from compilers import needs_compiler
from engine_helpers import count_fused_calls, make_prompts, new_engine, op_by_op, run_all
from tiers import tier_params, use_tier

pytestmark = needs_compiler

VARIANTS = {  # family, overrides: each flag of the layer that the C code branches on
    "llama": ("llama", {}),
    "qkv bias": ("qwen2", {}),
    "q/k norms": ("qwen3", {}),
    "sliding window": ("mistral", {"sliding_window": 8}),
    "tied embeddings": ("llama_tied", {}),
    # not a multiple of 32: padded at load (models/packing.py), as the bundled model's 688
    "intermediate 80": ("llama", {"intermediate_size": 80}),
    # interleaved RoPE, L2-normed q and k after it, a NoPE layer with the query temperature,
    # chunks of 8 (most prompts cross several; pages of 4, so that each starts a page) beside a
    # global layer: two masks
    "llama 4": ("llama4", {}, {"page_size": 4}),
    # ... the chunked layers' KV from their window on, in page groups of the one pool
    "llama 4 capped": ("llama4", {}, {"page_size": 4, "cap_chunked_kv": True, "max_num_seqs": 8}),
}
MOE_VARIANTS = {  # moe.c: softmax top-k, renormalised or not, beside dense layers or not
    "mixtral": ("mixtral", {}),
    "qwen3_moe": ("qwen3_moe", {}),  # not renormalised; layer 1 dense
    "qwen3_moe renormalised": ("qwen3_moe", {"norm_topk_prob": True}),
    # sigmoid top-1 weighting each expert's input, beside a shared expert; layers 0, 2 dense
    "llama 4": ("llama4_moe", {}, {"page_size": 4}),
}
MOE_LOGPROB_TOL = 0.1  # nats: its routing weights round at other places than torch's softmax
ROWS_PREFILL_TOL = 0.1  # nats: prompts' KV from the C kernels as rows, or oneDNN and SDPA


def generate(
    model_dir, fused: bool, threads: int, prompts: list[list[int]], params=None, **options
) -> list:
    """Token ids and logprobs of requests for the prompts, the second half of them joining after
    the others decode (params: each prompt's, by default greedy with top-3 logprobs; options:
    the engine's)."""
    engine = new_engine(model_dir, dtype="bfloat16", **options)
    assert engine.model.model.fused is not None, "every layer's linears run on the C linear"
    if not fused:
        op_by_op(engine)
    greedy = SamplingParams(temperature=0, max_tokens=20, logprobs=3, ignore_eos=True)
    params = params or [greedy] * len(prompts)
    half = len(prompts) // 2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        requests = [engine.add_request(str(i), prompts[i], params[i]) for i in range(half)]
        for _ in range(6):
            engine.step()
        requests += [
            engine.add_request(str(i), prompts[i], params[i]) for i in range(half, len(prompts))
        ]
        run_all(engine)
    finally:
        torch.set_num_threads(previous)
    assert engine.num_pages_used == 0
    return [(r.output_token_ids, r.output_logprobs) for r in requests]


@pytest.mark.parametrize("tier", tier_params(emulated_amx=True))
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3 on 2 cores: groups taken from a preempted one
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_layer_gives_the_op_by_op_bits(
    tiny_model_factory, monkeypatch, variant, threads, tier
):
    fused, op_by_op = both_ways(tiny_model_factory, monkeypatch, VARIANTS[variant], threads, tier)
    assert op_by_op == fused


def both_ways(
    tiny_model_factory, monkeypatch, model, threads, tier, copies=1, prompts=None
) -> tuple[list, list]:
    """generate's outputs for model (family, overrides[, engine options]) at a tier, fused, then
    op by op, for the prompts (make_prompts()'s 8, `copies` times, by default)."""
    use_tier(tier, monkeypatch)
    family, overrides, options = (*model, {})[:3]
    model_dir = tiny_model_factory(family, **overrides)
    prompts = prompts or make_prompts() * copies
    gathered: list[bool] = []
    calls = count_fused_calls(monkeypatch, gathered)
    fused = generate(model_dir, True, threads, prompts, **options)
    assert len(prompts) in calls, "a decode step of all requests ran fused"
    assert all(gathered), "each fused call gathered its embedding rows"
    calls.clear()
    op_by_op = generate(model_dir, False, threads, prompts, **options)
    assert not calls
    return fused, op_by_op


@pytest.mark.parametrize("tier", tier_params(emulated_amx=True))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_fused_experts_give_the_op_by_op_tokens(
    tiny_model_factory, monkeypatch, variant, threads, tier
):
    """MoE layers in the fused call: the op-by-op tokens, their logprobs within
    MOE_LOGPROB_TOL (expf against torch's vectorised exp in the softmax moves a routing weight
    by an ulp, and a bf16 rounding downstream can flip)."""
    fused, op_by_op = both_ways(
        tiny_model_factory, monkeypatch, MOE_VARIANTS[variant], threads, tier
    )
    assert_same_tokens(fused, op_by_op)


@pytest.mark.parametrize("tier", tier_params(emulated_amx=True))
@pytest.mark.parametrize("variant", ["llama", "tied embeddings", "llama 4"])
def test_fused_head_samples_the_op_by_op_tokens(tiny_model_factory, monkeypatch, variant, tier):
    """The final norm, the LM head and the argmax in the fused call (LlamaForCausalLM.
    decode_logits, and decode-only steps' FusedCall): while the first half of the requests,
    plain greedy, decode alone, the call's argmax gives their tokens; once the others join
    (sampling at random with a seed, greedy with logprobs, prompts as decode rows of which
    only the last samples) the sampler takes the call's logits. Every token and logprob is
    the op-by-op one."""
    use_tier(tier, monkeypatch)
    family, overrides, options = (*VARIANTS[variant], {})[:3]
    model_dir = tiny_model_factory(family, **overrides)
    prompts = make_prompts()
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    drawn = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12) for i in range(2)]
    scored = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    params = [plain] * 4 + [drawn[0], scored, drawn[1], plain]
    heads: list[bool] = []  # a fused call's head: argmax (True) or logits only (False)
    original, persistent = FusedDecoder.__call__, FusedCall.__call__

    def counted(self, *args):
        if len(args) > 6 and args[6] is not None:
            heads.append(args[6].tokens is not None)
        return original(self, *args)

    def counted_persistent(self, num_rows, strides, greedy):
        heads.append(greedy)
        return persistent(self, num_rows, strides, greedy)

    monkeypatch.setattr(FusedDecoder, "__call__", counted)
    monkeypatch.setattr(FusedCall, "__call__", counted_persistent)
    fused = generate(model_dir, True, 2, prompts, params, **options)
    assert True in heads and False in heads
    heads.clear()
    assert generate(model_dir, False, 2, prompts, params, **options) == fused
    assert not heads


@pytest.mark.parametrize("tier", tier_params(emulated_amx=True))
def test_wide_steps_fused_and_op_by_op_agree(tiny_model_factory, monkeypatch, tier):
    """40 rows a step: avx2's outer products (packed x blocks, the last one partial; Mixtral's 4
    experts get 20 rows each on average, so its experts' linears take them too) in the fused
    call and op by op."""
    dense = both_ways(tiny_model_factory, monkeypatch, VARIANTS["llama"], 2, tier, copies=5)
    assert dense[0] == dense[1]
    moe = both_ways(tiny_model_factory, monkeypatch, MOE_VARIANTS["mixtral"], 2, tier, copies=5)
    assert_same_tokens(*moe)


@pytest.mark.parametrize("tier", tier_params())
def test_long_contexts_cut_in_spans_fused_and_op_by_op_agree(tiny_model_factory, monkeypatch, tier):
    """2 rows of 300-620 positions on 3 threads, fewer rows than the team: decode attention
    cuts them in spans of pages and merges the spans' softmaxes (flash decoding), in the fused
    call exactly as op by op."""
    model = ("llama", {"max_position_embeddings": 1024})
    prompts = make_prompts([600, 300], seed=1)
    fused, op_by_op = both_ways(tiny_model_factory, monkeypatch, model, 3, tier, prompts=prompts)
    assert op_by_op == fused


@pytest.mark.parametrize("tier", tier_params())
@pytest.mark.parametrize("moe", [False, True], ids=["llama", "llama 4 moe"])
def test_a_build_that_times_its_ops_decodes_the_same(tiny_model_factory, monkeypatch, tier, moe):
    """bench_step_overhead --ops runs the fused call of a build with -DTISON_OP_TIMES: it gives
    the tier's own build's tokens and logprobs, and its seconds land on the ops the layers run
    (the experts only where layers route; no all-reduce on one rank), while the tier's own
    build times nothing."""
    use_tier(tier, monkeypatch)
    family, overrides, options = MOE_VARIANTS["llama 4"] if moe else (*VARIANTS["llama"], {})
    model_dir = tiny_model_factory(family, **overrides)
    prompts = make_prompts()
    own = generate(model_dir, True, 2, prompts, **options)
    seconds = (ctypes.c_double * len(OPS))()
    assert library.functions[OP_SECONDS](seconds, len(OPS)) == 0
    timed = library.load_kernels(isa.BY_NAME[tier], ("-DTISON_OP_TIMES",))
    monkeypatch.setitem(library.functions, FUSED, timed[FUSED])
    timed[OP_SECONDS](seconds, len(OPS))  # from 0
    assert generate(model_dir, True, 2, prompts, **options) == own
    assert timed[OP_SECONDS](seconds, len(OPS)) == len(OPS)
    spent = dict(zip(OPS, seconds))
    ran = ["embed", "norm", "qkv", "rope", "kv write", "attention", "o", "head"]
    ran += ["gate_up", "act", "down"] + (["experts"] if moe else [])
    assert all(spent[op] > 0 for op in ran), spent
    assert spent["all-reduce"] == 0
    if not moe:
        assert spent["experts"] == 0


def assert_same_tokens(fused: list, op_by_op: list) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(fused, op_by_op):
        assert tokens == ref_tokens
        for ours, ref in zip(logprobs, ref_logprobs):
            assert ours.top_ids == ref.top_ids
            assert max(abs(a - b) for a, b in zip(ours.top_logprobs, ref.top_logprobs)) < (
                MOE_LOGPROB_TOL
            )


def test_mixed_and_oversized_steps_go_op_by_op():
    """Steps with a prefill chunk (one that prefills_as_rows did not make decode rows) under
    any of the layers' masks, a chunked row whose keys start inside a page, or more rows than
    the C linear takes, are not fused."""
    from shared.models.layer_attention import CHUNKED, GLOBAL_MASK, AttentionMask
    from shared.models.layers.attention import AttentionMetadata as Meta
    from shared.models.layers.attention import DecodeRows, PrefillSpan, StepMetadata

    chunked = AttentionMask(CHUNKED, 8)
    fused = FusedDecoder([], [GLOBAL_MASK, chunked, GLOBAL_MASK])
    assert fused.masks == [GLOBAL_MASK, chunked]

    def rows(first_key=None):
        table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
        return DecodeRows(None, table, lens, 16, None, first_key)

    def step(global_meta, chunked_meta):
        return StepMetadata({GLOBAL_MASK: global_meta, chunked: chunked_meta})

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    slots = torch.zeros(2, dtype=torch.long)
    decode = Meta(slots, rows(), [])
    assert fused.takes(x, step(decode, decode))
    span = PrefillSpan(0, 1, torch.zeros(1, dtype=torch.long), 1, None)
    assert not fused.takes(x, step(decode, Meta(slots, rows(), [span])))
    assert not fused.takes(x, step(Meta(slots, None, [span]), decode))
    inside = Meta(slots, rows(torch.tensor([0, 3], dtype=torch.int32)), [])
    assert not fused.takes(x, step(decode, inside))
    assert not fused.takes(x.float(), step(decode, decode))
    big = torch.zeros(linear_max_rows() + 1, 64, dtype=torch.bfloat16)
    assert not fused.takes(big, step(decode, decode))


def test_layers_one_call_cannot_take_stay_op_by_op():
    """FusedDecoder.build: no fused decoder where a layer cannot run fused, the layers attend
    with more masks than the call takes, or rotate by two interleaved embeddings (a step gives
    one cos/sin); a table RoPE and a NoPE layer beside one interleaved embedding do fit."""
    from kernels.cpu.decode_layer import MAX_MASKS, DecodeLayerSpec
    from shared.models.layer_attention import GLOBAL_MASK, SLIDING, AttentionMask
    from shared.models.layers.decode_layer import LayerPart
    from shared.models.layers.rotary import InterleavedRotaryEmbedding

    def part(rotary=None):
        return LayerPart(DecodeLayerSpec(), [], rotary)

    pairs = [InterleavedRotaryEmbedding(16, 10000.0, None) for _ in range(2)]
    assert FusedDecoder.build([part(), part(pairs[0])], [GLOBAL_MASK] * 2) is not None
    assert FusedDecoder.build([part(), None], [GLOBAL_MASK] * 2) is None
    assert FusedDecoder.build([], []) is None
    assert FusedDecoder.build([part(p) for p in pairs], [GLOBAL_MASK] * 2) is None
    windows = [AttentionMask(SLIDING, w + 1) for w in range(MAX_MASKS + 1)]
    assert FusedDecoder.build([part()] * MAX_MASKS, windows[:MAX_MASKS]) is not None
    assert FusedDecoder.build([part()] * (MAX_MASKS + 1), windows) is None


def test_a_step_of_short_prompts_runs_fused_and_writes_their_kv(tiny_model_factory, monkeypatch):
    """A step whose tokens the fused call takes runs there prompts included, each prompt token a
    decode row over its context so far (batch.prefills_as_rows): the first step of four prompts
    (27 tokens) is one fused call, and each request then decodes the tokens of an engine
    whose prompts take prefill attention (SDPA), within bf16's rounding of their logprobs."""
    model_dir = tiny_model_factory("llama")
    prompts = make_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    outputs = {}
    for rows_prefill in (True, False):
        engine = new_engine(model_dir, dtype="bfloat16")
        assert engine.model.model.fused_rows >= sum(map(len, prompts))
        if not rows_prefill:
            engine.model.model.fused_rows = 0  # prompts take prefill attention, op by op
        calls = count_fused_calls(monkeypatch)
        requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        engine.step()
        assert calls == ([sum(map(len, prompts))] if rows_prefill else [])
        run_all(engine)
        assert engine.num_pages_used == 0
        outputs[rows_prefill] = [(r.output_token_ids, r.output_logprobs) for r in requests]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(outputs[True], outputs[False]):
        assert tokens == ref_tokens
        gaps = [abs(ours.logprob - ref.logprob) for ours, ref in zip(logprobs, ref_logprobs)]
        assert max(gaps) < ROWS_PREFILL_TOL


def test_decode_layers_names_what_is_wrong_with_a_head():
    """decode_layers checks its LM head before the C call reads any of it."""
    from kernels.cpu.decode_layer import DecodeLayerSpec, LMHead, StepMask, decode_layers

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight = torch.zeros(100, 64, dtype=torch.bfloat16)
    logits = torch.zeros(2, 100, dtype=torch.bfloat16)
    norm = (torch.ones(64, dtype=torch.bfloat16), 1e-5)

    def call(head, final_norm=norm):
        positions = torch.zeros(2, dtype=torch.long)
        specs = (DecodeLayerSpec * 1)()
        decode_layers(specs, x, x.clone(), False, positions, ((), ()), [StepMask()], 16,
                      final_norm=final_norm, head=head)  # fmt: skip

    with pytest.raises(ValueError, match="the LM head needs final_norm"):
        call(LMHead(weight, None, logits), None)
    with pytest.raises(ValueError, match=r"head's weight must be contiguous bf16 \(V, 64\)"):
        call(LMHead(weight[:, :32], None, logits))
    with pytest.raises(ValueError, match="head's logits"):
        call(LMHead(weight, None, logits.float()))
    with pytest.raises(ValueError, match="head's logits"):
        call(LMHead(weight, torch.tensor([1]), logits))  # one row picked: logits (1, 100)
    with pytest.raises(ValueError, match="head's rows"):
        call(LMHead(weight, torch.tensor([0, 1], dtype=torch.int32), logits))
    with pytest.raises(ValueError, match="head's tokens"):
        call(LMHead(weight, None, logits, torch.zeros(3, dtype=torch.long)))


def test_decode_layers_refuses_a_token_or_position_out_of_range():
    """The C call gathers the embedding rows and reads the rotary tables unchecked, so it
    checks the step's token ids and positions first, before it reads a layer."""
    from kernels.cpu.decode_layer import DecodeLayerSpec, Embedding, StepMask, decode_layers

    specs = (DecodeLayerSpec * 1)()  # no weights: the call must stop before reading one
    specs[0].hidden = 64
    table = torch.zeros(100, 64, dtype=torch.bfloat16)

    def call(ids, positions, max_positions=0, dtype=torch.long):
        residual = torch.empty(len(ids), 64, dtype=torch.bfloat16)
        embed = Embedding(table, torch.tensor(ids, dtype=dtype))
        decode_layers(specs, embed, residual, True, torch.tensor(positions), (None, None),
                      [StepMask()], 16, max_positions=max_positions)  # fmt: skip

    with pytest.raises(IndexError, match="a token id outside the embedding's 100 rows"):
        call([5, 100], [0, 1])
    with pytest.raises(IndexError, match="a token id outside"):
        call([-1], [0])
    with pytest.raises(IndexError, match=r"a position outside \[0, 8\) \(rotary tables\)"):
        call([5, 6], [7, 8], max_positions=8)
    with pytest.raises(IndexError, match="a position outside"):
        call([5], [-1], max_positions=8)
    with pytest.raises(ValueError, match="token ids must be contiguous int64"):
        call([5], [0], dtype=torch.int32)
