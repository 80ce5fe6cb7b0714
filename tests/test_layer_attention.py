"""Per-layer attention (shared/models/layer_attention.py): each layer's mask and RoPE as
transformers derives them from config.json, the masks against a brute-force reference, and a
step's attention on every backend (global, sliding, chunked layers; chunks that start pages
and chunks that do not) against attention computed query by query over the visible keys."""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from kernels.cpu import attention as cpu_attention
from shared.engine.batch import ROW_KEYS, build_batch, prefills_as_rows
from shared.engine.plan import PlannedSeq
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.errors import ModelFolderError
from shared.models.config import ModelConfig
from shared.models.layer_attention import (
    CHUNKED,
    GLOBAL,
    GLOBAL_MASK,
    SLIDING,
    AttentionMask,
    LayerAttention,
    distinct_masks,
    layers_from_hf,
)
from shared.models.layers.attention_backend import CpuKernelBackend, TorchBackend

from compilers import needs_compiler

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
MASKS = [
    GLOBAL_MASK,
    AttentionMask(SLIDING, 5),
    AttentionMask(CHUNKED, 8),  # chunks start pages (page size 4)
    AttentionMask(CHUNKED, 6),  # they do not
]


def brute_visible(mask: AttentionMask, q: int, k: int) -> bool:
    if k > q:
        return False
    if mask.kind == SLIDING:
        return q - k < mask.window
    if mask.kind == CHUNKED:
        return math.floor(q / mask.window) == math.floor(k / mask.window)
    return True


@pytest.mark.parametrize("mask", MASKS[1:] + [AttentionMask(CHUNKED, 1)], ids=str)
def test_masks_match_brute_force(mask):
    pos = torch.arange(40)
    seen = mask.visible(pos[:, None], pos[None, :])
    ref = torch.tensor([[brute_visible(mask, q, k) for k in range(40)] for q in range(40)])
    assert torch.equal(seen, ref)
    for q in range(40):
        assert mask.first_key(q) == min(k for k in range(40) if ref[q, k])


def test_mask_values_are_checked():
    with pytest.raises(ValueError):
        AttentionMask(SLIDING, None)
    with pytest.raises(ValueError):
        AttentionMask(GLOBAL, 4)
    with pytest.raises(ValueError):
        AttentionMask("local", 4)


def hf_kinds(config) -> list[str]:
    kinds = {"full_attention": GLOBAL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED}
    return [kinds[t] for t in config.layer_types]


@pytest.mark.parametrize(
    "fields",
    [
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
        dict(use_sliding_window=False, sliding_window=8, max_window_layers=2),
        dict(
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ],
)
def test_qwen2_layers_as_transformers_derives_them(fields):
    config = transformers.Qwen2Config(num_hidden_layers=4, **fields)
    for raw in (fields, config.to_dict()):  # as written by hand, and as transformers saves it
        layers = layers_from_hf(dict(raw, model_type="qwen2"), 4, "config.json")
        assert [a.mask.kind for a in layers] == hf_kinds(config)
        assert all(a.mask.window == 8 for a in layers if a.mask.kind == SLIDING)
        assert all(a.rope for a in layers)


def test_mistral_slides_on_every_layer_or_none():
    assert (
        layers_from_hf({"sliding_window": 8}, 3, "c")
        == (LayerAttention(AttentionMask(SLIDING, 8)),) * 3
    )
    assert layers_from_hf({"sliding_window": None}, 3, "c") == (LayerAttention(),) * 3


def test_llama4_scout_chunked_rope_layers_and_global_nope_layers():
    """36 layers chunked (8192) with RoPE, every 4th global without (fixtures/README.md)."""
    raw = json.loads((FIXTURES / "llama-4-scout.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    hf = transformers.Llama4TextConfig(**raw["text_config"])
    assert [a.mask.kind for a in cfg.layer_attention] == hf_kinds(hf)
    assert [int(a.rope) for a in cfg.layer_attention] == hf.no_rope_layers
    assert distinct_masks(cfg.layer_attention) == (AttentionMask(CHUNKED, 8192), GLOBAL_MASK)
    nope = [i for i, a in enumerate(cfg.layer_attention) if not a.rope]
    assert nope == list(range(3, 48, 4))
    assert all(a.mask == GLOBAL_MASK for a in cfg.layer_attention if not a.rope)


def test_other_fixtures_attend_globally():
    for name in ("llama-3.1-8b.json", "deepseek-v3.json"):
        raw = json.loads((FIXTURES / name).read_text())
        cfg = ModelConfig.from_dict(raw)
        assert set(cfg.layer_attention) == {LayerAttention()}, name


def test_bad_layer_types_name_the_field():
    with pytest.raises(ModelFolderError, match="layer type 'local_attention'"):
        layers_from_hf({"layer_types": ["local_attention"]}, 1, "c")
    with pytest.raises(ModelFolderError, match="layer_types has 1 entries, not 2"):
        layers_from_hf({"layer_types": ["full_attention"]}, 2, "c")


# --- a step's attention on each backend against attention query by query ---

PAGE, NH, NKV, HD = 4, 4, 2, 16
# (start, tokens this step, context after the step): decode rows and prefill chunks, mixed
SEQS = [(21, 1, 22), (10, 7, 17), (8, 1, 9), (0, 5, 5), (30, 1, 31), (13, 14, 27)]


def step_case(seed: int = 0):
    """A step over SEQS (each on shuffled pages, its cached prefix already in the pool) ->
    (the scheduler output, q, k, v of the step's tokens, the pool, every position's K/V)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(64, generator=g).tolist()
    kv_layer = torch.zeros(2, 64, PAGE, NKV, HD)
    pool = kv_layer.view(2, -1, NKV, HD)
    scheduled, keys, qs, ks, vs = [], [], [], [], []
    for i, (start, n, ctx) in enumerate(SEQS):
        page_ids = pages[: -(-ctx // PAGE) + 1]  # one page more than the context needs
        pages = pages[len(page_ids) :]
        kv = torch.randn(2, ctx, NKV, HD, generator=g)  # K/V of every position
        slots = torch.tensor([page_ids[p // PAGE] * PAGE + p % PAGE for p in range(start)])
        pool[:, slots.long()] = kv[:, :start]
        seq = PlannedSeq(str(i), start, list(range(start, ctx)), page_ids, True)
        scheduled.append(ScheduledRequest(seq, start, n, True))
        keys.append(kv)
        qs.append(torch.randn(n, NH, HD, generator=g))
        ks.append(kv[0, start:])
        vs.append(kv[1, start:])
    out = SchedulerOutput(scheduled)
    return out, torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_layer, keys


def brute_attention(q, keys, mask: AttentionMask) -> torch.Tensor:
    """Each query row of each sequence, softmax over its visible keys (float64)."""
    rows = []
    for (start, n, _), kv in zip(SEQS, keys):
        for p in range(start, start + n):
            seen = [k for k in range(p + 1) if brute_visible(mask, p, k)]
            k, v = kv[0, seen].double(), kv[1, seen].double()  # (m, nkv, hd)
            k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
            rows.append((k, v))
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, (k, v) in enumerate(rows):
        scores = torch.einsum("hd,mhd->hm", q[row].double(), k) * HD**-0.5
        out[row] = torch.einsum("hm,mhd->hd", scores.softmax(-1), v)
    return out


BACKENDS = {
    "torch": TorchBackend,
    "cpu_kernels": pytest.param(CpuKernelBackend, marks=needs_compiler),
}


@pytest.mark.parametrize("as_rows", [False, True], ids=["prefill chunks", "prompts as rows"])
@pytest.mark.parametrize("backend", BACKENDS.values(), ids=BACKENDS.keys())
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_step_attention_matches_query_by_query(backend, mask, as_rows):
    """Decode rows and prefill chunks mixed; or, where the step is short enough for the fused
    decoder (max_rows), every prompt token a decode row over its context so far."""
    out, q, k, v, kv_layer, keys = step_case()
    batch = build_batch(out, PAGE, MASKS, max_rows=len(q) if as_rows else 0)
    assert list(batch.meta.by_mask) == MASKS
    meta = batch.meta.of(mask)
    got = backend().forward(q, k, v, kv_layer, meta, HD**-0.5)
    torch.testing.assert_close(got.double(), brute_attention(q, keys, mask), rtol=1e-5, atol=1e-5)
    assert (meta.decode.rows is None) == as_rows and (not meta.prefills) == as_rows
    if mask.kind == CHUNKED:
        aligned = mask.window % PAGE == 0  # then the C kernel decodes the rows itself
        assert (meta.decode.first_key is None) == aligned


@needs_compiler
def test_kernel_backend_decodes_in_one_pass_where_the_mask_allows(monkeypatch):
    """Global, sliding and page-aligned chunked rows decode in the C kernel; a chunked layer
    whose chunks do not start pages has the kernel write the K/V and torch decode."""
    out, q, k, v, kv_layer, _ = step_case()
    batch = build_batch(out, PAGE, MASKS)
    calls = []
    original = cpu_attention.paged_attention

    def counted(*args, **kwargs):
        calls.append("block_table" in kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "paged_attention", counted)
    backend = CpuKernelBackend()
    for mask in MASKS:
        backend.forward(q, k, v, kv_layer, batch.meta.of(mask), HD**-0.5)
    assert calls == [True, True, True, False]


def test_prompts_become_rows_only_in_a_short_step_that_reads_few_keys():
    """prefills_as_rows: not without a fused decoder (max_rows 0), not in a step of decode
    rows only, nor one of more tokens than it takes, nor where the rows would read more than
    ROW_KEYS keys (a row attends to its whole context)."""
    out = step_case()[0]  # 29 tokens: prompt chunks of 7 from 10, 5 from 0, 14 from 13
    assert prefills_as_rows(out, 29) and prefills_as_rows(out, 64)
    assert not prefills_as_rows(out, 28) and not prefills_as_rows(out, 0)
    decode_only = SchedulerOutput([s for s in out.scheduled if s.num_tokens == 1])
    assert not prefills_as_rows(decode_only, 64)
    seq = PlannedSeq("long", 8000, list(range(20)), list(range(2100)), True)
    late = SchedulerOutput([ScheduledRequest(seq, 8000, 20, True)])  # 20 rows of ~8K keys
    assert 20 * 8020 > ROW_KEYS and not prefills_as_rows(late, 64)


def test_a_uniform_model_builds_one_metadata():
    out = step_case()[0]
    batch = build_batch(out, PAGE)
    assert list(batch.meta.by_mask) == [GLOBAL_MASK]
