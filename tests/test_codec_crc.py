"""CRC-32C, the codec's checksum: the numpy reference (shared/codec/crc.py) against published
check values and against the C fast path (_crc32c.c), and joining the CRCs of pieces."""

import os

import numpy as np
import pytest
import torch

from shared.codec import native
from shared.codec.crc import crc32c, crc32c_combine
from shared.codec.tensor import checksum

needs_native = pytest.mark.skipif(native.load() is None, reason="no C compiler for the fast path")


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


@needs_native
# Lengths around the 256-byte rounds of the folding path (AVX-512 VPCLMULQDQ CPUs).
@pytest.mark.parametrize(
    "length", [0, 1, 5, 8, 15, 16, 17, 100, 255, 256, 257, 511, 512, 519, 4096, 4099, 1 << 20]
)
def test_c_matches_the_reference(length):
    lib = native.load()
    data = np.frombuffer(os.urandom(length), dtype=np.uint8).copy()
    start = 0xDEADBEEF if length % 2 else 0
    got = native.crc32c(lib, data.ctypes.data, length, start)
    assert got == crc32c(data, start)
    tensor = torch.from_numpy(data)
    assert checksum(tensor, lib) == checksum(tensor) == crc32c(data)
    # Every way this CPU has (tables; the crc32 instruction; carry-less folding), not just
    # the fastest one that native.crc32c takes.
    for how in range(3):
        assert lib.tc_crc32c_by(how, start, data.ctypes.data, length) in (-1, got)
