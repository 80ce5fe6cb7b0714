"""Tensor x pipeline parallelism offline: greedy outputs of every shape equal transformers'
(float32), each rank holds ~1/(T*P) of the weights, bad shapes fail before any process starts,
and with P stages P micro-batches are in flight."""

import pytest
import torch

from shared.engine.batch import build_batch
from shared.engine.config import EngineConfig
from shared.engine.llm import LLM
from shared.engine.plan import decode_plan, encode_plan
from shared.engine.ranks import RankProcesses
from shared.engine.request import FinishReason
from shared.engine.shard import build_shard
from shared.errors import InvalidRequestError, ProcessStartError
from shared.models.config import ModelConfig
from shared.parallel.group import TPGroup
from shared.parallel.shape import ParallelConfig
from shared.sampling.params import SamplingParams

from engine_helpers import hf_greedy, make_prompts, new_engine

GREEDY = SamplingParams(temperature=0, max_tokens=12)
SHAPES = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def model4(tiny_model_factory):
    """4 layers and a wide MLP, so the vocabulary is a small part of the weights."""
    return tiny_model_factory("llama", num_hidden_layers=4, intermediate_size=256)


@pytest.fixture(scope="module")
def reference(model4):
    prompts = make_prompts([3, 17, 30, 45])
    return prompts, hf_greedy(model4, prompts, max_new_tokens=12)


@pytest.mark.parametrize("tp,pp", SHAPES)
def test_greedy_equals_transformers(model4, reference, tp, pp):
    """Chunked prefill (24-token budget) and decode, 4 requests, through the offline LLM."""
    prompts, refs = reference
    with LLM(
        model4, dtype="float32", tp=tp, pp=pp, allow_oversubscribe=True, max_num_batched_tokens=24
    ) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == refs
        assert llm.engine.num_pages_used == 0
        assert (llm.engine.runner.tp.shm is not None) == (tp > 1)  # same-host CPU ranks


def test_gloo_collectives_alone_equal_transformers_too(model4, reference, monkeypatch):
    """TISON_CPU_COLLECTIVES=gloo: the ranks' collectives without shared memory (the path of
    parts too large for its slots, shared/parallel/shm_group.py), every rank inheriting it."""
    monkeypatch.setenv("TISON_CPU_COLLECTIVES", "gloo")
    prompts, refs = reference
    with LLM(
        model4, dtype="float32", tp=2, pp=2, allow_oversubscribe=True, max_num_batched_tokens=24
    ) as llm:
        assert llm.engine.runner.tp.shm is None
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs


def test_pipeline_keeps_p_micro_batches_in_flight(model4, reference):
    prompts, refs = reference
    engine = new_engine(model4, pp=2, allow_oversubscribe=True)
    try:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, GREEDY)
        outputs, in_flight = {}, []
        while engine.has_unfinished():
            for s in engine.step():
                outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
            in_flight.append(engine.executor.num_in_flight)
        assert [outputs[str(i)] for i in range(len(prompts))] == refs
        # after each step one micro-batch was collected; the other was still running
        assert in_flight.count(1) >= len(in_flight) // 2, in_flight
    finally:
        engine.close()


@pytest.mark.parametrize("tp,pp", SHAPES[1:])
def test_each_rank_holds_its_share_of_the_weights(model4, tp, pp):
    """Shards built in-process (loading needs no collective): bytes per rank ~ total / (T*P)."""
    cfg = ModelConfig.from_dir(model4)
    config = EngineConfig(model_dir=model4, dtype="float32", num_pages=4)
    shape = ParallelConfig(tp, pp)

    def weight_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    whole, _ = build_shard(config, cfg, TPGroup(), ParallelConfig().stage_of(0, cfg.num_layers), 4)
    total = weight_bytes(whole)
    for rank in range(shape.world_size):
        tp_group = TPGroup(rank % tp, tp)  # no collective runs while loading
        model, _ = build_shard(config, cfg, tp_group, shape.stage_of(rank, cfg.num_layers), 4)
        share = weight_bytes(model) / total
        assert abs(share - 1 / (tp * pp)) < 0.15 / (tp * pp), (rank, share)


def test_tp_shards_are_slices_of_the_full_weights(model4):
    cfg = ModelConfig.from_dir(model4)
    config = EngineConfig(model_dir=model4, dtype="float32", num_pages=4)
    stage = ParallelConfig().stage_of(0, cfg.num_layers)
    whole, _ = build_shard(config, cfg, TPGroup(), stage, 4)
    halves = [build_shard(config, cfg, TPGroup(r, 2), stage, 4)[0] for r in range(2)]
    down = [m.model.layers[1].mlp.down_proj.weight for m in (whole, *halves)]
    assert torch.equal(torch.cat(down[1:], dim=1), down[0])  # row-parallel: input columns
    up = [m.model.layers[1].mlp.gate_up_proj.weight for m in (whole, *halves)]
    size = cfg.intermediate_size // 2  # each half: [gate shard; up shard]
    gate = torch.cat([h[:size] for h in up[1:]])
    assert torch.equal(gate, up[0][: cfg.intermediate_size])


@pytest.mark.parametrize(
    "options,flag",
    [
        (dict(tp=3), "--tp"),  # 4 heads
        (dict(tp=8, allow_oversubscribe=True), "--tp"),  # 8 does not divide 4 heads
        (dict(pp=5, allow_oversubscribe=True), "--pp"),  # 4 layers
        (dict(pp=2, pp_layers=(3, 3)), "--pp-layers"),
        (dict(tp=2, pp=64), "--pp"),
        (dict(dp=0), "--dp"),
        (dict(dp=2, tp=2, allow_oversubscribe=True), "--dp"),  # data parallel: T = P = 1
    ],
)
def test_bad_shapes_fail_naming_the_flag(model4, options, flag):
    with pytest.raises(InvalidRequestError) as e:
        new_engine(model4, **options)
    assert e.value.field == flag


def test_more_ranks_than_cores_needs_the_override(model4, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(InvalidRequestError, match="--allow-oversubscribe") as e:
        new_engine(model4, tp=2, pp=2)
    assert e.value.field == "--tp/--pp/--dp"


def test_step_plan_rebuilds_the_same_batch(model4):
    """A rank's ForwardBatch from the msgpack plan equals rank 0's from the scheduler."""
    engine = new_engine(model4, max_num_batched_tokens=20, page_size=4)
    for i, p in enumerate(make_prompts([5, 9, 13])):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, repetition_penalty=1.2))
    engine.step()
    out = engine.scheduler.schedule()  # decode rows plus a prefill chunk
    plan = decode_plan(encode_plan(7, out))
    mine, theirs = build_batch(out, 4), build_batch(plan.scheduler_output(), 4)
    assert plan.micro_batch == 7 and torch.equal(mine.input_ids, theirs.input_ids)
    assert torch.equal(mine.positions, theirs.positions)
    for mask, meta in mine.meta.by_mask.items():
        assert torch.equal(meta.slot_mapping, theirs.meta.of(mask).slot_mapping)
    assert mine.sample_index == theirs.sample_index
    sampled = [out.scheduled[i].request for i in mine.sample_index]
    assert [r.params for r in plan.rows] == [r.params for r in sampled]
    assert [list(r.prompt_token_ids) for r in plan.rows] == [r.prompt_token_ids for r in sampled]
    engine.close()


def test_abort_while_in_flight_frees_pages_and_emits_nothing(model4, reference):
    prompts, refs = reference
    engine = new_engine(model4, pp=2, allow_oversubscribe=True)
    try:
        for i, p in enumerate(prompts[:2]):
            engine.add_request(str(i), p, GREEDY)
        outputs = {}
        for s in engine.step():  # both micro-batches launched, the first collected
            outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
        assert engine.executor.num_in_flight == 1
        assert engine.abort("1")
        while engine.has_unfinished():
            for s in engine.step():
                outputs.setdefault(s.request.request_id, []).extend(s.new_token_ids)
        assert outputs["0"] == refs[0] and "1" not in outputs
        assert engine.num_pages_used == 0
    finally:
        engine.close()


def test_a_tp_rank_killed_mid_decode_fails_the_step_not_the_worker(model4, caplog):
    """Rank 1 (a child of rank 0, so a zombie until reaped) killed between decode steps: rank
    0's next shared-memory collective finds it gone within the wait's first looks (not after
    its 300 s timeout), the step's requests finish with an error, their pages go back."""
    engine = new_engine(model4, dtype="bfloat16", tp=2, allow_oversubscribe=True)
    try:
        assert engine.model.model.fused is not None  # decode steps in one call, all-reducing
        requests = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate([[5, 6], [7]])]
        engine.step()
        (child,) = engine.executor.ranks.procs
        child.kill()
        while engine.has_unfinished():
            engine.step()
        assert all(r.finish_reason == FinishReason.ERROR for r in requests)
        assert engine.num_pages_used == 0
        assert "rank 1's process is gone" in caplog.text
    finally:
        engine.close()


def test_a_rank_gone_while_the_groups_connect_fails_the_start(model4, monkeypatch):
    """Rank 1 killed once it joined, before rank 0 makes its groups: the engine's start fails
    naming it, instead of rank 0 waiting in gloo's connect for ever (IDLE_TIMEOUT)."""
    joined = RankProcesses._wait_keys

    def joined_then_killed(self, prefix):
        joined(self, prefix)
        if prefix == "joined":
            self.procs[0].kill()
            self.procs[0].wait()

    monkeypatch.setattr(RankProcesses, "_wait_keys", joined_then_killed)
    with pytest.raises(ProcessStartError, match="rank 1 exited"):
        new_engine(model4, tp=2, allow_oversubscribe=True)
