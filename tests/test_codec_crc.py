"""CRC-32C, the codec's checksum: the numpy reference (shared/codec/crc.py) against published
check values and against the C fast path (_crc32c.c), and joining the CRCs of pieces."""

import os

import numpy as np
import pytest
import torch

from shared.codec import native
from shared.codec.crc import crc32c, crc32c_combine
from shared.codec.tensor import checksum

from compilers import needs_compiler

needs_native = needs_compiler


def test_check_values():
    # RFC 3720 (iSCSI) B.4 and the common "123456789" check value.
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(b"") == 0


@pytest.mark.parametrize("length", [1, 7, 8, 9, 255, 4096, 65537, 1 << 20])
def test_continuing_and_combining(length):
    a, b = os.urandom(length // 3), os.urandom(length)
    assert crc32c(b, crc32c(a)) == crc32c(a + b)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


# Lengths around the 256-byte rounds of the folding path (AVX-512 VPCLMULQDQ CPUs).
LENGTHS = [0, 1, 5, 8, 15, 16, 17, 100, 255, 256, 257, 511, 512, 519, 4096, 4099, 1 << 20]


def random_bytes(length: int) -> tuple[np.ndarray, int]:
    """(data, a starting CRC): odd lengths continue from a nonzero CRC."""
    return np.frombuffer(os.urandom(length), dtype=np.uint8).copy(), 0xDEADBEEF if length % 2 else 0


@needs_native
@pytest.mark.parametrize("length", LENGTHS)
def test_c_matches_the_reference(length):
    lib = native.load()
    data, start = random_bytes(length)
    assert native.crc32c(lib, data.ctypes.data, length, start) == crc32c(data, start)
    tensor = torch.from_numpy(data)
    assert checksum(tensor, lib) == checksum(tensor) == crc32c(data)


@needs_native
@pytest.mark.parametrize("length", [3 << 16, (3 << 17) - 1, (3 << 17) + 7, 5_000_011])
@pytest.mark.parametrize("threads", [1, 2, 7])
def test_c_on_threads_matches_the_reference(length, threads):
    """Buffers of three 64 KiB pieces or more are cut into pieces, three a thread, joined."""
    lib = native.load()
    data, start = random_bytes(length)
    assert native.crc32c(lib, data.ctypes.data, length, start, threads) == crc32c(data, start)


def way(how: int, name: str, what: str):
    """One way the C code computes a CRC (native.crc32c only takes the fastest this CPU has),
    skipped with the reason where this CPU lacks it (tc_crc32c_by answers -1)."""
    lib, probe = native.load(), np.zeros(1, dtype=np.uint8)
    if lib is None:
        reason = "no C compiler for the fast path"
    elif lib.tc_crc32c_by(how, 0, probe.ctypes.data, 1) == -1:
        reason = f"this CPU cannot compute CRCs by {what}"
    else:
        return pytest.param(how, id=name)
    return pytest.param(how, id=name, marks=pytest.mark.skip(reason=reason))


@pytest.mark.parametrize(
    "how",
    [
        way(0, "tables", "lookup tables"),
        way(1, "crc32", "the crc32 instruction (SSE4.2)"),
        way(2, "folding", "carry-less folding (AVX-512 VPCLMULQDQ)"),
    ],
)
@pytest.mark.parametrize("length", LENGTHS)
def test_every_way_this_cpu_has_matches_the_reference(how, length):
    data, start = random_bytes(length)
    assert native.load().tc_crc32c_by(how, start, data.ctypes.data, length) == crc32c(data, start)
