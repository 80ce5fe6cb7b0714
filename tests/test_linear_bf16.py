"""The bfloat16 linear (kernels/cpu/linear_bf16.c: AMX tiles, or the vector units of
each tier) against a float64 reference at every tier this CPU runs, and the choice of kernel
each CPU bf16 linear layer makes after loading."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import isa, library
from kernels.cpu.linear import linear_bf16, linear_max_rows
from shared.models.layers import cpu_linear
from shared.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from shared.models.packing import prepare_cpu_linears

from compilers import needs_compiler
from tiers import EMULATED_AMX, tier_params, use_tier

pytestmark = needs_compiler


@pytest.fixture(autouse=True, params=tier_params(emulated_amx=True))
def tier(request, monkeypatch):
    use_tier(request.param, monkeypatch)
    return request.param


def reference(x, weight, bias=None) -> torch.Tensor:
    """float64 sums of the bf16 inputs."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def assert_close_to_reference(y: torch.Tensor, x, weight, bias=None) -> None:
    """One bf16 rounding of the output, plus float32 summation error."""
    ref = reference(x, weight, bias)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    scale = (x.double().abs() @ weight.double().abs().T).max().item()
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=scale * 2**-20)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 16, 17, 25, 32, 33, 64, 100])
@pytest.mark.parametrize(
    "out_features,in_features", [(16, 32), (48, 96), (80, 64), (1280, 768), (24, 2080)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(rows, out_features, in_features, with_bias):
    """Every row count (partial tiles and row blocks; from 16 rows avx2 runs outer products on
    x packed in blocks of 16, the last one partial: 17 and 33 one row, 25 nine), output count (a
    last group of 16, or of avx2's 6) and input count (2080: widened in chunks, the last one
    short)."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=g) / 8).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    assert_close_to_reference(linear_bf16(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("rows", [[40, 3, 0, 29, 8], [5, 0, 2, 9]])
@pytest.mark.parametrize("in_features", [64, 256, 2080])
def test_experts_rows_match_the_reference(rows, in_features):
    """A MoE layer's expert linears (experts_linear_team, moe.c), which the tiny models' tests
    reach only with one chunk of K: each expert's rows of x, grouped by expert, against its own
    weight, an expert of no rows skipped. On avx2 the first case (20 rows an active expert on
    average) takes the outer products, experts of 3 and 8 rows among them (one block of under
    9 rows), each expert's rows packed in blocks of their own; 256 and 2080 input features are
    2 and 16 whole chunks of K, 2080 a short one after them. The second case takes the dot
    products."""
    g = torch.Generator().manual_seed(sum(rows) + in_features)
    experts, out_features = len(rows), 20  # avx2's groups of 6 outputs, the last one partial
    start = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int64)
    x = torch.randn(int(start[-1]), in_features, generator=g).bfloat16()
    weight = (torch.randn(experts, out_features, in_features, generator=g) / 8).bfloat16()
    y = torch.full((len(x), out_features), float("nan"), dtype=torch.bfloat16)
    status = library.kernel("tk_experts_linear_bf16")(
        x.data_ptr(), start.data_ptr(), experts, weight.data_ptr(), weight[0].numel(),
        out_features, in_features, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    assert status == 0
    for e in range(experts):
        first, end = start[e], start[e + 1]
        if end > first:
            assert_close_to_reference(y[first:end], x[first:end], weight[e])


@pytest.mark.parametrize("rows", [1, 40])
def test_strided_rows_and_thread_counts_give_the_same_bits(rows):
    """x may be a column slice of a wider tensor; each output is one thread's sum in a fixed
    order, whichever thread takes its group (shares.h), so 1 to 5 threads agree bit for bit
    (more threads than this machine's cores: a thread preempted mid-loop has its groups taken
    by the others)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(rows, 300, generator=g).bfloat16()
    x = wide[:, 10:266]  # (rows, 256), row stride 300
    weight = torch.randn(1000, 256, generator=g).bfloat16()
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            outputs += [linear_bf16(x, weight, None) for _ in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])
    assert_close_to_reference(outputs[0], x, weight)


def test_a_team_larger_than_the_shares_hold_splits_statically():
    """Past MAX_SHARES (256) threads the team keeps each thread's equal part alone: 300
    threads give 1 thread's bits, the outputs fewer than the threads (some take none)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g).bfloat16()
    weight = torch.randn(1000, 64, generator=g).bfloat16()
    outputs = []
    for count in (1, 300):
        y = torch.full((2, 1000), float("nan"), dtype=torch.bfloat16)
        status = library.kernel("tk_linear_bf16")(
            x.data_ptr(), 64, weight.data_ptr(), None, 2, 1000, 64, y.data_ptr(), count
        )
        assert status == 0
        outputs.append(y)
    assert torch.equal(outputs[0], outputs[1])
    assert_close_to_reference(outputs[1], x, weight)


def test_expert_thread_counts_give_the_same_bits():
    """The experts' groups taken as the threads go, expert after expert: 1 to 5 threads give
    the same bits."""
    g = torch.Generator().manual_seed(2)
    rows, in_features, out_features = [3, 0, 1, 9], 256, 100
    start = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int64)
    x = torch.randn(int(start[-1]), in_features, generator=g).bfloat16()
    weight = (torch.randn(len(rows), out_features, in_features, generator=g) / 8).bfloat16()
    outputs = []
    for count in (1, 2, 3, 5):
        y = torch.full((len(x), out_features), float("nan"), dtype=torch.bfloat16)
        status = library.kernel("tk_experts_linear_bf16")(
            x.data_ptr(), start.data_ptr(), len(rows), weight.data_ptr(), weight[0].numel(),
            out_features, in_features, y.data_ptr(), count,
        )  # fmt: skip
        assert status == 0
        outputs.append(y)
    assert all(torch.equal(outputs[0], y) for y in outputs[1:])
    for e, (first, end) in enumerate(zip(start[:-1], start[1:])):
        if end > first:
            assert_close_to_reference(outputs[0][first:end], x[first:end], weight[e])


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_row_gets_the_same_bits_alone_or_in_a_block(tier, with_bias):
    """Below avx2's outer products the vector units sum each output of each row in one order,
    whether the row falls in a whole block of rows (avx512_bf16: the block's sums folded in one
    vector), among the last rows of a batch that fill no block, or alone: a token's logits do
    not depend on what else is batched (on the AVX-512 tiers a row alone takes one_row, the
    weight rows in turn). Every output adds 2^16 first and takes it away last, in the same
    lane, so the products between round at that size and an order of any other kind changes
    ~5-10% of the outputs, where plain random sums changed one in 15,000. AMX tiles sum in
    their own order."""
    if tier in ("amx", EMULATED_AMX):
        pytest.skip("AMX tiles sum in another order")
    g = torch.Generator().manual_seed(7)
    x, weight = torch.randn(12, 768, generator=g) * 3, torch.randn(1283, 768, generator=g)
    x[:, 0], x[:, -32], weight[:, 0], weight[:, -32] = 2.0**16, -(2.0**16), 1.0, 1.0
    x, weight = x.bfloat16(), weight.bfloat16()  # a last group of 3 outputs
    bias = torch.randn(1283, generator=g).bfloat16() if with_bias else None
    alone = torch.cat([linear_bf16(x[i : i + 1], weight, bias) for i in range(len(x))])
    for rows in (12, 6, 7):  # whole blocks, then the last 2 or 3 rows
        together = linear_bf16(x[:rows], weight, bias)
        assert torch.equal(together.view(torch.int16), alone[:rows].view(torch.int16)), rows


def test_each_output_is_rounded_once_as_torch_rounds_float32(tier):
    """Each output's float32 sum is rounded to bf16 once, as torch rounds (to the nearest, ties
    to the even value; a NaN to one quiet NaN), in every form: sums 1 + c/256 fall on bf16
    values and halfway between them, 1 - c/256 on them, and the inf and inf - inf rows give inf
    and NaN, for 20 rows together (avx2's outer products; avx512_bf16's whole blocks and the
    rows after) and for each row alone; 7 outputs, a group and a short one."""
    c = torch.arange(18, dtype=torch.float32)
    x = torch.zeros(20, 64)
    x[:18, 0], x[:18, 1] = 1.0, c / 256
    x[18:, 0] = float("inf")
    x[19, 1] = float("-inf")
    weight = torch.zeros(7, 64)
    weight[:, :2] = 1.0
    weight[3, 1] = -1.0
    x, weight = x.bfloat16(), weight.bfloat16()
    sums = (x.double() @ weight.double().T).float()
    expected = sums.bfloat16().view(torch.int16)
    expected[sums.isnan()] = 0x7FC0  # the kernels' one NaN (torch keeps the sign bit)
    assert sums[19, 0].isnan() and expected[19, 3] == 0x7F80  # inf - inf; inf + inf
    together = linear_bf16(x, weight, None)
    alone = torch.cat([linear_bf16(x[i : i + 1], weight, None) for i in range(len(x))])
    assert torch.equal(together.view(torch.int16), expected)
    assert torch.equal(alone.view(torch.int16), expected)


def test_bad_input_names_what_is_wrong():
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="features"):
        linear_bf16(torch.zeros(2, 32, dtype=torch.bfloat16), weight, None)
    with pytest.raises(ValueError, match="linear x"):
        linear_bf16(torch.zeros(2, 64), weight, None)
    with pytest.raises(ValueError, match="linear bias"):
        linear_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), weight, torch.zeros(8))
    with pytest.raises(ValueError, match="linear weight.*48"):  # in_features off the 32s
        linear_bf16(torch.zeros(2, 48, dtype=torch.bfloat16), weight[:, :48].contiguous(), None)
    with pytest.raises(ValueError, match="linear weight.*contiguous False"):
        linear_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), weight.T.contiguous().T, None)


def test_output_counts_off_the_group_size():
    """Any number of outputs: the vector kernels' groups of 4, the last one partial; on AMX the
    tiles' multiples of 16 and the vector units' rest (none, or no tile at all)."""
    g = torch.Generator().manual_seed(7)
    cases = [(1, 6), (3, 6), (5, 6), (7, 6), (5, 20), (8, 40), (21, 3), (37, 17), (50, 33)]
    for out_features, rows in cases:
        x = torch.randn(rows, 64, generator=g).bfloat16()
        weight = torch.randn(out_features, 64, generator=g).bfloat16()
        bias = torch.randn(out_features, generator=g).bfloat16()
        assert_close_to_reference(linear_bf16(x, weight, bias), x, weight, bias)


def test_the_tier_decides_amx(tier):
    """Only the amx tier's library runs the linear on tiles (emulated or not)."""
    on_tiles = tier in ("amx", EMULATED_AMX)
    assert library.amx_ready() == on_tiles
    if tier != EMULATED_AMX:
        kernels = library.load_kernels(isa.BY_NAME[tier])
        assert bool(kernels["tk_amx_ready", torch.bfloat16]()) == on_tiles


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("Config", (), {"tie_word_embeddings": False})()
        self.fits = ColumnParallelLinear(64, 48, bias=True, dtype=torch.bfloat16)
        self.odd = RowParallelLinear(
            24, 40, dtype=torch.bfloat16
        )  # 24 inputs: not a multiple of 32
        for p in self.parameters():
            p.data.copy_(torch.randn(p.shape) / 4)


@pytest.mark.parametrize("torch_says", [True, False], ids=["torch bf16", "no torch bf16"])
@pytest.mark.parametrize("tier", isa.TIER_NAMES)
def test_onednn_runs_bf16_matmuls_only_on_tiers_with_bf16_arithmetic(monkeypatch, tier, torch_says):
    """oneDNN's bf16 matmuls only where the tier multiplies bf16 (avx512_bf16, amx) and torch
    agrees: on plain AVX-512 oneDNN widens inside its loops, ~2.5x slower than a float32 matmul
    on the weight widened once a call, so prefill widens there as it does below AVX-512."""
    monkeypatch.setattr(isa, "active", lambda: isa.BY_NAME[tier])
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: torch_says)
    expected = torch_says and tier in ("avx512_bf16", "amx")
    assert cpu_linear.onednn_bf16.__wrapped__() is expected


@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN bf16", "no oneDNN bf16"])
def test_layers_pick_their_kernel_and_agree_with_f_linear(monkeypatch, onednn):
    """After loading: a weight that fits our kernel stays plain and runs there up to
    linear_max_rows() rows (F.linear above: oneDNN's bf16, or float32 where the tier has no
    oneDNN bf16); one that does not is packed for oneDNN, or stays plain without it."""
    if onednn and not cpu_linear.onednn_bf16():
        pytest.skip("oneDNN runs no bf16 matmul here (an AVX2 CPU, or capped to one)")
    monkeypatch.setattr(cpu_linear, "onednn_bf16", lambda: onednn)
    torch.manual_seed(0)
    model = _Model()
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    prepare_cpu_linears(model)
    assert getattr(model.fits, "c_linear", False) and getattr(model.fits, "packed", None) is None
    assert not getattr(model.odd, "c_linear", False)
    assert (getattr(model.odd, "packed", None) is not None) == onednn
    max_rows = linear_max_rows()
    for rows in (3, max_rows, max_rows + 1):
        x = torch.randn(rows, 64).bfloat16()
        y = model.fits(x)
        assert_close_to_reference(y, x, plain["fits.weight"], plain["fits.bias"])
        expected = F.linear(x, plain["fits.weight"], plain["fits.bias"])
        torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-2)
    x = torch.randn(3, 24).bfloat16()
    if onednn:  # the packed weight: oneDNN's bits
        expected = F.linear(x, plain["odd.weight"])
        torch.testing.assert_close(model.odd(x).float(), expected.float(), rtol=0, atol=0)
    else:  # float32 on the widened weight, rounded once
        assert_close_to_reference(model.odd(x), x, plain["odd.weight"])


def test_no_rows_gives_an_empty_output():
    weight = torch.ones(16, 32, dtype=torch.bfloat16)
    assert linear_bf16(torch.zeros(0, 32, dtype=torch.bfloat16), weight, None).shape == (0, 16)
