"""The grammar-mask kernel (kernels/cpu/token_mask.c) at every tier this CPU runs, against a
bit-by-bit reference and the sampler's torch path (shared/sampling/token_mask.py), and the
sampler's greedy rows under masks."""

import pytest
import torch

from kernels.cpu.token_mask import token_mask_
from shared.sampling.params import SamplingParams
from shared.sampling.sampler import SamplingBatch, SamplingRow, sample
from shared.sampling.token_mask import TokenMasks, _apply_torch_, apply_

from compilers import needs_compiler
from tiers import tier_params, use_tier

pytestmark = needs_compiler
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True, params=tier_params())
def build(request, monkeypatch):
    """Each test on each tier's library this CPU can run; the others skipped with the reason."""
    use_tier(request.param, monkeypatch)
    return request.param


def random_bitmask(rows: int, words: int, seed: int) -> torch.Tensor:
    """(rows, words) int32 of random bits, with whole words all ones and all zeros among them
    (the kernel's fast paths) and sparse words (a few allowed tokens, as a grammar leaves)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64)
    kind = torch.randint(0, 4, (rows, words), generator=g)
    bits[kind == 0] = 0
    bits[kind == 1] = -1
    sparse = torch.randint(0, 32, (rows, words), generator=g)
    bits = torch.where(kind == 2, torch.ones_like(bits) << sparse, bits)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def reference(x: torch.Tensor, row_ids: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x with -inf wherever a masked row's token bit is clear, one bit shifted out at a time."""
    tokens = torch.arange(x.shape[1])
    bits = (bitmask[:, tokens // 32].long() >> (tokens % 32)) & 1  # (R, V)
    out = x.clone()
    for r, row in enumerate(row_ids.tolist()):
        out[row] = out[row].masked_fill(bits[r] == 0, float("-inf"))
    return out


def logits_case(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(rows, vocab) logits, strided rows (a view into wider ones), inf and NaN among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab + 7, generator=g).to(dtype)[:, :vocab]
    x[0, 0] = float("inf")
    x[-1, -1] = float("nan")
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 8192, 32000])
@pytest.mark.parametrize("spare_words", [0, 3])
def test_masks_a_subset_of_rows_as_the_bits_say(dtype, vocab, spare_words):
    """Rows out of order, some left alone; words past ceil(V / 32), and bits past V in the
    last one, are random and ignored. A disallowed inf or NaN becomes -inf too."""
    x = logits_case(9, vocab, dtype, seed=vocab)
    row_ids = torch.tensor([4, 0, 8, 2, 7])
    bitmask = random_bitmask(5, -(-vocab // 32) + spare_words, seed=vocab + 1)
    want = reference(x, row_ids, bitmask)
    past = x.as_strided((9, 7), (x.stride(0), 1), vocab)  # (9, 7) between the rows
    kept = past.clone()
    token_mask_(x, row_ids, bitmask)
    assert torch.equal(past, kept)  # no write past V
    assert torch.equal(x.isnan(), want.isnan())
    assert torch.equal(x.nan_to_num(0.0), want.nan_to_num(0.0))  # -inf, inf and values alike


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 33, 32000])
def test_equals_the_torch_path_on_finite_logits(dtype, vocab):
    x = logits_case(6, vocab, dtype, seed=vocab).nan_to_num(0.0, 0.0)
    row_ids = torch.tensor([5, 1, 2])
    masks = TokenMasks(row_ids, random_bitmask(3, -(-vocab // 32) + 1, seed=vocab + 2))
    torch_path = x.clone()
    _apply_torch_(torch_path, masks)
    token_mask_(x, masks.row_ids, masks.bitmask)
    assert torch.equal(x, torch_path)


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_takes_the_kernel_and_two_threads_give_the_same_bits(dtype):
    x = logits_case(32, 32000, dtype, seed=3)
    row_ids = torch.arange(31, -1, -1)
    bitmask = random_bitmask(32, 1000, seed=4)
    want = reference(x, row_ids, bitmask)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = x.clone()
            apply_(out, TokenMasks(row_ids, bitmask))
            assert torch.equal(out.nan_to_num(0.0), want.nan_to_num(0.0))
    finally:
        torch.set_num_threads(threads)


def test_no_rows_leave_the_logits_alone():
    x = torch.randn(3, 40)
    token_mask_(x, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int32))
    assert torch.isfinite(x).all()


def test_token_mask_names_what_is_wrong():
    x, row_ids, bitmask = torch.zeros(4, 64), torch.tensor([0, 3]), torch.zeros(2, 2).int()
    with pytest.raises(ValueError, match=r"token_mask row_ids: not all in \[0, 4\)"):
        token_mask_(x, torch.tensor([0, 4]), bitmask)
    assert (x == 0).all()  # nothing written
    with pytest.raises(ValueError, match="token_mask bitmask: 1 words cover fewer than 64"):
        token_mask_(x, row_ids, bitmask[:, :1])
    with pytest.raises(ValueError, match="token_mask bitmask.*int32"):
        token_mask_(x, row_ids, bitmask.long())
    with pytest.raises(ValueError, match="token_mask row_ids.*int64"):
        token_mask_(x, row_ids.int(), bitmask)
    with pytest.raises(ValueError, match="token_mask x.*contiguous"):
        token_mask_(x.t(), row_ids, bitmask)


def test_greedy_rows_mask_bfloat16_logits_as_float32_would_and_leave_them_alone():
    """The sampler's greedy path under masks and min_tokens copies the logits in their own
    dtype (-inf fills are exact in bfloat16): the tokens of the float32 reference."""
    vocab, eos = 100, 3
    logits = logits_case(4, vocab, torch.bfloat16, seed=5).nan_to_num(0.0, 0.0)
    logits[1, eos] = 50.0  # row 1's best token, masked below min_tokens
    kept = logits.clone()
    stop = frozenset({eos})
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, [1], [], stop) for _ in range(3)]
    rows.insert(1, SamplingRow(SamplingParams(temperature=0.0, min_tokens=5), 0, [1], [], stop))
    masks = TokenMasks(torch.tensor([2, 0]), random_bitmask(2, 4, seed=6))
    tokens = sample(logits, SamplingBatch.build(rows, vocab, "cpu", masks)).token_ids
    want = reference(logits.float(), masks.row_ids, masks.bitmask)
    want[1, eos] = float("-inf")
    assert tokens.tolist() == want.argmax(dim=-1).tolist()
    assert torch.equal(logits, kept)
