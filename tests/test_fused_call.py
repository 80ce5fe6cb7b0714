"""Decode-only steps over persistent inputs (shared/engine/decode_inputs.py, shared/models/
layers/fused_call.py): the rows written in place are build_batch's metadata, steps the call
cannot take change nothing it reads, and an engine decoding through it gives the tokens and
logprobs of the same fused call fed by build_batch (LlamaForCausalLM.decode_logits) bit for
bit, with requests joining, leaving and sampling every way."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels.cpu.decode_layer import int_array
from shared.engine.batch import build_batch
from shared.engine.decode_inputs import DecodeInputs
from shared.engine.request import Request
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.models.layer_attention import CHUNKED, GLOBAL_MASK, SLIDING, AttentionMask
from shared.models.layers.fused_call import FusedCall
from shared.models.layers.rotary import InterleavedRotaryEmbedding, QueryTemperature
from shared.sampling.params import SamplingParams

from compilers import needs_compiler
from engine_helpers import make_prompts, new_engine, run_all

PAGE = 4
MASKS = (
    GLOBAL_MASK,
    AttentionMask(SLIDING, 6),
    AttentionMask(CHUNKED, 8),  # each chunk starts a page
    AttentionMask(CHUNKED, 8, group=1),  # a capped chunked layer's page group
)


def buffers(masks, rows: int = 8, max_pages: int = 16) -> SimpleNamespace:
    """The inputs a FusedCall holds, as it allocates them (filled with a marker, -7)."""
    full = lambda dtype, n=rows: torch.full((n,), -7, dtype=dtype)  # noqa: E731
    return SimpleNamespace(
        masks=list(masks), rows=rows, max_pages=max_pages, ids=full(torch.int64),
        positions=full(torch.int64), slots=[full(torch.int64) for _ in masks],
        context_lens=[full(torch.int32) for _ in masks],
        tables=[full(torch.int32, rows * max_pages) for _ in masks],
    )  # fmt: skip


def decoding(rng: random.Random, i: int, prompt_len: int, num_output: int) -> ScheduledRequest:
    """A request decoding its newest output token, its pages shuffled: position
    prompt_len + num_output - 1, all its pages held, and a capped chunk group's from the
    current chunk's first page on."""
    req = Request(
        str(i), [rng.randrange(100) for _ in range(prompt_len)], SamplingParams(), 0,
        frozenset(), 1 << 20, i,
    )  # fmt: skip
    req.output_token_ids = [rng.randrange(100) for _ in range(num_output)]
    position = req.num_tokens - 1
    held = position // PAGE + 1
    req.page_ids = rng.sample(range(1, 400), held)
    req.chunk_first_page = position // 8 * 8 // PAGE
    req.chunk_page_ids = [rng.sample(range(400, 800), held - req.chunk_first_page)]
    req.num_computed_tokens = position
    return ScheduledRequest.of(req, 1)


def test_rows_written_are_build_batchs_metadata():
    rng = random.Random(0)
    for _ in range(30):
        scheduled = [
            decoding(rng, i, rng.randrange(1, 30), rng.randrange(1, 12))
            for i in range(rng.randrange(1, 9))
        ]
        call = buffers(MASKS)
        inputs = DecodeInputs(call, PAGE)
        n = inputs.fill(scheduled)
        assert n == len(scheduled)
        batch = build_batch(SchedulerOutput(scheduled), PAGE, MASKS)
        assert call.ids[:n].tolist() == batch.input_ids.tolist()
        assert call.positions[:n].tolist() == batch.positions.tolist()
        for i, mask in enumerate(MASKS):
            meta = batch.meta.of(mask)
            decode = meta.decode
            assert decode.rows is None and decode.first_key is None
            assert call.slots[i][:n].tolist() == meta.slot_mapping.tolist()
            assert call.context_lens[i][:n].tolist() == decode.context_lens.tolist()
            width = inputs.strides[i]
            table = call.tables[i][: n * width].view(n, width)
            for row, want, context in zip(table, decode.block_table, decode.context_lens):
                used = -(-int(context) // PAGE)  # the pages the kernel reads
                assert row[:used].tolist() == want[:used].tolist()


def test_steps_it_cannot_take_change_nothing():
    rng = random.Random(1)
    call = buffers(MASKS, rows=4, max_pages=4)
    inputs = DecodeInputs(call, PAGE)
    before = [t.clone() for t in (call.ids, call.positions, *call.slots, *call.tables)]
    prompt = decoding(rng, 0, 9, 2)
    prompt = ScheduledRequest(prompt.request, 5, 1, False)  # a prompt token as a row
    wide = decoding(rng, 1, 20, 1)  # 20 positions: 5 pages of the global mask, 4 wide at most
    misaligned = buffers([AttentionMask(CHUNKED, 6)])  # position 8: chunk 6..11, mid-page
    two = ScheduledRequest(decoding(rng, 2, 9, 2).request, 8, 2, True)
    for step in (
        [decoding(rng, 3, 3, 1)] * 5,  # more rows than it holds
        [decoding(rng, 4, 5, 2), prompt],
        [wide],
        [two],
        [],
    ):
        assert inputs.fill(step) == 0
    assert DecodeInputs(misaligned, PAGE).fill([decoding(rng, 5, 8, 1)]) == 0
    after = [t.clone() for t in (call.ids, call.positions, *call.slots, *call.tables)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_cos_sin_into_gives_cos_sin_rows_bits():
    """The rows' RoPE pairs as the persistent call computes them (numpy around torch's cos and
    sin) are cos_sin_rows' bits, odd widths (torch's vector loop and scalar tail) included."""
    for head_dim, factor, interleaved in ((64, 1.0, True), (20, 0.7, True), (20, 1.0, False)):
        rope = InterleavedRotaryEmbedding(head_dim, 500000.0, None, interleaved, factor)
        for n in (1, 3, 8, 17, 40):
            positions = np.random.default_rng(n).integers(0, 10_000_000, n)
            want = rope.cos_sin_rows(torch.from_numpy(positions))
            out = np.full((48, want.shape[1]), np.nan, dtype=np.float32)
            rope.cos_sin_into(positions, out)
            assert torch.equal(torch.from_numpy(out[:n]), want)
            assert np.isnan(out[n:]).all()


def test_query_temperature_into_gives_its_bits():
    """Llama 4's NoPE factors as the persistent call computes them (numpy around torch's log1p)
    are the torch function's bits, at Scout's settings and the tiny models', from the first
    positions (factor 1) to millions, odd counts (torch's vector loop and scalar tail)."""
    for floor_scale, attn_scale in ((8192, 0.1), (4, 0.1), (4, 0.12), (3, 0.37)):
        temperature = QueryTemperature(floor_scale, attn_scale)
        for n in (1, 3, 8, 17, 40):
            positions = np.random.default_rng(n).integers(0, 10_000_000, n)
            positions[0] = 0
            want = temperature(torch.from_numpy(positions)).flatten()
            out = np.full(48, np.nan, dtype=np.float32)
            temperature.into(positions, out)
            assert torch.equal(torch.from_numpy(out[:n]), want)
            assert np.isnan(out[n:]).all()


VARIANTS = {
    "llama": ("llama", {}, {}),
    "sliding window": ("mistral", {"sliding_window": 8}, {}),
    # two masks, interleaved RoPE pairs and the NoPE layers' temperatures from the positions
    "llama 4": ("llama4", {}, {"page_size": 4}),
    "llama 4 capped": ("llama4", {}, {"page_size": 4, "cap_chunked_kv": True, "max_num_seqs": 8}),
    "mixtral": ("mixtral", {}, {}),
}


@needs_compiler
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_steps_through_persistent_inputs_give_decode_logits_bits(
    tiny_model_factory, monkeypatch, variant
):
    family, overrides, options = VARIANTS[variant]
    model_dir = tiny_model_factory(family, **overrides)
    prompts = make_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    params = [
        greedy,
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=11, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=6),  # stop ids masked till 6
        SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=10, ignore_eos=True),
    ] + [greedy] * 3
    outputs, rows = [], []  # rows: each decode-only step's in the persistent call
    original = FusedCall.__call__

    def counted(self, num_rows, strides, greedy):
        rows.append(num_rows)
        return original(self, num_rows, strides, greedy)

    monkeypatch.setattr(FusedCall, "__call__", counted)
    for persistent in (True, False):
        engine = new_engine(model_dir, dtype="bfloat16", **options)
        assert engine.runner.decode is not None
        if not persistent:
            engine.runner.decode = None  # decode steps: build_batch, then decode_logits
        requests = [engine.add_request(str(i), prompts[i], params[i]) for i in range(4)]
        for _ in range(5):
            engine.step()
        requests += [engine.add_request(str(i), prompts[i], params[i]) for i in range(4, 8)]
        run_all(engine)
        assert engine.num_pages_used == 0
        outputs.append([(r.output_token_ids, r.output_logprobs) for r in requests])
        assert (4 in rows and 8 in rows) == persistent  # decode-only steps of 4, then of 8
        rows.clear()
    assert outputs[0] == outputs[1]


@needs_compiler
def test_the_call_names_a_bad_row_count_or_position(tiny_model_factory):
    engine = new_engine(tiny_model_factory("llama"), dtype="bfloat16")
    call = engine.runner.decode.call
    strides = [1] * len(call.masks)
    for rows in (0, call.rows + 1):
        with pytest.raises(ValueError, match="rows"):
            call(rows, strides, True)
    call.context_lens[0][0] = 1
    call.positions[0] = 1 << 40
    with pytest.raises(IndexError, match="position"):
        call(1, strides, True)
    call.positions[0], call.ids[0] = 0, 1 << 40
    with pytest.raises(IndexError, match="token id"):
        call(1, strides, True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("after", make_prompts()[0], greedy)  # the engine decodes on
    assert len(run_all(engine)["after"]) == 4 and engine.num_pages_used == 0


def test_int_array_is_the_tensors_memory():
    """The persistent inputs' rows are written and the greedy tokens read through ctypes
    arrays over the tensors (int_array): the same memory, both ways."""
    t = torch.zeros(6, dtype=torch.int32)
    a = int_array(t)
    a[:3] = [1, -2, 3]
    t[4] = 9
    assert t.tolist() == [1, -2, 3, 0, 9, 0] and a[:6] == t.tolist()
    wide = int_array(torch.full((2,), 1 << 40, dtype=torch.int64))
    assert wide[:2] == [1 << 40] * 2
    for bad in (torch.zeros(4), torch.zeros(8, dtype=torch.int64)[::2]):
        with pytest.raises(ValueError, match="int_array"):
            int_array(bad)
