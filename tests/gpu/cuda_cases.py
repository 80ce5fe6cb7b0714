"""The light CUDA kernels' parity cases (kernels/cuda: norm, rope, activation, kv_pages), each
wrapper against its torch reference on one device: the CPU through tests/gpu/host_runtime.py
(tests/test_cuda_kernels_cpu.py) or a GPU through cupy (tests/gpu/test_cuda_kernels.py).
Inputs are drawn on the CPU from a seed and moved, so both devices see the same values.

Bounds: rope and the KV copies are bit-exact. RMSNorm sums squares in another order and takes
a correctly rounded 1/sqrt where torch has its own rsqrt (an approximation on either device):
its 1/rms may differ by a few ulp, so float32 within RMS_F32_ULP ulp and bfloat16 (one
rounding of that) within one ulp. SiLU's expf is the device's (glibc's here, CUDA's there)
where torch on the CPU has its own exp: float32 within SILU_F32_ULP ulp, bfloat16 within one.
8 ulp is under 1e-6 relative; on the CPU both stay within 3 (measured on 10^5 values). A
bfloat16 result is off by one ulp only where the float value lies within those few ulp of a
rounding midpoint: at most MAX_OFF_FRACTION of the values may be off (none were measured)."""

import math

import torch

from kernels.cuda import activation, kv_pages, norm, rope

RMS_F32_ULP = 8
SILU_F32_ULP = 8
MAX_OFF_FRACTION = 0.01
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
_MAGNITUDE = {torch.float32: 0x7FFFFFFF, torch.bfloat16: 0x7FFF}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their dtype, elementwise (int64)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)

    def ordered(x):  # float bits -> integers in the floats' order
        i = x.contiguous().view(_INT[x.dtype]).long()
        return torch.where(i < 0, -(i & _MAGNITUDE[x.dtype]), i)

    return (ordered(a) - ordered(b)).abs()


def assert_within(out: torch.Tensor, ref: torch.Tensor, f32_ulp: int) -> None:
    """float32: within f32_ulp ulp; bfloat16: within one ulp, few values off at all."""
    ulps = ulp_distance(out.cpu(), ref.cpu())
    if not ulps.numel():
        return
    if out.dtype == torch.float32:
        assert int(ulps.max()) <= f32_ulp, f"{int(ulps.max())} ulp apart"
    else:
        off = float((ulps > 0).float().mean())
        assert int(ulps.max()) <= 1 and off <= MAX_OFF_FRACTION, (int(ulps.max()), off)


def _randn(gen, shape, dtype, device, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def check_rms_norm(device, dtype, shape, residual=False, row_pad=0, seed=0) -> None:
    """x of `shape` (n, [heads,] dim), its rows row_pad values longer than their data."""
    gen = torch.Generator().manual_seed(seed)
    n, dim = shape[0], shape[-1]
    rows = _randn(gen, (n, math.prod(shape[1:]) + row_pad), dtype, device, 3.0)
    x = rows[:, row_pad:].view(shape)  # rows strided when row_pad > 0
    weight = _randn(gen, (dim,), dtype, device, 0.5) + 1
    if not residual:
        ref = norm.reference_rms_norm(x, weight, 1e-6)
        assert_within(norm.rms_norm(x, weight, 1e-6), ref, RMS_F32_ULP)
        return
    res = _randn(gen, (n, dim), dtype, device)
    res_ref = res.clone()
    out = norm.rms_norm(x, weight, 1e-5, res)
    ref = norm.reference_rms_norm(x, weight, 1e-5, res_ref)
    assert torch.equal(res, res_ref), "the residual sum differs"
    assert_within(out, ref, RMS_F32_ULP)


def _tables(gen, rows, hd, interleaved, dtype, device):
    """cos, sin (rows, hd) of the rotate-half layout or (rows, hd / 2) of pairs, at random
    angles as a rotary module's (its frequencies, a random offset a row)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.outer(torch.arange(rows) + torch.rand(rows, generator=gen) * 50, inv_freq)
    if not interleaved:
        angles = torch.cat([angles, angles], dim=-1)  # (rows, hd)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def _strided_heads(gen, T, heads, hd, pad, dtype, device):
    """(T, heads, hd) inside a bigger tensor (rows and heads pad values apart beyond their
    data, e.g. q_rope beside q_nope), and that tensor."""
    store = _randn(gen, (T, heads * (hd + pad) + pad), dtype, device)
    return store[:, pad:].view(T, heads, hd + pad)[..., pad:], store


def check_rope(device, dtype, table_dtype, T, nh, nkv, hd, interleaved, pad=0, seed=0) -> None:
    """q (T, nh, hd) and k (T, nkv, hd) rotated in place (inside bigger tensors when pad):
    exactly as the reference, the values around them untouched."""
    gen = torch.Generator().manual_seed(seed)
    q, q_store = _strided_heads(gen, T, nh, hd, pad, dtype, device)
    k, k_store = _strided_heads(gen, T, nkv, hd, pad, dtype, device)
    rows = T + 5
    cos, sin = _tables(gen, rows, hd, interleaved, table_dtype, device)
    positions = torch.randint(0, rows, (T,), generator=gen).to(device)
    ref_q, ref_k = rope.reference_rope(q, k, positions, cos, sin, interleaved)
    want_q, want_k = q_store.clone(), k_store.clone()
    for want, ref in ((want_q, ref_q), (want_k, ref_k)):
        want[:, pad:].view(T, -1, hd + pad)[..., pad:] = ref
    out_q, out_k = rope.rope(q, k, positions, cos, sin, interleaved)
    assert out_q is q and out_k is k
    assert torch.equal(q_store, want_q) and torch.equal(k_store, want_k)


def check_silu_mul(device, dtype, n, d, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, (n, 2 * d), dtype, device, 4.0)
    assert_within(activation.silu_mul(x), activation.reference_silu_mul(x), SILU_F32_ULP)


def _slots(gen, num_slots, n, device) -> torch.Tensor:
    return torch.randperm(num_slots, generator=gen)[:n].to(device)


def check_write_kv(device, dtype, P, S, nh, nkv, hd, T, seed=0) -> None:
    """k and v split from a fused qkv (T, (nh + 2 nkv) hd), so their rows are strided."""
    gen = torch.Generator().manual_seed(seed)
    qkv = _randn(gen, (T, (nh + 2 * nkv) * hd), dtype, device)
    _, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    k, v = k.view(T, nkv, hd), v.view(T, nkv, hd)
    kv_layer = _randn(gen, (2, P, S, nkv, hd), dtype, device)
    want, slots = kv_layer.clone(), _slots(gen, P * S, T, device)
    kv_pages.reference_write_kv(k, v, want, slots)
    kv_pages.write_kv(k, v, kv_layer, slots)
    assert torch.equal(kv_layer, want)


def check_write_latent(device, dtype, P, S, R, Dr, T, seed=0) -> None:
    """latent (T, R) and k_rope (T, Dr) split from one projection, as DeepSeek's."""
    gen = torch.Generator().manual_seed(seed)
    latent, k_rope = _randn(gen, (T, R + Dr), dtype, device).split([R, Dr], dim=-1)
    kv_layer = _randn(gen, (P, S, R + Dr), dtype, device)
    want, slots = kv_layer.clone(), _slots(gen, P * S, T, device)
    kv_pages.reference_write_latent(latent, k_rope, want, slots)
    kv_pages.write_latent(latent, k_rope, kv_layer, slots)
    assert torch.equal(kv_layer, want)


def check_gather_scatter(device, dtype, layer_shape, units, n, seed=0) -> None:
    """A gather of n slots, then a scatter of other values into other slots."""
    gen = torch.Generator().manual_seed(seed)
    kv_layer = _randn(gen, layer_shape, dtype, device)
    pages, page_size = layer_shape[:2] if len(layer_shape) == 3 else layer_shape[1:3]
    num_slots = pages * page_size
    slots = _slots(gen, num_slots, n, device)
    payload = kv_pages.gather(kv_layer, slots, units)
    assert torch.equal(payload, kv_pages.reference_gather(kv_layer, slots, units))
    other, to = _randn(gen, payload.shape, dtype, device), _slots(gen, num_slots, n, device)
    want = kv_layer.clone()
    kv_pages.reference_scatter(want, to, other, units)
    kv_pages.scatter(kv_layer, to, other, units)
    assert torch.equal(kv_layer, want)


def check_slots_outside_the_pool(device, dtype) -> None:
    """Slots -1 and P*S: writes and scatters skip them, a gather gives zeros."""
    gen = torch.Generator().manual_seed(0)
    kv_layer = _randn(gen, (2, 2, 3, 2, 4), dtype, device)  # 6 slots
    slots, kept = torch.tensor([4, -1, 6, 1]).to(device), torch.tensor([0, 3]).to(device)
    k, v = _randn(gen, (4, 2, 4), dtype, device), _randn(gen, (4, 2, 4), dtype, device)
    want = kv_layer.clone()
    kv_pages.reference_write_kv(k[kept], v[kept], want, slots[kept])
    kv_pages.write_kv(k, v, kv_layer, slots)
    assert torch.equal(kv_layer, want)
    payload = kv_pages.gather(kv_layer, slots, (0, 2))  # (2, 4, 2, 4)
    assert not payload[:, 1:3].any()
    assert torch.equal(payload[:, kept], kv_pages.reference_gather(kv_layer, slots[kept], (0, 2)))
    kv_pages.reference_scatter(want, slots[kept], payload[:, kept] + 1, (0, 2))
    kv_pages.scatter(kv_layer, slots, payload + 1, (0, 2))
    assert torch.equal(kv_layer, want)
