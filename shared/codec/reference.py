"""Reference encoder and decoder of the code planes in vectorised numpy.

The decoder walks every segment of the stream in lock-step, one code per step, as a GPU
would (one segment per thread). It defines the format; the C decoder and the CUDA kernel
are checked against it. Slow (tens of MB/s) but dependency-free.
"""

import numpy as np

from shared.codec.format import (
    SEG_BITS,
    SEGS_PER_BLOCK,
    PlaneError,
    num_segments,
    padded_plane_bytes,
    raw_layout,
    raw_plane_bytes,
)
from shared.codec.huffman import canonical_codes, decode_table


def split(bits: np.ndarray, width: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, raw field) of each element: the bits under the sign down to bit k, and the
    sign bit stacked on the k low bits."""
    u = bits.astype(np.uint32)
    symbol_mask = (1 << (width - 1 - k)) - 1
    symbols = (u >> k) & symbol_mask
    raw = ((u >> (width - 1)) << k) | (u & ((1 << k) - 1))
    return symbols.astype(np.int64), raw


def join(symbols: np.ndarray, raw: np.ndarray, width: int, k: int) -> np.ndarray:
    """Inverse of split: the element bits as uint32."""
    symbols = symbols.astype(np.uint32)
    return ((raw >> k) << (width - 1)) | (symbols << k) | (raw & ((1 << k) - 1))


def encode(bits: np.ndarray, width: int, k: int, lengths: np.ndarray) -> dict:
    """Code planes (numpy) of the flat element bits under the given code lengths."""
    symbols, raw = split(bits, width, k)
    code_lens = lengths.astype(np.int64)[symbols]
    ends = np.cumsum(code_lens)
    starts = ends - code_lens
    total_bits = int(ends[-1]) if len(ends) else 0
    codes = canonical_codes(lengths).astype(np.uint64)[symbols]
    gaps, block_first = _segment_index(starts, total_bits)
    return {
        "stream": _pack_msb_first(codes, code_lens, starts, total_bits),
        "raw": _pack_fields(raw, k + 1),
        "gaps": gaps,
        "block_first": block_first,
        "total_bits": total_bits,
    }


def decode(planes: dict, width: int, k: int, total_bits: int, n: int) -> np.ndarray:
    """Element bits (uint32[n]) from numpy planes whose sizes were already validated.
    Raises PlaneError where the planes contradict each other."""
    table, bits = decode_table(planes["lengths"])
    n_seg = num_segments(total_bits)
    seg_start = np.arange(n_seg, dtype=np.int64) * SEG_BITS
    gaps = np.stack([planes["gaps"] & 15, planes["gaps"] >> 4], axis=1).reshape(-1)[:n_seg]
    start = seg_start + gaps
    end = np.minimum(seg_start + SEG_BITS, total_bits)
    counts, finals = _walk(planes["stream"], table, bits, start, end)
    if n_seg and (np.any(finals[:-1] != start[1:]) or finals[-1] != total_bits):
        raise PlaneError("code stream does not match its segment index")
    first = np.cumsum(counts) - counts
    if int(counts.sum()) != n or np.any(first[::SEGS_PER_BLOCK] != planes["block_first"]):
        raise PlaneError("code stream does not match its block index")
    symbols = np.empty(n, dtype=np.int64)
    _walk(planes["stream"], table, bits, start, end, out=symbols, first=first)
    raw = _unpack_fields(planes["raw"], k + 1, n)
    return join(symbols, raw, width, k)


def _walk(stream, table, bits, pos, end, out=None, first=None):
    """Steps every segment's decoder one code at a time. Returns (codes per segment, bit
    position after each segment's last code); writes symbols to out[first + i] if given."""
    counts = np.zeros(len(pos), dtype=np.int64)
    finals = pos.copy()
    live = np.flatnonzero(pos < end)
    p, e = pos[live], end[live]
    o = None if out is None else first[live].copy()
    stream = stream.astype(np.uint32)
    while live.size:
        byte = p >> 3
        # (24-bit big-endian window at the byte holding p) -> the next `bits` bits.
        word = (stream[byte] << 16) | (stream[byte + 1] << 8) | stream[byte + 2]
        entry = table[(word >> (24 - (p & 7) - bits)) & ((1 << bits) - 1)]
        if out is not None:
            out[o] = entry >> 4
            o += 1
        p = p + (entry & 15)
        counts[live] += 1
        alive = p < e
        finals[live[~alive]] = p[~alive]
        live, p, e = live[alive], p[alive], e[alive]
        o = None if o is None else o[alive]
    return counts, finals


def _pack_msb_first(codes, code_lens, starts, total_bits) -> np.ndarray:
    """Concatenates codes MSB-first into a padded byte plane: each code lands in one or two
    64-bit words; codes in one word are OR-reduced, the spill of a straddling code is added."""
    nbytes = padded_plane_bytes(total_bits)
    words = np.zeros(-(-nbytes // 8), dtype=np.uint64)
    if len(codes):
        word = starts >> 6
        end = (starts & 63) + code_lens  # bit after the code, counted from the word's MSB
        fits = end <= 64
        left = np.where(fits, 64 - end, 0).astype(np.uint64)
        right = np.where(fits, 0, end - 64).astype(np.uint64)
        heads = (codes << left) >> right
        run_starts = np.flatnonzero(np.diff(word, prepend=-1))
        words[word[run_starts]] = np.bitwise_or.reduceat(heads, run_starts)
        spilled = np.flatnonzero(~fits)
        spill_shift = (128 - end[spilled]).astype(np.uint64)
        words[word[spilled] + 1] |= codes[spilled] << spill_shift
    return words.astype(">u8").view(np.uint8)[:nbytes].copy()


def _segment_index(starts, total_bits) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, the offset of the first code starting in it (or of the stream's end);
    per block, the index of that code."""
    n_seg = num_segments(total_bits)
    seg_start = np.arange(n_seg, dtype=np.int64) * SEG_BITS
    first = np.searchsorted(starts, seg_start, side="left")
    at = np.append(starts, total_bits)[first]
    gaps = np.zeros(n_seg + (n_seg & 1), dtype=np.uint8)
    gaps[:n_seg] = at - seg_start
    return gaps[0::2] | (gaps[1::2] << 4), first[::SEGS_PER_BLOCK].astype(np.int64)


def _pack_fields(values: np.ndarray, raw_bits: int) -> np.ndarray:
    """Raw fields into their part planes (raw_layout): a b-bit part (b <= 8) fills 16-byte
    groups whose byte q holds elements q, q + 16, q + 32, ... at bits 0, b, 2b, ..."""
    n = len(values)
    plane = np.zeros(raw_plane_bytes(n, raw_bits), dtype=np.uint8)
    for bits, shift, offset in raw_layout(n, raw_bits):
        part = (values >> shift) & ((1 << bits) - 1)
        if bits == 16:
            packed = part.astype("<u2").view(np.uint8)
        else:
            per = 8 // bits
            padded = np.zeros(-(-n // (16 * per)) * 16 * per, dtype=np.uint32)
            padded[:n] = part
            groups = padded.reshape(-1, per, 16)  # (group, slot, column)
            slots = np.arange(per, dtype=np.uint32)[None, :, None] * bits
            packed = (groups << slots).sum(axis=1, dtype=np.uint32).astype(np.uint8).reshape(-1)
        plane[offset : offset + len(packed)] = packed
    return plane


def _unpack_fields(plane: np.ndarray, raw_bits: int, n: int) -> np.ndarray:
    values = np.zeros(n, dtype=np.uint32)
    for bits, shift, offset in raw_layout(n, raw_bits):
        if bits == 16:
            part = plane[offset : offset + 2 * n].view("<u2").astype(np.uint32)
        else:
            per = 8 // bits
            groups = plane[offset : offset + 16 * -(-n // (16 * per))].reshape(-1, 1, 16)
            slots = np.arange(per, dtype=np.uint32)[None, :, None] * bits
            part = ((groups.astype(np.uint32) >> slots) & ((1 << bits) - 1)).reshape(-1)[:n]
        values |= part << shift
    return values
