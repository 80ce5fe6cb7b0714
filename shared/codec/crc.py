"""CRC-32C (Castagnoli; the checksum of iSCSI and ext4), the codec's checksum since format
version 2, in vectorised numpy: the reference for the C fast path (_crc32c.c), and the
checksum where no C compiler works.

The bytes are cut into rows that are checksummed side by side, one byte column per step,
from a zero register; the rows' registers are then joined pairwise, the left one shifted
past the right one's bytes (a multiplication by x**(8 * length) modulo the polynomial, as in
zlib's crc32_combine). The register is linear in the bytes, so leading zeros change
nothing and the initial register is shifted past the whole buffer separately."""

import numpy as np

_POLY = 0x82F63B78  # reflected Castagnoli polynomial
_MASK = 0xFFFFFFFF


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


_TABLE = _byte_table()


def _multmodp(a: int, b):
    """a * b modulo the polynomial (bit 31 is x**0); b an int or a uint32 array."""
    product = b ^ b
    m = 1 << 31
    while m:
        if a & m:
            product = product ^ b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ (_POLY * (b & 1))
    return product


def _shift_bytes(length: int) -> int:
    """x**(8 * length) modulo the polynomial."""
    x, square = 1 << 31, 1 << 23  # x**0, x**8
    while length:
        if length & 1:
            x = _multmodp(square, x)
        square = _multmodp(square, square)
        length >>= 1
    return x


def crc32c(data, crc: int = 0) -> int:
    """CRC-32C of a bytes-like object or contiguous array, continuing from crc (0 to start):
    crc32c(b"123456789") == 0xE3069283."""
    buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    buf = buf.reshape(-1).view(np.uint8)
    n = buf.size
    if n == 0:
        return crc
    width = 1 << max(4, (n.bit_length() + 1) // 2)  # about sqrt(n) bytes per row
    rows = -(-n // width)
    grid = np.zeros(rows * width, dtype=np.uint8)
    grid[rows * width - n :] = buf  # leading zeros
    grid = grid.reshape(rows, width)
    reg = np.zeros(rows, dtype=np.uint32)
    for i in range(width):
        reg = (reg >> 8) ^ _TABLE[(reg ^ grid[:, i]) & 255]
    levels = max(0, (rows - 1).bit_length())
    reg = np.concatenate([np.zeros((1 << levels) - rows, dtype=np.uint32), reg])
    length = width
    while reg.size > 1:
        reg = _multmodp(_shift_bytes(length), reg[0::2]) ^ reg[1::2]
        length *= 2
    start = _multmodp(_shift_bytes(n), ~crc & _MASK)
    return ~(start ^ int(reg[0])) & _MASK


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of A + B from crc1 of A, crc2 of B and len2 = len(B)."""
    return _multmodp(_shift_bytes(len2), crc1) ^ crc2
