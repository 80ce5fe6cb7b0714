"""The light CUDA kernels (kernels/cuda: RMSNorm, RoPE, SiLU-and-mul, the KV row copies) run
on the CPU: their wrappers unchanged, each .cu compiled as C++ by tests/gpu/host_runtime.py,
against the torch references (the cases and their bounds: tests/gpu/cuda_cases.py); then those
references against the engine's own torch code (the layers, TorchBackend, the KV specs), so
the chain reaches the engine's semantics; then the wrappers' refusals of bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from gpu import cuda_cases as cases
from gpu.gpu_testing import ON_HOST

from kernels.cpu import library
from kernels.cuda import activation, kv_pages, norm, rope, runtime
from shared.kv.spec import MHAKVSpec, MLAKVSpec
from shared.models.layers.activation import SiluAndMul
from shared.models.layers.attention_backend import TorchBackend
from shared.models.layers.norm import RMSNorm
from shared.models.layers.rotary import InterleavedRotaryEmbedding, RotaryEmbedding

pytestmark = ON_HOST
DTYPES = (torch.float32, torch.bfloat16)
BF16 = torch.bfloat16


@pytest.fixture
def torch_layers(monkeypatch):
    """The layers' torch code, neither the C kernels nor these (the emulation takes CPU
    tensors)."""
    monkeypatch.setattr(library, "usable", lambda x: False)
    monkeypatch.setattr(runtime, "usable", lambda x: False)


# --- the kernels against their references ---


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, row_pad",
    [((3, 40), 0), ((5, 300), 0), ((2, 1100), 0), ((2, 1), 0), ((4, 3, 24), 8), ((0, 16), 0)],
)
def test_rms_norm(dtype, shape, row_pad):
    cases.check_rms_norm("cpu", dtype, shape, row_pad=row_pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim, row_pad", [(130, 30), (64, 0)])
def test_rms_norm_with_residual(dtype, dim, row_pad):
    cases.check_rms_norm("cpu", dtype, (6, dim), residual=True, row_pad=row_pad, seed=1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "dtype, tables", [(torch.float32,) * 2, (BF16, BF16), (BF16, torch.float32)]
)
@pytest.mark.parametrize(
    "T, nh, nkv, hd, pad",
    [(5, 4, 2, 16, 0), (3, 3, 1, 6, 0), (4, 4, 1, 8, 4)],  # GQA; pairs not a warp's; views
)
def test_rope(dtype, tables, interleaved, T, nh, nkv, hd, pad):
    cases.check_rope("cpu", dtype, tables, T, nh, nkv, hd, interleaved, pad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, d", [(3, 40), (4, 150), (1, 1), (0, 8)])
def test_silu_mul(dtype, n, d):
    cases.check_silu_mul("cpu", dtype, n, d)


def test_silu_mul_when_the_grid_is_smaller_than_the_values(monkeypatch):
    monkeypatch.setattr(activation, "MAX_BLOCKS", 1)  # one block strides over all 600
    cases.check_silu_mul("cpu", BF16, 3, 200, seed=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh, nkv, hd, T", [(4, 2, 8, 5), (3, 3, 12, 7), (2, 1, 100, 2)])
def test_write_kv(dtype, nh, nkv, hd, T):
    cases.check_write_kv("cpu", dtype, 3, 4, nh, nkv, hd, T)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_latent(dtype):
    cases.check_write_latent("cpu", dtype, 3, 4, 20, 6, 5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layer_shape, units, n",
    [
        ((2, 4, 3, 4, 8), (0, 4), 6),  # all heads
        ((2, 4, 3, 4, 8), (1, 3), 5),  # a rank's heads
        ((2, 3, 2, 3, 10), (2, 3), 4),
        ((4, 3, 26), (0, 1), 7),  # MLA
        ((4, 3, 26), (0, 1), 0),
    ],
)
def test_gather_and_scatter(dtype, layer_shape, units, n):
    cases.check_gather_scatter("cpu", dtype, layer_shape, units, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slots_outside_the_pool_are_skipped(dtype):
    cases.check_slots_outside_the_pool("cpu", dtype)


# --- the references against the engine's torch code ---


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference_is_the_layer(torch_layers, dtype):
    layer = RMSNorm(24, 1e-5, dtype)
    layer.weight.data = torch.randn(24).to(dtype)
    x, residual = torch.randn(6, 24).to(dtype), torch.randn(6, 24).to(dtype)
    assert torch.equal(layer(x), norm.reference_rms_norm(x, layer.weight, 1e-5))
    heads = torch.randn(6, 3, 24).to(dtype)  # per-head norms (q/k norm)
    assert torch.equal(layer(heads), norm.reference_rms_norm(heads, layer.weight, 1e-5))
    out, total = layer(x, residual.clone())
    ref_total = residual.clone()
    assert torch.equal(out, norm.reference_rms_norm(x, layer.weight, 1e-5, ref_total))
    assert torch.equal(total, ref_total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reference_is_the_rotary_layers(torch_layers, dtype):
    q, k = torch.randn(5, 4, 16).to(dtype), torch.randn(5, 2, 16).to(dtype)
    positions = torch.tensor([0, 9, 3, 30, 7])
    rotary = RotaryEmbedding(16, 32, 10000.0, None, dtype)
    ref = rope.reference_rope(q, k, positions, rotary.cos, rotary.sin)
    assert all(map(torch.equal, rotary(positions, q, k), ref))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    for interleaved in (True, False):  # DeepSeek's and Llama 4's module, its cos/sin float32
        layer = InterleavedRotaryEmbedding(16, 10000.0, yarn, interleaved, attention_factor=1.2)
        out = layer(positions, q, k)
        cos, sin = (t[:, 0] for t in layer._cos_sin)  # (T, hd / 2 or hd), rows by token
        ref = rope.reference_rope(q, k, torch.arange(5), cos, sin, interleaved)
        assert all(map(torch.equal, out, ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reference_is_the_layer(torch_layers, dtype):
    x = (torch.randn(4, 64) * 4).to(dtype)
    assert torch.equal(SiluAndMul()(x), activation.reference_silu_mul(x))
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(activation.reference_silu_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_references_are_the_engines(dtype):
    k, v = torch.randn(5, 2, 8).to(dtype), torch.randn(5, 2, 8).to(dtype)
    slots = torch.tensor([7, 0, 11, 4, 5])
    pool = torch.randn(2, 3, 4, 2, 8).to(dtype)
    ref = pool.clone()
    TorchBackend.write_kv(k, v, pool, slots)
    kv_pages.reference_write_kv(k, v, ref, slots)
    assert torch.equal(pool, ref)
    spec = MLAKVSpec(2, 4, kv_lora_rank=12, rope_dim=4, dtype=dtype)
    mla = torch.randn(spec.pool_shape(3)).to(dtype)
    latent, k_rope = torch.randn(5, 12).to(dtype), torch.randn(5, 4).to(dtype)
    kv_pages.reference_write_latent(latent, k_rope, mla[1], slots)
    assert torch.equal(spec.read(mla, 1, slots, (0, 1)), torch.cat([latent, k_rope], -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_scatter_are_the_specs_read_and_write(dtype):
    slots = torch.tensor([7, 0, 11, 4, 5])
    mha = MHAKVSpec(2, 4, num_kv_heads=4, head_dim=8, dtype=dtype)
    mla = MLAKVSpec(2, 4, kv_lora_rank=12, rope_dim=4, dtype=dtype)
    for spec, units in ((mha, (0, 4)), (mha, (1, 3)), (mla, (0, 1))):
        pool = torch.randn(spec.pool_shape(3)).to(dtype)
        read = spec.read(pool, 1, slots, units)
        assert torch.equal(kv_pages.gather(pool[1], slots, units), read)  # the kernel itself
        assert torch.equal(kv_pages.reference_gather(pool[1], slots, units), read)
        payload, to = torch.randn(read.shape).to(dtype), slots.flip(0)
        want = pool.clone()
        spec.write(want, 1, to, units, payload)
        kv_pages.scatter(pool[1], to, payload, units)
        assert torch.equal(pool, want)
    # the handoff narrows a payload to a rank's heads: contiguous, it scatters the same
    payload = torch.randn(2, 5, 4, 8).to(dtype)
    part = mha.narrow(payload, 0, (0, 4), (2, 4))
    pool = torch.randn(mha.pool_shape(3)).to(dtype)
    want = pool.clone()
    mha.write(want, 0, slots, (2, 4), part)
    kv_pages.scatter(pool[0], slots, part.contiguous(), (2, 4))
    assert torch.equal(pool, want)


# --- bad inputs: a ValueError naming the argument ---


def _bad_calls():
    x, w, meta = torch.randn(4, 32), torch.ones(32), torch.ones(32, device="meta")
    q, k, pos = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.arange(3)
    cos = torch.randn(10, 8)
    pool, slots = torch.zeros(2, 2, 3, 2, 8), torch.arange(3)
    kv = torch.randn(3, 2, 8)
    return [
        ("rms_norm x", lambda: norm.rms_norm(x.half(), w.half(), 1e-6)),
        ("rms_norm x", lambda: norm.rms_norm(x[:, ::2], w[:16], 1e-6)),
        ("rms_norm x", lambda: norm.rms_norm(x[0], w, 1e-6)),
        ("rms_norm weight", lambda: norm.rms_norm(x, w.to(BF16), 1e-6)),
        ("rms_norm weight", lambda: norm.rms_norm(x, w[:16], 1e-6)),
        ("rms_norm weight", lambda: norm.rms_norm(x, meta, 1e-6)),
        ("rms_norm residual", lambda: norm.rms_norm(x, w, 1e-6, torch.zeros(3, 32))),
        ("rms_norm residual", lambda: norm.rms_norm(x, w, 1e-6, torch.zeros(32, 4).t())),
        ("rope q", lambda: rope.rope(q[..., ::2], k[..., ::2], pos, cos[:, :4], cos[:, :4])),
        ("rope k", lambda: rope.rope(q, k.to(BF16), pos, cos, cos)),
        ("rope k", lambda: rope.rope(q, k[:2], pos, cos, cos)),
        ("rope positions", lambda: rope.rope(q, k, pos.int(), cos, cos)),
        ("rope positions", lambda: rope.rope(q, k, pos[:2], cos, cos)),
        ("rope cos", lambda: rope.rope(q, k, pos, cos.double(), cos.double())),
        ("rope cos", lambda: rope.rope(q, k, pos, cos, cos, interleaved=True)),
        ("rope sin", lambda: rope.rope(q, k, pos, cos, cos.to(BF16))),
        ("silu_mul x", lambda: activation.silu_mul(torch.randn(8, 16)[:, :8])),
        ("silu_mul x", lambda: activation.silu_mul(torch.randn(8, 7))),
        ("silu_mul x", lambda: activation.silu_mul(torch.randn(8, 8).half())),
        ("kv_layer", lambda: kv_pages.write_kv(kv, kv, pool[0], slots)),
        ("kv_layer", lambda: kv_pages.gather(pool.half(), slots, (0, 2))),
        ("write_kv k", lambda: kv_pages.write_kv(kv[:, :1], kv, pool, slots)),
        ("write_kv v", lambda: kv_pages.write_kv(kv, kv.to(BF16), pool, slots)),
        ("slots", lambda: kv_pages.write_kv(kv, kv, pool, slots.int())),
        ("slots", lambda: kv_pages.gather(pool, slots[:, None], (0, 2))),
        ("slots", lambda: kv_pages.gather(pool, slots.to("meta"), (0, 2))),
        (
            "write_latent k_rope",
            lambda: kv_pages.write_latent(kv[:, 0], kv[:, 0], pool[0, 0], slots),
        ),
        ("units", lambda: kv_pages.gather(pool, slots, (1, 3))),
        ("units", lambda: kv_pages.gather(pool[0, 0], slots, (0, 2))),
        ("scatter payload", lambda: kv_pages.scatter(pool, slots, torch.zeros(2, 3, 2, 4), (0, 2))),
    ]


@pytest.mark.parametrize("what, call", _bad_calls())
def test_bad_inputs_raise_naming_the_argument(what, call):
    with pytest.raises(ValueError, match=f"^{what}"):
        call()
