"""Bit-exact round trips of single tensors through the codec, on the C fast path and on the
numpy reference, for every coded dtype and split point, including NaN, inf, subnormals,
all-equal tensors and empty ones."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.build import compiler
from shared.codec import decode_tensor, decode_tensors, encode_tensor
from shared.codec.format import LAYOUTS, SEGS_PER_BLOCK
from shared.errors import ModelFolderError

from compilers import needs_compiler

BACKENDS = ["native", "reference"]
FLOAT_DTYPES = list(LAYOUTS)
needs_native = needs_compiler


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(LAYOUTS[t.dtype].int_dtype) if t.dtype in LAYOUTS else t


def assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits_of(a), bits_of(b))


def weights(shape, dtype, seed=0, scale=0.02) -> torch.Tensor:
    """Trained-like weights (normal) with NaN, +-inf, -0, subnormals and extremes mixed in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * scale
    flat = w.view(-1)
    info = torch.finfo(dtype)
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, info.tiny / 4, info.max, info.min]
    idx = torch.randint(0, flat.numel(), (len(specials) * 3,), generator=g)
    for i, j in enumerate(idx.tolist()):
        flat[j] = specials[i % len(specials)]
    return w.to(dtype)


@st.composite
def random_bits(draw):
    """A 2-D tensor of any float dtype with arbitrary bit patterns."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 70))
    width = LAYOUTS[dtype].width // 8
    raw = draw(st.binary(min_size=rows * cols * width, max_size=rows * cols * width))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(rows, cols)
    k = draw(st.sampled_from(LAYOUTS[dtype].candidate_ks()))
    return t, k


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_bits(), st.sampled_from(BACKENDS), st.sampled_from(BACKENDS))
def test_arbitrary_bits_round_trip_at_every_split(case, encode_backend, decode_backend):
    tensor, k = case
    encoded = encode_tensor(tensor, "w", k=k, backend=encode_backend)
    assert encoded.planes is not None and encoded.planes.k == k
    assert_identical(decode_tensor(encoded, backend=decode_backend), tensor)


@needs_native
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_weights_with_specials_compress_and_round_trip(dtype):
    tensor = weights((96, 77), dtype)
    native = encode_tensor(tensor, "w", backend="native")
    reference = encode_tensor(tensor, "w", backend="reference")
    assert native.planes is not None and native.stored_nbytes() < native.original_nbytes()
    for name, plane in native.planes.tensors().items():
        assert torch.equal(plane, reference.planes.tensors()[name]), name
    assert native.planes.k == reference.planes.k
    for backend in BACKENDS:
        assert_identical(decode_tensor(native, backend=backend), tensor)


@needs_native
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, float("nan"), float("-inf")])
def test_all_equal_tensors(backend, value):
    tensor = torch.full((64, 48), value, dtype=torch.bfloat16)
    encoded = encode_tensor(tensor, "w", backend=backend)
    assert encoded.planes is not None  # one 1-bit code per element beats 16 raw bits
    assert encoded.stored_nbytes() < encoded.original_nbytes() // 2
    assert_identical(decode_tensor(encoded, backend=backend), tensor)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.empty(0, 5, dtype=torch.bfloat16),
        torch.empty(0, dtype=torch.float32),
        torch.tensor(3.5, dtype=torch.bfloat16),
        torch.randn(5000).to(torch.bfloat16),  # 1-D: norms and biases stay raw
        torch.randn(3, 4).to(torch.bfloat16),  # too small to pay for a table
        torch.arange(6000, dtype=torch.int64).reshape(60, 100),
        torch.randint(-128, 127, (50, 50), dtype=torch.int8),
        torch.rand(40, 40) > 0.5,
        torch.randn(40, 40, dtype=torch.float64),
    ],
    ids=lambda t: f"{t.dtype}{list(t.shape)}",
)
def test_other_tensors_are_stored_raw(tensor):
    encoded = encode_tensor(tensor, "t")
    assert encoded.planes is None and encoded.stored_nbytes() == encoded.original_nbytes()
    assert_identical(decode_tensor(encoded), tensor)


def test_non_contiguous_input_round_trips_as_its_contiguous_copy():
    tensor = weights((128, 64), torch.bfloat16).t()
    assert_identical(decode_tensor(encode_tensor(tensor, "w")), tensor.contiguous())


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_many_blocks_decode_the_same_on_any_thread_count(dtype):
    # Millions of elements, so that several threads each take runs of blocks; an odd
    # element count leaves ragged ends.
    tensor = weights((2047, 1601), dtype, seed=3)
    encoded = encode_tensor(tensor, "w")
    assert len(encoded.planes.block_first) > 16
    for threads in (1, 2, 3, 7):
        assert_identical(decode_tensor(encoded, backend="native", num_threads=threads), tensor)


def test_block_index_spacing():
    tensor = weights((300, 300), torch.bfloat16, seed=5)
    planes = encode_tensor(tensor, "w").planes
    starts = planes.block_first.numpy()
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)
    assert len(planes.gaps) * 2 >= (len(starts) - 1) * SEGS_PER_BLOCK


@needs_native
def test_a_batch_decodes_like_one_tensor_at_a_time():
    tensors = [weights((600, 500), torch.bfloat16, seed=s) for s in range(3)]
    tensors += [weights((64, 40), torch.float8_e4m3fn), torch.randn(300).to(torch.bfloat16)]
    tensors += [weights((1300, 1100), torch.float16, seed=9), weights((50, 40), torch.float32)]
    encoded = [encode_tensor(t, f"t{i}") for i, t in enumerate(tensors)]
    for threads in (1, 2, 5):
        for backend in BACKENDS:
            decoded = decode_tensors(encoded, backend=backend, num_threads=threads)
            for got, tensor in zip(decoded, tensors):
                assert_identical(got, tensor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fused_check_catches_a_flipped_raw_bit(backend, threads):
    # The code stream stays valid, so only the checksum of the output can catch this; on the
    # C path it is computed tile by tile, per run, and joined across threads.
    if backend == "native" and compiler() is None:
        pytest.skip("no C compiler (cc or gcc) on PATH")
    tensors = [weights((40, 40), torch.bfloat16), weights((1100, 1000), torch.bfloat16, seed=4)]
    encoded = [encode_tensor(t, f"w{i}") for i, t in enumerate(tensors)]
    raw = encoded[1].planes.raw
    raw[raw.numel() // 2 + 5] ^= 4
    with pytest.raises(ModelFolderError, match="'w1'.*checksum mismatch"):
        decode_tensors(encoded, backend=backend, num_threads=threads)
    unchecked = decode_tensors(encoded, backend=backend, num_threads=threads, verify=False)
    assert_identical(unchecked[0], tensors[0])
    differs = bits_of(unchecked[1]) != bits_of(tensors[1])
    assert int(differs.sum()) == 1


@needs_native
@pytest.mark.parametrize("plane", ["stream", "block_first", "gaps", "lengths"])
def test_damaged_structure_is_named_on_both_paths(plane):
    tensor = weights((700, 600), torch.bfloat16, seed=8)
    for backend in BACKENDS:
        encoded = encode_tensor(tensor, "w")
        t = encoded.planes.tensors()[plane]
        if plane == "block_first":
            t[1] = t[2] + 1  # no longer increasing
        elif plane == "lengths":
            t[len(t) // 2] ^= 0x11  # no longer a complete prefix code
        elif plane == "gaps":
            t[0] ^= 0x0A  # where the first code starts: every decoder reads it
        else:
            t[len(t) // 2 : len(t) // 2 + 4] ^= 0x5A
        with pytest.raises(ModelFolderError, match="'w'"):
            decode_tensors([encoded], backend=backend)
