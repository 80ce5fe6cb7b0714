"""FP8 weights on the GPU path, run on the CPU under the CUDA host emulation
(tests/gpu/host_runtime.py): the kernels of kernels/cuda/fp8_linear.cu against their torch
references (cases and bounds: tests/gpu/fp8_cases.py), the reference against the loader's own
dequantization, the wrappers' refusals; then the layers (shared/models/layers/fp8_weights.py):
a linear loads an FP8 checkpoint's bytes and scales as they are, splits rows between the
kernel and a dequantized matmul, falls back to dense where a shard is not whole blocks; and
an engine on a tiny FP8 checkpoint decodes the CPU engine's greedy tokens through them."""

from contextlib import contextmanager

import pytest
import torch
from gpu import fp8_cases as cases
from gpu.gpu_testing import ON_HOST

from kernels.cpu import library
from kernels.cuda import fp8_linear as fp8
from kernels.cuda import runtime
from shared.models.config import ModelConfig
from shared.models.layers import fp8_weights
from shared.models.layers.linear import LinearBase
from shared.models.loader import load_model
from shared.models.quant import fp8 as quant_fp8
from shared.models.quant import read_scheme
from shared.parallel.group import TPGroup
from shared.sampling.params import SamplingParams

from engine_helpers import LOGPROB_TOL, make_prompts, new_engine, run_staggered
from quant_helpers import quantize_fp8

pytestmark = ON_HOST
DTYPES = (torch.float32, torch.bfloat16)
BF16 = torch.bfloat16


# --- the kernels against their references ---

SHAPES = {  # (N, K, block): N never a multiple of a block's rows (4, 8 or 16 a block)
    "vec": (37, 48, (16, 16)),
    "vec-128": (130, 176, (128, 128)),  # K: one whole block and a partial one
    "vec-strides": (9, 1552, (16, 48)),  # lanes stride K 3+ times, across blocks of 3 chunks
    "bytes-k40": (37, 40, (16, 16)),  # K not whole 16-byte chunks: byte by byte
    "bytes-bk24": (24, 64, (16, 24)),  # a scale block not whole chunks: byte by byte
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_linear(dtype, M, shape):
    N, K, block = SHAPES[shape]
    cases.check_linear("cpu", dtype, M, N, K, block, seed=M)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, x_pad", [(2, 16), (5, 3), (64, 0)])
def test_fp8_linear_bias_strides_and_the_largest_tile(dtype, M, x_pad):
    """x rows 16 values apart (still 16-byte aligned) or 3 (not: byte by byte); 64 rows."""
    cases.check_linear("cpu", dtype, M, 21, 64, (16, 16), bias=True, x_pad=x_pad)


@pytest.mark.parametrize("block", [(16, 16), (16, 8)])  # 16-byte chunks; bytes
def test_every_byte_decodes_exactly(block):
    """Scales: 1, any mantissa, >= 2^8 (scale * 2^120 overflows), products that underflow."""
    cases.check_every_byte("cpu", block, [1.0, 0.3, -1.7, 300.0, 2.0**-130])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N, K, block", [(37, 48, (16, 16)), (13, 40, (8, 16)), (3, 256, (2, 128))])
def test_fp8_dequantize(dtype, N, K, block):
    cases.check_dequantize("cpu", dtype, N, K, block)
    cases.check_dequantize("cpu", dtype, N, K, block, seed=1, scale_exp=(8, 12))  # wide scales


def test_empty_inputs():
    weight, scale = torch.zeros(5, 32, dtype=torch.uint8), torch.ones(1, 2)
    assert fp8.fp8_linear(torch.zeros(0, 32), weight, scale, (16, 16)).shape == (0, 5)
    nothing = torch.zeros(0, 32, dtype=torch.uint8), torch.ones(0, 2)
    assert fp8.fp8_linear(torch.zeros(3, 32), *nothing, (16, 16)).shape == (3, 0)
    assert fp8.fp8_dequantize(*nothing, (16, 16)).shape == (0, 32)


def test_the_reference_is_the_loaders_dequantization():
    """reference_dequantize is shared/models/quant/fp8.py's, bit for bit (NaN aside), so the
    kernels compute with the weights a CPU load holds."""
    gen = torch.Generator().manual_seed(3)
    weight, scale = cases.random_weight(gen, 37, 40, (16, 16), "cpu", nan=True)
    ours = fp8.reference_dequantize(weight, scale, (16, 16))
    loader = quant_fp8.dequantize(weight.view(torch.float8_e4m3fn), scale, (16, 16), (0, 0))
    assert torch.equal(ours.isnan(), loader.isnan())
    assert torch.equal(ours.nan_to_num(), loader.nan_to_num())


# --- refusals ---


GOOD = dict(x=torch.zeros(2, 32), weight=torch.zeros(5, 32, dtype=torch.uint8))  # fp8_linear's
GOOD.update(scale_inv=torch.ones(1, 2), block=(16, 16), bias=None)


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(x=torch.zeros(2, 32, dtype=torch.float16)), "fp8_linear x"),
        (dict(x=torch.zeros(2, 64)[:, ::2]), "fp8_linear x"),  # columns strided
        (dict(x=torch.zeros(65, 32)), "fp8_linear x"),  # more rows than a tile
        (dict(x=torch.zeros(32)), "fp8_linear x"),
        (dict(weight=torch.zeros(5, 32, dtype=torch.float8_e4m3fn)), "fp8_linear weight"),
        (dict(weight=torch.zeros(5, 31, dtype=torch.uint8)), "fp8_linear weight"),
        (dict(weight=torch.zeros(32, 5, dtype=torch.uint8).T), "fp8_linear weight"),
        (dict(scale_inv=torch.ones(2, 2)), "fp8_linear scale_inv"),
        (dict(scale_inv=torch.ones(1, 2, dtype=BF16)), "fp8_linear scale_inv"),
        (dict(block=(16, 0)), "fp8_linear block"),
        (dict(block=16), "fp8_linear block"),
        (dict(bias=torch.zeros(4)), "fp8_linear bias"),
        (dict(bias=torch.zeros(5, dtype=BF16)), "fp8_linear bias"),
    ],
)
def test_bad_inputs_name_the_argument(change, named):
    with pytest.raises(ValueError, match=named):
        fp8.fp8_linear(**{**GOOD, **change})


def test_bad_dequantize_inputs_name_the_argument():
    weight, scale = torch.zeros(5, 32, dtype=torch.uint8), torch.ones(1, 2)
    with pytest.raises(ValueError, match="fp8_dequantize dtype"):
        fp8.fp8_dequantize(weight, scale, (16, 16), torch.float16)
    with pytest.raises(ValueError, match="fp8_dequantize scale_inv"):
        fp8.fp8_dequantize(weight, torch.ones(1, 3), (16, 16))
    with pytest.raises(ValueError, match="fp8_dequantize weight"):
        fp8.fp8_dequantize(weight.float(), scale, (16, 16))


# --- the layers: FP8 linears on the (emulated) GPU path ---


@contextmanager
def cpu_engine_path():
    """The plain CPU path for a while (no emulation: FP8 checkpoints dequantize at load)."""
    emulation = runtime.use_backend(None)
    try:
        yield
    finally:
        runtime.use_backend(emulation)


@pytest.fixture(scope="module")
def fp8_folder(tiny_model_factory, tmp_path_factory):
    """name -> a tiny Llama stored FP8 (16 x 16 blocks): "aligned" (every linear's parts whole
    blocks), "ragged" (intermediate 120: gate and up parts, and TP shards, inside blocks)."""
    cache = {}

    def get(name):
        if name not in cache:
            overrides = {} if name == "aligned" else dict(intermediate_size=120)
            src = tiny_model_factory("llama", **overrides)
            cache[name] = tmp_path_factory.mktemp(f"fp8-{name}") / "model"
            quantize_fp8(src, cache[name], block=(16, 16))
        return cache[name]

    return get


def _linears(model) -> dict[str, LinearBase]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def _load(folder, dtype=torch.float32, rank=0, size=1):
    cfg = ModelConfig.from_dir(folder)
    return load_model(folder, cfg, dtype, tp=TPGroup(rank, size))


def test_linears_keep_the_checkpoints_bytes_and_scales(fp8_folder):
    """Every decoder linear holds the stored bytes + scales (what QuantScheme.stored_bytes
    counts), whose dequantization is the CPU load's weight bit for bit; the rest is as the
    CPU loads it."""
    folder = fp8_folder("aligned")
    with cpu_engine_path():
        cpu_model = _load(folder)
    dense, model = _linears(cpu_model), _load(folder)
    scheme = read_scheme(ModelConfig.from_dir(folder).raw)
    linears = _linears(model)
    kept = {n for n, m in linears.items() if fp8_weights.keeps(m)}
    assert kept == {n for n in linears if ".layers." in n} and len(kept) == 8
    for name in kept:
        m = linears[name]
        N, K = m.weight.shape
        assert m.weight.dtype == torch.uint8 and m.fp8_block == (16, 16)
        held = m.weight.nbytes + m.weight_scale_inv.nbytes
        assert held == sum(scheme.stored_bytes(N, K).values())
        values = fp8.reference_dequantize(m.weight, m.weight_scale_inv, m.fp8_block)
        assert torch.equal(values, dense[name].weight), name
    want = cpu_model.state_dict()
    for name, value in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in kept:
            assert torch.equal(value, want[name]), name


@pytest.mark.parametrize("rank", [0, 1])
def test_parts_inside_a_block_load_dense(fp8_folder, rank):
    """Intermediate 120 at TP 2: gate/up parts of 60 rows and down's columns from 60 are not
    whole blocks (dense, as a CPU load makes them), q/k/v and o are (FP8); either way each
    rank's weights are the CPU load's."""
    folder = fp8_folder("ragged")
    with cpu_engine_path():
        dense = _linears(_load(folder, rank=rank, size=2))
    linears = _linears(_load(folder, rank=rank, size=2))
    kept = {n.split(".")[-1] for n, m in linears.items() if fp8_weights.keeps(m)}
    assert kept == ({"qkv_proj", "o_proj", "down_proj"} if rank == 0 else {"qkv_proj", "o_proj"})
    for name, m in linears.items():
        weight = m.weight
        if fp8_weights.keeps(m):
            weight = fp8.reference_dequantize(weight, m.weight_scale_inv, m.fp8_block)
        assert torch.equal(weight, dense[name].weight), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_rows_take_the_kernel_and_more_a_dequantized_matmul(fp8_folder, monkeypatch, dtype):
    """Within the kernel's bounds of the dense linear (CPU load) on the same input: the FP8
    down_proj of the ragged model (K = 120: byte by byte) and the aligned gate_up. The
    threshold is lowered to 4 rows here (the emulation's warp sums are slow at 64)."""
    assert fp8_weights.MAX_KERNEL_ROWS == 64
    monkeypatch.setattr(fp8_weights, "MAX_KERNEL_ROWS", 4)
    pairs = []
    for folder, name in [("ragged", "down_proj"), ("aligned", "gate_up_proj")]:
        with cpu_engine_path():  # a bf16 CPU load: these float32 weights rounded once
            dense = _linears(_load(fp8_folder(folder)))[f"model.layers.1.mlp.{name}"].weight
        m = _linears(_load(fp8_folder(folder), dtype))[f"model.layers.1.mlp.{name}"]
        pairs.append((m, dense.to(dtype).float()))
    calls = _count(monkeypatch)
    for m, w in pairs:
        assert fp8_weights.keeps(m)
        for rows in (1, 4, 5, 70):
            x = torch.randn(rows, m.weight.shape[1]).to(dtype)
            ref32, magnitude = x.float() @ w.T, x.float().abs() @ w.abs().T
            if dtype == BF16:  # the CPU load's bf16 weight is itself rounded once
                magnitude = magnitude * (1 + 2**-7 / cases.F32_REL)
            cases.assert_linear_close(m(x), ref32, magnitude)
    assert calls == {"fp8_linear": 4, "fp8_dequantize": 4}


def _count(monkeypatch) -> dict[str, int]:
    """Calls of the two FP8 kernels' wrappers, from now on in the test."""
    calls = {"fp8_linear": 0, "fp8_dequantize": 0}
    for name in calls:
        original = getattr(fp8, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(fp8, name, counted)
    return calls


PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=5)


def test_the_engine_decodes_the_cpu_engines_tokens(fp8_folder, monkeypatch):
    """An engine on the emulated GPU path (the C kernels off) with FP8 linears: a 70-token
    prompt prefills through dequantized weights, decode steps through fp8_linear (decode
    graphs' buffers), and the greedy tokens and their logprobs are those of the CPU engine,
    which dequantizes at load."""
    folder = fp8_folder("aligned")
    prompts = make_prompts([5, 70])
    options = dict(attention_backend="torch", decode_graphs="on", max_num_seqs=4, num_pages=64)
    with cpu_engine_path():
        cpu = new_engine(folder, **options)
        try:
            want = run_staggered(cpu, prompts, PARAMS)
        finally:
            cpu.close()
    monkeypatch.setattr(library, "usable", lambda x: False)
    calls = _count(monkeypatch)
    engine = new_engine(folder, **options)
    try:
        kept = [m for m in _linears(engine.model).values() if fp8_weights.keeps(m)]
        scheme = read_scheme(ModelConfig.from_dir(folder).raw)
        held = sum(m.weight.nbytes + m.weight_scale_inv.nbytes for m in kept)
        stored = sum(sum(scheme.stored_bytes(*m.weight.shape).values()) for m in kept)
        assert len(kept) == 8 and held == stored
        got = run_staggered(engine, prompts, PARAMS)
    finally:
        engine.close()
    for g, w in zip(got, want):
        assert g.output_token_ids == w.output_token_ids and len(g.output_token_ids) == 6
        ours = torch.tensor([lp.logprob for lp in g.output_logprobs])
        theirs = torch.tensor([lp.logprob for lp in w.output_logprobs])
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_TOL, rtol=0)
    assert calls["fp8_linear"] > 0 and calls["fp8_dequantize"] > 0
