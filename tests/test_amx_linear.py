"""The AMX bfloat16 linear (shared/models/layers/amx_linear.c) against a float64 reference, and
the choice of kernel each CPU bf16 linear layer makes after loading."""

import pytest
import torch
import torch.nn.functional as F

from shared.models.layers import cpu_kernels
from shared.models.layers.cpu_linear import AMX_MAX_ROWS
from shared.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from shared.models.packing import prepare_cpu_linears

needs_amx = pytest.mark.skipif(
    not (cpu_kernels.usable(torch.zeros(1)) and cpu_kernels.amx_ready()),
    reason="this CPU (or its OS, or the build) has no AMX-BF16",
)


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


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 96), (80, 64), (1280, 768)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(rows, out_features, in_features, with_bias):
    """Every row count (partial tiles, odd block counts) and output count (a last group of 16)."""
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    weight = (torch.randn(out_features, in_features, generator=g) / 8).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    assert_close_to_reference(cpu_kernels.linear_bf16(x, weight, bias), x, weight, bias)


@needs_amx
def test_strided_rows_and_thread_counts_give_the_same_bits():
    """x may be a column slice of a wider tensor; each output is one thread's sum in a fixed
    order, so 1 and 2 threads agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(40, 300, generator=g).bfloat16()
    x = wide[:, 10:266]  # (40, 256), row stride 300
    weight = torch.randn(96, 256, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.linear_bf16(x, weight, None)
        torch.set_num_threads(2)
        two = cpu_kernels.linear_bf16(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_close_to_reference(one, x, weight)


@needs_amx
def test_bad_input_names_what_is_wrong():
    weight = torch.zeros(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.linear_bf16(torch.zeros(2, 32, dtype=torch.bfloat16), weight, None)
    with pytest.raises(ValueError, match="linear x"):
        cpu_kernels.linear_bf16(torch.zeros(2, 64), weight, None)
    with pytest.raises(ValueError, match="linear bias"):
        cpu_kernels.linear_bf16(torch.zeros(2, 64, dtype=torch.bfloat16), weight, torch.zeros(8))


def test_portable_build_has_no_amx():
    """Without -march=native the library still builds, and says it has no AMX kernel."""
    kernels = cpu_kernels.load_kernels(cpu_kernels.PORTABLE_FLAGS)
    if kernels is None:
        pytest.skip("no C compiler")
    assert kernels["tk_amx_ready", torch.bfloat16]() == 0


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


@needs_amx
def test_layers_pick_their_kernel_and_agree_with_f_linear():
    """After loading: a weight that fits the AMX kernel stays plain and runs there up to
    AMX_MAX_ROWS rows (F.linear above); one that does not is packed for oneDNN."""
    torch.manual_seed(0)
    model = _Model()
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    prepare_cpu_linears(model)
    assert getattr(model.fits, "amx", False) and getattr(model.fits, "packed", None) is None
    assert not getattr(model.odd, "amx", False) and model.odd.packed is not None
    for rows in (3, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
        x = torch.randn(rows, 64).bfloat16()
        y = model.fits(x)
        assert_close_to_reference(y, x, plain["fits.weight"], plain["fits.bias"])
        expected = F.linear(x, plain["fits.weight"], plain["fits.bias"])
        torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=1e-2)
    x = torch.randn(3, 24).bfloat16()
    torch.testing.assert_close(
        model.odd(x).float(), F.linear(x, plain["odd.weight"]).float(), rtol=0, atol=0
    )


@needs_amx
def test_no_rows_gives_an_empty_output():
    weight = torch.ones(16, 32, dtype=torch.bfloat16)
    assert cpu_kernels.linear_bf16(
        torch.zeros(0, 32, dtype=torch.bfloat16), weight, None
    ).shape == (0, 16)
