"""The C CPU kernels (kernels/cpu/*.c) against their torch references."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import library
from kernels.cpu.activation import silu_mul
from kernels.cpu.argmax import argmax
from kernels.cpu.attention import attention_supported, paged_attention
from kernels.cpu.norm import rms_norm
from kernels.cpu.rope import rope
from shared.models.layers.attention import DecodeRows
from shared.models.layers.attention_backend import TorchBackend
from shared.models.layers.rotary import RotaryEmbedding, _rotate

from compilers import needs_compiler
from tiers import tier_params, use_tier

pytestmark = needs_compiler
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=tier_params())
def build(request, monkeypatch):
    """Every test runs on each tier's build this CPU can run (portable, AVX2, AVX-512, ...),
    each a different library; the tiers it cannot run are skipped with the reason."""
    use_tier(request.param, monkeypatch)
    return request.param


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def assert_close_ulp(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: a few ulp; bfloat16: at most one rounding step apart (sums in another order)."""
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 200, generator=g).to(dtype)
    residual = torch.randn(37, 200, generator=g).to(dtype)
    weight = (1 + torch.randn(200, generator=g) / 4).to(dtype)
    assert_close_ulp(rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))
    total = x + residual
    out = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, total)  # the sum is left in the residual's storage
    assert_close_ulp(out, hf_rms_norm(total, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_of_a_strided_view(dtype):
    """Qwen3's q/k norm: (T, heads, hd) heads inside the wider qkv rows."""
    qkv = torch.randn(5, 7 * 32).to(dtype)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # row stride 7 * 32
    weight = torch.rand(32).to(dtype)
    assert_close_ulp(rms_norm(q, weight, 1e-5), hf_rms_norm(q, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_the_torch_rotation_bit_for_bit(dtype):
    rotary = RotaryEmbedding(64, 512, 10000.0, None, dtype)
    qkv = torch.randn(9, (6 + 2 * 2) * 64).to(dtype)
    q = qkv[:, : 6 * 64].view(9, 6, 64)  # strided views, as split from the qkv projection
    k = qkv[:, 6 * 64 : 8 * 64].view(9, 2, 64)
    positions = torch.tensor([0, 1, 2, 100, 101, 7, 511, 3, 4])
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    q_out, k_out = rope(q, k, positions, rotary.cos, rotary.sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, _rotate(q, cos, sin))
    assert torch.equal(k_out, _rotate(k, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    x = (torch.randn(33, 2 * 300) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])  # the exp's clamped ends
    gate, up = x.chunk(2, dim=-1)
    assert_close_ulp(silu_mul(x), F.silu(gate) * up)


def paged_case(contexts, nh, nkv, hd, page_size, dtype, seed=0):
    """A pool with random K/V and, per row, random distinct pages covering its context."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-c // page_size) for c in contexts]
    num_pages = sum(pages_per_row) + 3
    kv_layer = torch.randn(2, num_pages, page_size, nkv, hd, generator=g).to(dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    width = max(pages_per_row)
    table = []
    for n in pages_per_row:
        row, order = order[:n], order[n:]
        table.append(row + [0] * (width - n))
    return kv_layer, torch.tensor(table, dtype=torch.int32)


def unread_slots(kv_layer: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The slots of the pages that no row of the table reads."""
    page_size = kv_layer.shape[2]
    read = set(table.flatten().tolist())
    unread = [p for p in range(kv_layer.shape[1]) if p not in read]
    return (torch.tensor(unread)[:, None] * page_size + torch.arange(page_size)).flatten()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nh,nkv,hd,page_size,window",
    [(4, 4, 16, 4, None), (12, 4, 64, 16, None), (8, 1, 128, 16, None), (6, 2, 32, 8, 5)]
    + [(4, 2, 16, 32, None)],  # pages longer than the kernel's 16-key blocks
)
def test_paged_attention_matches_sdpa_over_gathered_pages(dtype, nh, nkv, hd, page_size, window):
    """A mixed batch of 8 tokens: 6 decode rows (their own tokens already in the pool) and 2
    prefill tokens; all 8 tokens' K/V are written first, into a page no row reads."""
    contexts = [1, 7, 16, 17, 40, 3]  # inside one page, page ends, several pages
    kv_layer, table = paged_case(contexts, nh, nkv, hd, page_size, dtype)
    rows = torch.tensor([6, 0, 2, 7, 3, 5])
    q = torch.randn(8, nh, hd).to(dtype)
    k, v = torch.randn(2, 8, nkv, hd).to(dtype)
    slots = unread_slots(kv_layer, table)[:8]
    d = DecodeRows(rows, table, torch.tensor(contexts, dtype=torch.int32), page_size, window)
    ref = TorchBackend.decode(q[rows], kv_layer, d, hd**-0.5)
    out = torch.full_like(q, 7.0)
    paged_attention(q, k, v, kv_layer, slots, hd**-0.5, out, **d.kernel_args())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[rows].float(), ref.float(), rtol=tol, atol=tol)
    assert (out[[1, 4]] == 7.0).all()  # rows that do not decode are left alone
    pool = kv_layer.view(2, -1, nkv, hd)
    assert torch.equal(pool[0, slots], k) and torch.equal(pool[1, slots], v)


def decode_against_sdpa(kv_layer, table, contexts, q, window=None, page_size=16):
    """Runs the kernel on decode rows 0..B-1 of q (B, nh, hd) -> (ours, the torch reference)."""
    nkv, hd = kv_layer.shape[3], q.shape[2]
    d = DecodeRows(None, table, torch.tensor(contexts, dtype=torch.int32), page_size, window)
    ref = TorchBackend.decode(q, kv_layer, d, hd**-0.5)
    k = v = torch.zeros(len(contexts), nkv, hd, dtype=q.dtype)
    slots = unread_slots(kv_layer, table)[:1].repeat(len(contexts))
    out = torch.empty_like(q)
    paged_attention(q, k, v, kv_layer, slots, hd**-0.5, out, **d.kernel_args())
    return out.float(), ref.float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 100])
def test_paged_attention_over_many_pages(dtype, window):
    """Contexts of up to 128 pages (and a window across pages): the one pass's many blocks."""
    contexts = [300, 2048, 1, 33]
    kv_layer, table = paged_case(contexts, 12, 4, 64, 16, dtype, seed=2)
    q = torch.randn(4, 12, 64).to(dtype)
    ours, ref = decode_against_sdpa(kv_layer, table, contexts, q, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("growth", [0.05, 3.0])
def test_paged_attention_maximum_late_and_far_apart(dtype, growth):
    """Keys whose scores grow along the context, so the running maximum rises block after
    block and the sums so far are rescaled each time; growth 3: scores spread over thousands,
    most of them far below the maximum (their weights underflow to 0, nothing overflows)."""
    contexts = [700, 40, 257]
    kv_layer, table = paged_case(contexts, 8, 2, 32, 16, dtype, seed=3)
    q = torch.ones(3, 8, 32).to(dtype)
    pool, g = kv_layer.view(2, -1, 16, 2, 32), torch.Generator().manual_seed(4)
    for row, ctx in enumerate(contexts):
        pos = torch.arange(ctx)
        pages, offsets = table[row, pos // 16].long(), pos % 16
        # key at position p: p * growth (+ noise) in every lane -> score ~ p * growth * sqrt(32)
        ramp = (pos * growth)[:, None, None] + torch.randn(ctx, 2, 32, generator=g) * 0.1
        pool[0, pages, offsets] = ramp.to(dtype)
    ours, ref = decode_against_sdpa(kv_layer, table, contexts, q)
    assert torch.isfinite(ours).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # scores up to ~10^4: float32's ulp there
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


def test_paged_attention_many_rows_uses_whole_row_tasks_alike():
    """Enough rows for one task per row (all KV heads) on 2 threads: same result."""
    contexts = [5 + 13 * i for i in range(20)]
    kv_layer, table = paged_case(contexts, 8, 2, 32, 16, torch.float32, seed=1)
    q = torch.randn(20, 8, 32)
    d = DecodeRows(None, table, torch.tensor(contexts, dtype=torch.int32), 16, None)
    ref = TorchBackend.decode(q, kv_layer, d, 0.1)
    k = v = torch.zeros(20, 2, 32)
    slots = unread_slots(kv_layer, table)[:1].repeat(20)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty_like(q)
            paged_attention(q, k, v, kv_layer, slots, 0.1, out, **d.kernel_args())
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 290])
@pytest.mark.parametrize("threads", [4, 7])
def test_paged_attention_rows_cut_in_spans_merge_as_one(dtype, window, threads):
    """Fewer rows than threads: each row's context is cut in spans of pages, the spans' softmax
    parts merged after (flash decoding); rows shorter than the longest have fewer spans, a
    window starts a row's spans mid-page, and scores that grow along the context give each
    span another maximum, far apart (weights of the early spans underflow to 0)."""
    contexts = [2048, 40, 700]
    kv_layer, table = paged_case(contexts, 8, 2, 32, 16, dtype, seed=5)
    pool, g = kv_layer.view(2, -1, 16, 2, 32), torch.Generator().manual_seed(6)
    pos = torch.arange(2048)  # row 0 (2 or 3 spans, or 2 of 160 in the window): growing keys
    ramp = (pos * 0.5)[:, None, None] + torch.randn(2048, 2, 32, generator=g) * 0.1
    pool[0, table[0, pos // 16].long(), pos % 16] = ramp.to(dtype)
    q = torch.randn(3, 8, 32, generator=g).to(dtype)
    q[0] = 0.2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours, ref = decode_against_sdpa(kv_layer, table, contexts, q, window)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(ours).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6])
def test_timed_attention_calls_give_paged_attentions_bits(dtype, rows):
    """tk_attention_timed (loadtest/bench_attention.py's calls in one team) leaves what
    paged_attention gives for its last block table, one row cut in spans or several whole, and
    a time for each call."""
    contexts = [300 + 37 * i for i in range(rows)]
    kv_layer, first = paged_case(contexts, 12, 4, 64, 16, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    tables = torch.stack([first[:, torch.randperm(first.shape[1], generator=g)] for _ in range(3)])
    lens, q = torch.tensor(contexts, dtype=torch.int32), torch.randn(rows, 12, 64).to(dtype)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    k = v = torch.zeros(rows, 4, 64, dtype=dtype)
    slots = unread_slots(kv_layer, first)[:rows]
    before, seconds = torch.get_num_threads(), torch.zeros(3, dtype=torch.float64)
    try:  # paged_attention's team: torch's threads
        torch.set_num_threads(3)
        paged_attention(
            q, k, v, kv_layer, slots, 0.125, ref, block_table=tables[2], context_lens=lens
        )
    finally:
        torch.set_num_threads(before)
    status = library.kernel("tk_attention_timed", dtype)(
        q.data_ptr(), 12 * 64, kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
        tables.data_ptr(), 3, tables.shape[2], lens.data_ptr(), rows, 12, 4, 64, 16, 0.125,
        out.data_ptr(), 3, seconds.data_ptr(),
    )  # fmt: skip
    assert status == 0
    assert torch.equal(out, ref)
    assert (seconds > 0).all()


def test_wrappers_name_what_is_wrong():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="rms_norm weight.*bfloat16"):
        rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="rms_norm residual.*shape"):
        rms_norm(x, torch.ones(32), 1e-6, torch.zeros(3, 32))
    with pytest.raises(ValueError, match="silu_mul: x must be contiguous"):
        silu_mul(torch.randn(8, 16)[:, :8])
    with pytest.raises(ValueError, match="rope positions.*int64"):
        q = x.view(4, 2, 16)
        rope(q, q, torch.zeros(4, dtype=torch.int32), x, x)
    assert not attention_supported(8, 8, 24)  # head size not a multiple of 16
    assert not attention_supported(128, 1, 64)  # 128 query heads per KV head


def test_elementwise_kernels_give_the_same_bits_on_two_threads():
    """Past their size thresholds the kernels split rows across the OpenMP team."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2048, generator=g).bfloat16()  # 128K elements: parallel
    residual = torch.randn(64, 1024, generator=g).bfloat16()
    rotary = RotaryEmbedding(64, 4096, 10000.0, None, torch.bfloat16)
    qk = x.view(64, 32, 64)
    positions = torch.arange(64) * 7
    weight = torch.rand(1024, generator=g).bfloat16()

    def run():
        res = residual.clone()
        return (
            rms_norm(x[:, :1024], weight, 1e-6, res),
            res,
            *rope(qk[:, :16], qk[:, 16:], positions, rotary.cos, rotary.sin),
            silu_mul(x),
        )

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 15, 16, 17, 1000, 32000])
def test_argmax_is_the_first_maximum_as_torch_max_gives_it(dtype, d):
    g = torch.Generator().manual_seed(d)
    wide = torch.randn(9, d + 5, generator=g).to(dtype)
    x = wide[:, :d]  # strided rows
    x[1] = x[1].abs().round()  # ties: several equal maxima, the first wins
    x[2] = float("-inf")
    x[3, d // 2 :] = float("nan")  # NaN counts as the largest value
    x[4, -1] = float("nan")
    x[5] = 0.0
    x[5, d // 3] = -0.0
    ref = x.float().max(dim=-1).indices
    assert torch.equal(argmax(x), ref)
    assert argmax(x[:0]).shape == (0,)


def test_argmax_names_what_is_wrong():
    with pytest.raises(ValueError, match="argmax: rows are empty"):
        argmax(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="argmax x.*contiguous"):
        argmax(torch.zeros(4, 3).t())
