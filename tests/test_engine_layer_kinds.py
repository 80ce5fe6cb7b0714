"""A model whose layers attend differently (Qwen2 with `layer_types` mixing sliding-window and
full layers) gives transformers' greedy tokens on every attention backend, with chunked
prefill, requests joining mid-run and pipeline stages holding different masks."""

import pytest

from shared.engine.llm import LLM
from shared.models.layer_attention import GLOBAL_MASK, SLIDING, AttentionMask
from shared.sampling.params import SamplingParams

from compilers import needs_compiler
from engine_helpers import (
    GREEDY_32,
    attention_backends,
    count_fused_calls,
    hf_greedy,
    make_prompts,
    new_engine,
    op_by_op,
    run_all,
    run_staggered,
)
from tiny_models import build_model

MIXED = dict(
    use_sliding_window=True,
    sliding_window=8,  # prompts of up to 60 tokens: most keys are outside the window
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    model_dir = build_model(tmp_path_factory.mktemp("model-qwen2-mixed"), "qwen2", **MIXED)
    prompts = make_prompts()
    return model_dir, prompts, hf_greedy(model_dir, prompts)


BACKENDS = ["torch", pytest.param("cpu_kernels", marks=needs_compiler)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_layers_match_transformers(mixed, backend):
    model_dir, prompts, refs = mixed
    engine = new_engine(model_dir, max_num_batched_tokens=24, attention_backend=backend)
    masks = [a.mask for a in engine.model_config.layer_attention]
    assert masks == [AttentionMask(SLIDING, 8), GLOBAL_MASK, AttentionMask(SLIDING, 8)]
    assert attention_backends(engine) == {backend}
    outputs: dict = {}
    run_staggered(engine, prompts, GREEDY_32, outputs)
    assert [outputs[str(i)] for i in range(len(prompts))] == refs
    assert engine.num_pages_used == 0


def test_pipeline_stages_build_their_own_layers_masks(mixed):
    """Two stages: rank 0 holds layers 0-1 (sliding, full), rank 1 layer 2 (sliding)."""
    model_dir, prompts, refs = mixed
    with LLM(model_dir, dtype="float32", pp=2, allow_oversubscribe=True, num_pages=256) as llm:
        assert llm.engine.runner.masks == (AttentionMask(SLIDING, 8), GLOBAL_MASK)
        outs = llm.generate(prompts, GREEDY_32)
        assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("mask", [GLOBAL_MASK, AttentionMask(SLIDING, 8)], ids=str)
def test_one_mask_for_all_layers_gives_other_tokens(mixed, mask):
    """The reference needs each layer's own mask: one for all (either) misses it."""
    model_dir, prompts, refs = mixed
    engine = new_engine(model_dir)
    model = engine.model.model
    model.masks = [mask] * len(model.masks)
    engine.runner.masks = (mask,)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY_32)
    outputs = run_all(engine)
    assert [outputs[str(i)] for i in range(len(prompts))] != refs


@needs_compiler
def test_mixed_bfloat16_layers_decode_fused_as_op_by_op(mixed, monkeypatch):
    """The fused decoder takes each mask's tables: a model mixing sliding and full layers
    decodes in its one call, with the op-by-op tokens and logprobs bit for bit."""
    model_dir, prompts, _ = mixed
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    outputs = []
    for fused in (True, False):
        engine = new_engine(model_dir, dtype="bfloat16")
        assert len(engine.model.model.fused.masks) == 2
        if not fused:
            op_by_op(engine)
        calls = count_fused_calls(monkeypatch)
        requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        run_all(engine)
        assert (len(prompts) in calls) == fused
        outputs.append([(r.output_token_ids, r.output_logprobs) for r in requests])
    assert outputs[0] == outputs[1]
