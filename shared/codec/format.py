"""Constants and in-memory types of the Tison weight codec, format version 2 (see FORMAT.md).

A float element of `width` bits is split at bit `k`:
  symbol = the `width - 1 - k` bits under the sign (the exponent and the top mantissa bits),
           entropy-coded with one canonical Huffman code per tensor;
  raw    = sign bit above the `k` low mantissa bits (`k + 1` bits), stored verbatim.
"""

from dataclasses import dataclass

import torch

FORMAT_NAME = "tison-codec"
FORMAT_VERSION = 2  # 2: CRC-32C checksums (1: zlib's CRC-32)
MAX_CODE_LEN = 12  # longest Huffman code; decode tables have at most 2**12 entries
SEG_BITS = 2048  # the code stream is cut into segments of this many bits...
SEGS_PER_BLOCK = 32  # ...and segments into blocks; each block records its first symbol index
MAX_SYMBOL_BITS = 11  # widest coded field: at most 2048 symbols, well under 2**MAX_CODE_LEN
MIN_CODED_ELEMENTS = 1024  # smaller tensors are stored raw: the code table would not pay off
HUFFMAN = "huffman"
RAW = "raw"


@dataclass(frozen=True)
class FloatLayout:
    """Bit layout of a float dtype the codec can entropy-code."""

    dtype: torch.dtype
    width: int  # bits per element
    exponent_bits: int
    int_dtype: torch.dtype  # same-width integer dtype used to view the bits

    def candidate_ks(self) -> list[int]:
        """Split points worth trying: code the exponent plus 0..3 top mantissa bits."""
        widest = min(self.width - 1, self.exponent_bits + 3, MAX_SYMBOL_BITS)
        return [self.width - 1 - s for s in range(self.exponent_bits, widest + 1)]


LAYOUTS = {
    layout.dtype: layout
    for layout in (
        FloatLayout(torch.bfloat16, 16, 8, torch.int16),
        FloatLayout(torch.float16, 16, 5, torch.int16),
        FloatLayout(torch.float32, 32, 8, torch.int32),
        FloatLayout(torch.float8_e4m3fn, 8, 4, torch.uint8),
        FloatLayout(torch.float8_e5m2, 8, 5, torch.uint8),
    )
}

# safetensors dtype names <-> torch dtypes, for the per-tensor metadata.
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def padded_plane_bytes(num_bits: int) -> int:
    """Byte size of a bit plane: whole 32-bit words plus 8 bytes, so decoders may read
    whole words (GPU) or 8-byte windows (CPU) at any bit position inside it."""
    return 4 * (-(-num_bits // 32)) + 8


def raw_parts(raw_bits: int) -> list[tuple[int, int]]:
    """(bits, shift) of each part a raw field is split into: the binary digits of raw_bits,
    widest part holding the lowest bits. 6 bits -> [(4, 0), (2, 4)]."""
    parts, shift = [], 0
    for bits in (16, 8, 4, 2, 1):
        if raw_bits & bits:
            parts.append((bits, shift))
            shift += bits
    return parts


def raw_part_bytes(n: int, bits: int) -> int:
    """Byte size of the plane of one part: whole 16-byte groups plus 16 bytes of slack."""
    return 16 * (-(-n * bits // 128)) + 16


def raw_layout(n: int, raw_bits: int) -> list[tuple[int, int, int]]:
    """(bits, shift, byte offset in the raw plane) of each part of n raw fields."""
    layout, offset = [], 0
    for bits, shift in raw_parts(raw_bits):
        layout.append((bits, shift, offset))
        offset += raw_part_bytes(n, bits)
    return layout


def raw_plane_bytes(n: int, raw_bits: int) -> int:
    return sum(raw_part_bytes(n, bits) for bits, _ in raw_parts(raw_bits))


def block_index_dtype(num_elements: int) -> torch.dtype:
    return torch.int32 if num_elements < 1 << 31 else torch.int64


def num_segments(total_bits: int) -> int:
    return -(-total_bits // SEG_BITS)


def num_blocks(total_bits: int) -> int:
    return -(-num_segments(total_bits) // SEGS_PER_BLOCK)


@dataclass(frozen=True)
class CodedPlanes:
    """The planes of one Huffman-coded tensor (all 1-D, on any device).

    stream:      uint8, the concatenated codes, MSB-first, padded (padded_plane_bytes)
    raw:         uint8, the raw fields (k + 1 bits each) split into parts of 16/8/4/2/1 bits,
                 one packed plane per part (raw_layout)
    lengths:     uint8, the 4-bit code lengths of symbols first_symbol, first_symbol + 1, ...
                 (0 = unused), two per byte, low nibble first
    gaps:        uint8, two 4-bit entries per byte (low nibble first): for segment s, how
                 many bits after s * SEG_BITS the first code starting in it begins
    block_first: int32 (int64 for tensors of 2**31 elements or more) [num_blocks], index of
                 the first element whose code starts in each block
    """

    stream: torch.Tensor
    raw: torch.Tensor
    lengths: torch.Tensor
    gaps: torch.Tensor
    block_first: torch.Tensor
    k: int  # split point: bits below it are raw mantissa
    total_bits: int  # length of the code stream in bits
    first_symbol: int  # symbol of the first entry of `lengths`
    crc32c: int  # CRC-32C of the planes' bytes in the order of tensors(): checked on reading

    def to(self, device: torch.device | str) -> "CodedPlanes":
        move = lambda t: t.to(device)
        return CodedPlanes(
            move(self.stream),
            move(self.raw),
            move(self.lengths),
            move(self.gaps),
            move(self.block_first),
            self.k,
            self.total_bits,
            self.first_symbol,
            self.crc32c,
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "stream": self.stream,
            "raw": self.raw,
            "lengths": self.lengths,
            "gaps": self.gaps,
            "block_first": self.block_first,
        }

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor as the codec stores it: Huffman-coded planes, or the tensor itself (raw)."""

    name: str
    source: str  # file it was read from (or "<memory>"), named in errors
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32c: int  # CRC-32C of the original tensor's bytes
    planes: CodedPlanes | None  # None for raw tensors
    data: torch.Tensor | None  # the tensor itself for raw tensors, else None

    @property
    def encoding(self) -> str:
        return RAW if self.planes is None else HUFFMAN

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def original_nbytes(self) -> int:
        return self.num_elements * self.dtype.itemsize

    def stored_nbytes(self) -> int:
        if self.planes is None:
            return self.original_nbytes()
        return self.planes.nbytes()

    def to(self, device: torch.device | str) -> "EncodedTensor":
        """The same tensor with its planes (still compressed) moved to `device`."""
        planes = None if self.planes is None else self.planes.to(device)
        data = None if self.data is None else self.data.to(device)
        return EncodedTensor(
            self.name, self.source, self.dtype, self.shape, self.crc32c, planes, data
        )


class PlaneError(ValueError):
    """Planes that contradict their metadata or each other. Never leaves shared.codec:
    decoding turns it into a ModelFolderError naming the file and the tensor."""
