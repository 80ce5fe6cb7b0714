"""The fused decoder under tensor parallelism (kernels/cpu/decode_layer.c with all_reduce.c):
each rank runs its shards of a decode step's layers in one C call, all-reducing through the
ranks' shared memory where the op-by-op layers all-reduce. On 2 ranks (and 2 x 2 stages) of
real processes it gives the op-by-op bits (`decode_graphs="off"`, every rank op by op; MoE
families: the same tokens, logprobs within test_decode_layer's tolerance), and the ranks'
collectives stay in step with the op-by-op steps of prompts between. Under gloo alone (no
shared memory) the layers stay op by op."""

import pytest
from test_decode_layer import assert_same_tokens

from kernels.cpu.linear import linear_max_rows
from shared.sampling.params import SamplingParams

from compilers import needs_compiler
from engine_helpers import count_fused_calls, make_prompts, new_engine, run_all

pytestmark = needs_compiler

LONG = {"max_position_embeddings": 1024}  # long_prompts at every tier, and 16 tokens more
FAMILIES = {  # family, overrides, engine options: every MLP kind and both attention kinds
    "llama": ("llama", LONG, {}),
    "qkv bias": ("qwen2", LONG, {}),
    "q/k norms": ("qwen3", LONG, {}),
    "mixtral": ("mixtral", LONG, {}),
    # experts of 32: a rank's 16, padded to the C linear's 32 (models/packing.py's pad_experts)
    "qwen3_moe": ("qwen3_moe", LONG, {}),
    # chunked + NoPE layers, L2 norms, a shared expert whose partial sum joins the routed one's;
    # experts and shared expert of 96: a rank's 48, padded to 64 (the shared one as dense MLPs)
    "llama 4": ("llama4_moe", LONG, {"page_size": 4, "num_pages": 2048}),
}


def long_prompts(seed: int = 0) -> list[list[int]]:
    """4 prompts longer than a fused step's rows (64 to 512 by tier): shorter ones would run
    as decode rows in the fused engine (shared/engine/batch.py's prefills_as_rows) and as
    prefills op by op; these are prefills both ways, and only the decode steps differ."""
    rows = linear_max_rows()
    return make_prompts([rows + 1, rows + 4, rows + 9, rows + 20], seed=seed)


def generate(model_dir, prompts, params=None, **options) -> list:
    """Greedy token ids and top-3 logprobs (or as params says), in bf16, the second half of
    the prompts joining after the first half decoded a few steps (steps of prompts between
    fused ones)."""
    engine = new_engine(model_dir, dtype="bfloat16", allow_oversubscribe=True, **options)
    params = params or SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    half = len(prompts) // 2
    try:
        fused = engine.model.model.fused
        assert (fused is not None) == (options.get("decode_graphs") != "off")
        requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts[:half])]
        for _ in range(5):
            engine.step()
        requests += [
            engine.add_request(str(i), p, params) for i, p in enumerate(prompts[half:], half)
        ]
        run_all(engine)
        assert engine.num_pages_used == 0
        return [(r.output_token_ids, r.output_logprobs) for r in requests]
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_fused_gives_the_op_by_op_outputs(tiny_model_factory, monkeypatch, family):
    name, overrides, options = FAMILIES[family]
    model_dir = tiny_model_factory(name, **overrides)
    prompts = long_prompts()
    calls = count_fused_calls(monkeypatch)
    fused = generate(model_dir, prompts, tp=2, **options)
    assert len(prompts) in calls, "a decode step of all requests ran fused"
    op_by_op = generate(model_dir, prompts, tp=2, decode_graphs="off", **options)
    if name in ("mixtral", "qwen3_moe", "llama4_moe"):
        assert_same_tokens(fused, op_by_op)
    else:
        assert fused == op_by_op


def test_tp2_pp2_fused_gives_the_op_by_op_bits(tiny_model_factory):
    model_dir = tiny_model_factory("llama", num_hidden_layers=4, **LONG)
    prompts = long_prompts(seed=1)
    fused = generate(model_dir, prompts, tp=2, pp=2)
    assert fused == generate(model_dir, prompts, tp=2, pp=2, decode_graphs="off")


def test_pp2_fused_head_gives_the_op_by_op_bits(tiny_model_factory):
    """Two stages of one rank each: the last stage's fused call takes the first's hidden states
    on through the final norm, the LM head and the argmax of greedy requests without logprobs
    (LlamaForCausalLM.decode_logits, with the stage's hidden and residual)."""
    model_dir = tiny_model_factory("llama", num_hidden_layers=4, **LONG)
    prompts = long_prompts(seed=2)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fused = generate(model_dir, prompts, params, pp=2)
    assert fused == generate(model_dir, prompts, params, pp=2, decode_graphs="off")


def test_gloo_alone_stays_op_by_op(tiny_llama, monkeypatch):
    """Without shared memory the all-reduces are gloo's, which the C call cannot make."""
    monkeypatch.setenv("TISON_CPU_COLLECTIVES", "gloo")
    engine = new_engine(tiny_llama, dtype="bfloat16", tp=2, allow_oversubscribe=True)
    try:
        assert engine.runner.tp.shm is None and engine.model.model.fused is None
    finally:
        engine.close()
