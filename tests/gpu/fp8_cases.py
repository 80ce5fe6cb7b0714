"""The FP8 weight kernels' parity cases (kernels/cuda/fp8_linear.py), each wrapper against its
torch reference on one device: the CPU through tests/gpu/host_runtime.py
(tests/test_cuda_fp8_cpu.py) or a GPU through cupy (tests/gpu/test_cuda_fp8.py). Inputs are
drawn on the CPU from a seed and moved, so both devices see the same values.

Bounds: fp8_dequantize is bit-exact (NaN where the reference has NaN). fp8_linear's weights
are the reference's float32 values exactly; only its float32 sum runs in another order, so
float32 y lies within F32_REL of sum_k |x w| (the sum's rounding is at most ~K * 2^-24 of it
in the worst case, ~sqrt(K) * 2^-24 typically: 1e-5 covers K up to ~170 worst case and any
K here typically), and bfloat16 y within that plus half a bfloat16 ulp (2^-8 relative) of
the unrounded float32 reference: one rounding of a result within the float32 bound."""

import torch

from kernels.cuda import fp8_linear as fp8

F32_REL = 1e-5
BF16_HALF_ULP = 2.0**-8
NAN_BYTES = (0x7F, 0xFF)


def random_weight(gen, N: int, K: int, block, device, nan: bool = False, scale_exp=(-12, 0)):
    """(weight (N, K) uint8, scale_inv float32 blocks): random bytes (NaN bytes only with
    nan), scales 2^u for u uniform in scale_exp, times a random factor in [1, 2) (any
    mantissa), a few negative."""
    weight = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.int32).to(torch.uint8)
    if not nan:
        weight[(weight == 0x7F) | (weight == 0xFF)] = 0x00
    blocks = (-(-N // block[0]), -(-K // block[1]))
    low, high = scale_exp
    exponent = torch.rand(blocks, generator=gen) * (high - low) + low
    scale = 2.0**exponent * (1 + torch.rand(blocks, generator=gen))
    scale[torch.rand(blocks, generator=gen) < 0.1] *= -1
    return weight.to(device), scale.to(device)


def assert_linear_close(y: torch.Tensor, ref32: torch.Tensor, magnitude: torch.Tensor) -> None:
    """y (of its dtype) against the float32 reference before rounding; magnitude: sum_k |x w|
    of each output (module docstring's bounds)."""
    bound = F32_REL * magnitude
    if y.dtype == torch.bfloat16:
        bound = bound + BF16_HALF_ULP * ref32.abs()
    err = (y.float() - ref32).abs()
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert bool((err <= bound).all()), (
        f"off by {float(err.flatten()[worst]):.3g} where the bound is "
        f"{float(bound.flatten()[worst]):.3g} (reference {float(ref32.flatten()[worst]):.6g})"
    )


def check_linear(device, dtype, M, N, K, block, bias=False, x_pad=0, seed=0) -> None:
    """y = x W^T (+ bias) against the reference; x's rows x_pad values longer than K (strided
    rows)."""
    gen = torch.Generator().manual_seed(seed)
    weight, scale = random_weight(gen, N, K, block, device)
    rows = (torch.randn(M, K + x_pad, generator=gen) * 2).to(dtype).to(device)
    x = rows[:, x_pad:]
    b = (torch.randn(N, generator=gen)).to(dtype).to(device) if bias else None
    y = fp8.fp8_linear(x, weight, scale, block, b)
    assert y.dtype == dtype and tuple(y.shape) == (M, N)
    w = fp8.reference_dequantize(weight, scale, block)  # (N, K) float32
    ref32 = fp8.reference_fp8_linear(x.float(), weight, scale, block, b)
    magnitude = x.float().abs() @ w.abs().T + (0 if b is None else b.float().abs())
    assert_linear_close(y.cpu(), ref32.cpu(), magnitude.cpu())


def check_every_byte(device, block, scales: list[float]) -> None:
    """Each of the 256 bytes through fp8_linear alone, at each scale: row 256 s + n of W
    (256 len(scales), 16) holds byte n at column n % 16 (zeros elsewhere) and scales[s] in
    its blocks (block[0] divides 256), x is ones (1, 16), so y[0, 256 s + n] is byte n's value
    times scales[s], which must equal the reference's float32 exactly (NaN for NaN)."""
    n = torch.arange(256).repeat(len(scales))  # (N,) byte of each row
    weight = torch.zeros(len(n), 16, dtype=torch.uint8)
    weight[torch.arange(len(n)), n % 16] = n.to(torch.uint8)
    per_scale = 256 // block[0]  # row blocks of one scale
    scale_inv = torch.tensor(scales).repeat_interleave(per_scale)[:, None]  # (N / bn, 1)
    scale_inv = scale_inv.expand(-1, -(-16 // block[1])).contiguous()
    weight, scale_inv = weight.to(device), scale_inv.to(device)
    y = fp8.fp8_linear(torch.ones(1, 16, device=device), weight, scale_inv, block).cpu()[0]
    want = fp8.reference_dequantize(weight, scale_inv, block).cpu()[torch.arange(len(n)), n % 16]
    assert torch.equal(y.isnan(), want.isnan()), "NaN bytes differ"
    assert set(n[y.isnan()].tolist()) == set(NAN_BYTES)
    finite = ~want.isnan()
    same = y[finite] == want[finite]  # by value: byte 0x80 (-0) sums to +0
    assert bool(same.all()), f"bytes {n[finite][~same].tolist()[:8]} decode differently"


def check_dequantize(device, dtype, N, K, block, seed=0, scale_exp=(-12, 0)) -> None:
    """fp8_dequantize bit for bit, NaN bytes and all."""
    gen = torch.Generator().manual_seed(seed)
    weight, scale = random_weight(gen, N, K, block, device, nan=True, scale_exp=scale_exp)
    got = fp8.fp8_dequantize(weight, scale, block, dtype).cpu()
    want = fp8.reference_dequantize(weight, scale, block).to(dtype).cpu()
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
