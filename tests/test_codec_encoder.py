"""The C encoder writes the reference's planes byte for byte whatever its thread count, into
planes that start as garbage: its package-merge gives huffman.code_lengths' lengths, and
tensors cut into chunks (boundaries mid-byte and mid-segment) give the planes of one chunk,
for every coded dtype and awkward sizes."""

import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from shared.codec import compress_dir, encode_tensor, encode_tensors, many, native
from shared.codec.container import ShardReader
from shared.codec.format import LAYOUTS, MAX_CODE_LEN, SEG_BITS
from shared.codec.huffman import code_lengths

from compilers import cross_compiler, needs_compiler

pytestmark = needs_compiler


@pytest.fixture
def lib():
    return native.load()


@pytest.fixture(autouse=True)
def planes_start_as_garbage(monkeypatch):
    """The encoder's planes come uninitialized (native.plane_buffer): here full of 0xA5, so
    a byte the C encoder leaves unwritten differs from the reference's."""
    monkeypatch.setattr(native, "plane_buffer", lambda n: np.full(n, 0xA5, dtype=np.uint8))


def assert_same_planes(a, b) -> None:
    assert a.encoding == b.encoding == "huffman"
    assert (a.planes.k, a.planes.total_bits, a.planes.first_symbol, a.planes.crc32c) == (
        b.planes.k, b.planes.total_bits, b.planes.first_symbol, b.planes.crc32c,
    )  # fmt: skip
    for name, plane in a.planes.tensors().items():
        assert torch.equal(plane, b.planes.tensors()[name]), name


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 10**12), min_size=1, max_size=2048), st.integers(9, 16))
def test_c_package_merge_gives_the_reference_lengths(counts, max_len):
    counts = np.array(counts, dtype=np.int64)
    if np.count_nonzero(counts) > 1 << max_len:
        return
    assert np.array_equal(native.code_lengths(native.load(), counts, max_len),
                          code_lengths(counts, max_len))  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_c_package_merge_on_skewed_and_tied_histograms(lib, seed):
    rng = np.random.default_rng(seed)
    symbols = 1 << int(rng.integers(1, 12))
    shapes = [
        (rng.geometric(0.05, symbols) ** 6).astype(np.int64),  # long codes hit the bound
        rng.integers(0, 3, symbols),  # ties everywhere
        np.where(rng.random(symbols) < 0.9, 0, 10 ** rng.integers(0, 12, symbols)),
        np.r_[10**15, np.ones(symbols - 1, dtype=np.int64)],  # one dominant symbol
    ]
    for counts in shapes:
        expected = code_lengths(counts)
        assert np.array_equal(native.code_lengths(lib, counts, MAX_CODE_LEN), expected)
        assert expected.max() <= MAX_CODE_LEN


def test_c_package_merge_rejects_too_many_symbols(lib):
    with pytest.raises(ValueError):
        native.code_lengths(lib, np.ones(2048, dtype=np.int64), 10)


def tensor_of(dtype, n, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(dtype)
    return w.reshape(1, n)


SIZES = [1024, 1031, 1153, 4099, 9000, 20_011]


@pytest.mark.parametrize("dtype", list(LAYOUTS))
@pytest.mark.parametrize("n", SIZES)
def test_threads_write_the_planes_of_one_thread_and_of_the_reference(dtype, n, monkeypatch):
    t = tensor_of(dtype, n, seed=n)
    reference = encode_tensor(t, "w", backend="reference")
    one = encode_tensor(t, "w", backend="native", num_threads=1)
    assert_same_planes(one, reference)
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 128)  # chunks of 128 elements and up
    for threads in (2, 3, 8, 64):
        assert_same_planes(encode_tensor(t, "w", backend="native", num_threads=threads), one)


@pytest.mark.parametrize("dtype", list(LAYOUTS))
def test_runs_of_the_longest_codes(dtype, monkeypatch):
    """Half the elements one symbol, half spread over the whole alphabet at the finest split:
    codes of 1 bit and of the most bits (12 for BF16 and FP32), often four of the longest in
    a row (the C encoder joins four codes, up to 48 bits, before it shifts them out), across
    chunk starts."""
    layout = LAYOUTS[dtype]
    k, n = min(layout.candidate_ks()), 30_011
    rng = np.random.default_rng(7)
    symbols = 1 << (layout.width - 1 - k)
    sym = np.where(rng.random(n) < 0.5, 1, rng.integers(0, symbols, size=n))
    u = (rng.integers(0, 2, size=n) << (layout.width - 1)) | (sym << k) | rng.integers(0, 1 << k, n)
    bits = u.astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[layout.width // 8])
    t = torch.from_numpy(bits.view(np.dtype(f"i{layout.width // 8}"))).view(dtype).reshape(1, n)
    reference = encode_tensor(t, "w", k=k, backend="reference")
    lengths = code_lengths(np.bincount(sym, minlength=symbols))
    assert lengths.max() == min(MAX_CODE_LEN, layout.width - k)  # BF16, FP32: 12
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 128)
    for threads in (1, 3):
        native_planes = encode_tensor(t, "w", k=k, backend="native", num_threads=threads)
        assert_same_planes(native_planes, reference)


def test_chunk_boundaries_fall_mid_byte_and_mid_segment(lib, monkeypatch):
    """The sizes above do exercise shared bytes: chunk starts land at odd bits, inside
    segments, and chunks span several segments and blocks."""
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 128)
    t = tensor_of(torch.bfloat16, 20_011, seed=1).reshape(-1)
    flat = t.view(torch.int16).numpy().view(np.uint16)
    bounds = native.chunk_bounds(flat.size, 64)
    counts = native.histogram(lib, flat, 5, bounds, 2)
    lengths = code_lengths(counts.sum(0))
    starts = np.cumsum(counts @ lengths.astype(np.int64))[:-1]
    assert len(bounds) == 20_011 // 128 + 1 and np.all(bounds[1:-1] % 128 == 0)
    assert np.any(starts % 8 != 0) and np.any(starts % SEG_BITS != 0)
    assert starts[-1] > 32 * SEG_BITS


@pytest.mark.parametrize("dtype", list(LAYOUTS))
@pytest.mark.parametrize("n", [1, 5, 16, 17, 127, 129, 300, 385])
def test_tiny_tensors_at_a_given_split(dtype, n, monkeypatch):
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 128)
    t = tensor_of(dtype, n, seed=3)
    for k in LAYOUTS[dtype].candidate_ks():
        reference = encode_tensor(t, "w", k=k, backend="reference")
        for threads in (1, 4):
            assert_same_planes(encode_tensor(t, "w", k=k, backend="native", num_threads=threads),
                               reference)  # fmt: skip


@pytest.mark.parametrize("dtype", list(LAYOUTS))
def test_a_single_symbol_on_many_threads(dtype, monkeypatch):
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 128)
    t = torch.full((7, 1001), 0.5, dtype=dtype)
    reference = encode_tensor(t, "w", backend="reference")
    assert_same_planes(encode_tensor(t, "w", backend="native", num_threads=5), reference)
    assert reference.planes.total_bits == t.numel()


def test_compress_dir_writes_the_same_shards_on_any_thread_count(tmp_path, monkeypatch):
    """Large tensors split across the threads, runs of small ones share the pool; the shard
    bytes and the order of the records do not depend on it."""
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 1024)  # large: 2048 elements or more
    tensors = {f"w{i}": tensor_of(torch.bfloat16, n, seed=i) for i, n in enumerate(
        [300, 5000, 1100, 1200, 700, 9000, 1024])}  # fmt: skip
    tensors["norm"] = torch.ones(64)
    (tmp_path / "in").mkdir()
    save_file(tensors, str(tmp_path / "in" / "model.safetensors"))
    seen = {}
    for threads in (1, 3):
        seen[threads] = []
        compress_dir(tmp_path / "in", tmp_path / f"out{threads}", seen[threads].append, threads)
    assert [r.name for r in seen[3]] == [r.name for r in seen[1]] == sorted(tensors)
    one, three = (ShardReader(tmp_path / f"out{t}" / "model.tison") for t in (1, 3))
    for name in tensors:  # (the shard's bytes differ: safetensors orders its metadata at random)
        a, b = one.encoded(name), three.encoded(name)
        assert a.encoding == b.encoding and a.crc32c == b.crc32c
        if a.planes is not None:
            assert_same_planes(a, b)


def test_the_codec_sources_compile_for_aarch64(tmp_path):
    """The portable C (no x86 intrinsic outside its guard) also builds for aarch64."""
    compiler = cross_compiler()
    if compiler is None:
        pytest.skip("no aarch64 cross-compiler (Debian: gcc-aarch64-linux-gnu)")
    for source in native._SOURCES:
        cmd = [compiler, *native._FLAGS, "-Werror=implicit-function-declaration", "-c", source]
        result = subprocess.run([*cmd, "-o", tmp_path / f"{source.stem}.o"], capture_output=True,
                                text=True)  # fmt: skip
        assert result.returncode == 0, result.stderr


def assert_same_entry(a, b) -> None:
    """The same EncodedTensor: name, dtype, shape, CRC-32C, and the same planes or raw bytes."""
    assert (a.name, a.dtype, a.shape, a.crc32c, a.encoding) == (
        b.name, b.dtype, b.shape, b.crc32c, b.encoding,
    )  # fmt: skip
    if a.encoding == "huffman":
        assert_same_planes(a, b)
    else:
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))


def mixed_tensors() -> dict[str, torch.Tensor]:
    """A batch of every kind encode_tensor tells apart: each coded float format (one of them at
    two sizes), a 1-D and a tiny float (kept raw), integers and bools (raw: no float layout),
    an empty tensor, random bytes that coding would not shrink, and one single symbol."""
    g = torch.Generator().manual_seed(5)
    tensors = {f"{dtype}": tensor_of(dtype, 5000, seed=i) for i, dtype in enumerate(LAYOUTS)}
    tensors |= {
        "bf16 large": tensor_of(torch.bfloat16, 70_000, seed=9).reshape(7, 10_000),
        "norm": torch.randn(4096, generator=g).bfloat16(),
        "tiny": torch.randn(2, 3, generator=g),
        "ids": torch.arange(3000, dtype=torch.int64).reshape(30, 100),
        "mask": torch.rand(64, 64, generator=g) > 0.5,
        "empty": torch.zeros(0, 16, dtype=torch.bfloat16),
        "noise": torch.randint(-(2**15), 2**15, (64, 512), generator=g, dtype=torch.int16).view(
            torch.bfloat16
        ),
        "constant": torch.full((40, 100), 0.5, dtype=torch.float16),
        "strided": torch.randn(96, 200, generator=g).bfloat16()[:, ::2],
    }
    return tensors


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_batch_of_small_tensors_gives_encode_tensor_of_each(threads):
    """encode_tensors sends tensors up to MAX_BATCHED_ELEMENTS through two C calls (many.py):
    the entries of encode_tensor one by one, in order, on any thread count."""
    tensors = mixed_tensors()
    batch = encode_tensors(tensors, num_threads=threads)
    assert [e.name for e in batch] == list(tensors)
    for e, (name, t) in zip(batch, tensors.items()):
        assert_same_entry(e, encode_tensor(t, name, num_threads=1))
    assert {e.name for e in batch if e.encoding == "huffman"} >= {"bf16 large", "constant"}
    assert {e.name for e in batch if e.encoding != "huffman"} >= {"norm", "ids", "noise"}


def test_batches_and_large_tensors_keep_the_order(monkeypatch):
    """Tensors over MAX_BATCHED_ELEMENTS encode alone between the batches before and after
    them, and a batch is cut at BATCH_ELEMENTS or BATCH_TENSORS."""
    monkeypatch.setattr(many, "MAX_BATCHED_ELEMENTS", 20_000)
    monkeypatch.setattr(many, "BATCH_ELEMENTS", 12_000)
    calls = []
    batch_of = many.encode_batch
    monkeypatch.setattr(many, "encode_batch", lambda *a: calls.append(len(a[1])) or batch_of(*a))
    sizes = [5000, 6000, 70_000, 3000, 4000, 9000, 30_000, 100]
    tensors = {f"w{i}": tensor_of(torch.bfloat16, n, seed=i) for i, n in enumerate(sizes)}
    batch = encode_tensors(tensors, num_threads=2)
    assert [e.name for e in batch] == list(tensors)
    for e, (name, t) in zip(batch, tensors.items()):
        assert_same_entry(e, encode_tensor(t, name, num_threads=1))
    assert [c for c in calls if c] == [2, 2, 1, 1]  # w0 w1 | w2 | w3 w4 | w5 | w6 | w7
    monkeypatch.setattr(many, "BATCH_TENSORS", 1)
    calls.clear()
    again = encode_tensors(tensors, num_threads=2)
    assert [c for c in calls if c] == [1] * 6  # every small one alone
    for e, f in zip(again, batch):
        assert_same_entry(e, f)


def test_encode_tensors_gives_encode_tensor_of_each_in_order(monkeypatch):
    monkeypatch.setattr(native, "MIN_CHUNK_ELEMENTS", 1024)
    tensors = {
        f"w{i}": tensor_of(torch.float16, n, seed=i) for i, n in enumerate([9000, 1500, 3000])
    }
    batch = encode_tensors(tensors, num_threads=3)
    assert [e.name for e in batch] == list(tensors)
    for e, (name, t) in zip(batch, tensors.items()):
        assert_same_planes(e, encode_tensor(t, name, num_threads=1))
