"""Decode graphs (shared/engine/graphs.py) through their CPU mode: `decode_graphs="on"` runs
every decode-only step through the static buffers and padding that CUDA graphs replay, so the
buffer filling, the padded rows on the scratch page and the PP stage's hidden buffers are
checked here against transformers, on every CI machine."""

import pytest
import torch

from shared.engine.graphs import DecodeGraphs, graph_sizes
from shared.sampling.params import SamplingParams

from engine_helpers import (
    assert_logprobs_match,
    make_prompts,
    new_engine,
    reference_getter,
    run_staggered,
)

LENGTHS = [1, 3, 7, 16, 17, 30]  # 6 requests: batches of 1-6 rows, padded to 1, 2, 4, 8
PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5)


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    return reference_getter(tiny_model_factory, LENGTHS, max_new_tokens=12)


def count_runs(monkeypatch) -> list[tuple[int, int]]:
    """From now on, each graph step appends (its rows, the size it ran at)."""
    runs: list[tuple[int, int]] = []
    original = DecodeGraphs.run

    def counted(self, batch, *args):
        n = len(batch.input_ids)
        runs.append((n, next(s for s in self.sizes if s >= n)))
        return original(self, batch, *args)

    monkeypatch.setattr(DecodeGraphs, "run", counted)
    return runs


def test_graph_sizes_cover_max_num_seqs():
    assert graph_sizes(1) == (1,)
    assert graph_sizes(6) == (1, 2, 4, 6)
    assert graph_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert graph_sizes(1000)[-1] == 256


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_graph_steps_equal_transformers(reference, monkeypatch, family, backend):
    """Staggered arrivals: batches grow and shrink, so each size's buffers hold rows a larger
    step left behind; every token and logprob still matches transformers."""
    model_dir, prompts, refs, logits = reference(family)
    runs = count_runs(monkeypatch)
    engine = new_engine(model_dir, decode_graphs="on", attention_backend=backend, max_num_seqs=8)
    try:
        assert engine.runner.graphs is not None and engine.runner.graphs.sizes == (1, 2, 4, 8)
        assert engine.kv.num_pages == engine.allocator.num_pages + 1  # the scratch page
        reqs = run_staggered(engine, prompts, PARAMS)
    finally:
        engine.close()
    for req, tokens, lg in zip(reqs, refs, logits):
        assert_logprobs_match(req, tokens[: len(req.output_token_ids)], lg[: len(tokens)])
    assert {size for _, size in runs} >= {1, 2, 4}  # sizes 1 to 4 ran, padded ones too
    assert any(n < size for n, size in runs)


def test_padded_rows_touch_only_the_scratch_page(tiny_llama):
    """After a padded step, every page but the scratch page holds what an eager engine wrote."""
    prompts = make_prompts([5, 9, 20])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    pools = []
    for mode in ("off", "on"):
        engine = new_engine(tiny_llama, decode_graphs=mode, num_pages=16, max_num_seqs=4)
        try:
            for i, p in enumerate(prompts):  # 3 rows decode together: padded to 4
                engine.add_request(str(i), p, params)
            while engine.has_unfinished():
                engine.step()
            pools.append(engine.kv.data[..., :16, :, :, :].clone())  # (L, 2, 16 pages, ...)
        finally:
            engine.close()
    eager, graphs = pools
    torch.testing.assert_close(graphs, eager, atol=1e-5, rtol=0)


def test_pipeline_stages_take_hidden_states_into_their_buffers(reference):
    """PP = 2: the second stage's graphs read the first stage's hidden states from buffers."""
    model_dir, prompts, refs, logits = reference("llama")
    engine = new_engine(model_dir, decode_graphs="on", pp=2, allow_oversubscribe=True)
    try:
        reqs = run_staggered(engine, prompts, PARAMS)
    finally:
        engine.close()
    for req, tokens, lg in zip(reqs, refs, logits):
        assert_logprobs_match(req, tokens[: len(req.output_token_ids)], lg[: len(tokens)])


def test_chunked_layers_and_prefill_workers_decode_eagerly(tiny_model_factory, tiny_llama):
    engine = new_engine(tiny_model_factory("llama4"), decode_graphs="on")
    try:
        assert engine.runner.graphs is None  # chunked layers: tables differ row by row
    finally:
        engine.close()
    engine = new_engine(tiny_llama, decode_graphs="off")
    try:
        assert engine.runner.graphs is None and engine.kv.num_pages == 256
    finally:
        engine.close()
