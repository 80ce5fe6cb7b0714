"""CRC-32 (zlib's) of a buffer computed in pieces: crc32_combine joins the CRCs of two
adjacent pieces, so threads can checksum the parts they decoded. Port of zlib 1.2.12's
crc32_combine (polynomial arithmetic modulo the CRC polynomial, reflected)."""

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if (a & (m - 1)) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table = [1 << 30]  # x**1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _powers()  # _X2N[i] = x**(2**i) modulo the polynomial


def _x2nmodp(n: int, k: int) -> int:
    """x**(n * 2**k) modulo the polynomial."""
    product = 1 << 31  # x**0
    while n:
        if n & 1:
            product = _multmodp(_X2N[k & 31], product)
        n >>= 1
        k += 1
    return product


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) in bytes."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2
