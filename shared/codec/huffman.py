"""Canonical Huffman codes of bounded length: optimal code lengths (package-merge), canonical
code values (DEFLATE's rule), validation of a stored table, and the decode lookup table.
Pure numpy, no I/O."""

import numpy as np

from shared.codec.format import MAX_CODE_LEN


def code_lengths(counts: np.ndarray, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Optimal code lengths (uint8 per symbol, 0 = absent) with no code longer than max_len.

    Package-merge: list j holds the leaves plus the pairwise packages of list j+1, all sorted
    by weight; the 2n-2 cheapest items of the top list are chosen, and a leaf's code length
    is the number of lists in which it is chosen. A lone symbol gets length 1.
    """
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    present = np.flatnonzero(counts)
    n = len(present)
    if n <= 1:
        lengths[present] = 1
        return lengths
    if n > 1 << max_len:
        raise ValueError(f"{n} symbols cannot have codes of at most {max_len} bits")
    order = present[np.argsort(counts[present], kind="stable")]
    leaf_weights = counts[order]
    leaf_ids = np.arange(n)
    # kinds[j][i]: the leaf id at position i of list j, or -1 where that item is a package.
    kinds = [leaf_ids]
    weights = leaf_weights
    for _ in range(max_len - 1):
        half = len(weights) // 2
        packages = weights[0 : 2 * half : 2] + weights[1 : 2 * half : 2]
        merged = np.concatenate([leaf_weights, packages])
        merged_kind = np.concatenate([leaf_ids, np.full(half, -1)])
        sort = np.argsort(merged, kind="stable")
        weights, kind = merged[sort], merged_kind[sort]
        kinds.append(kind)
    depth = np.zeros(n, dtype=np.int64)
    take = 2 * n - 2
    for kind in reversed(kinds):
        chosen = kind[:take]
        depth[chosen[chosen >= 0]] += 1
        take = 2 * int(np.count_nonzero(chosen < 0))
    lengths[order] = depth
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Code value (uint32) of each symbol: codes of one length are consecutive in symbol order,
    and shorter codes come first (the DEFLATE rule), read MSB-first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    max_len = int(lengths.max(initial=0))
    per_length = np.bincount(lengths, minlength=max_len + 1)
    per_length[0] = 0
    next_code = np.zeros(max_len + 1, dtype=np.int64)
    code = 0
    for bits in range(1, max_len + 1):
        code = (code + int(per_length[bits - 1])) << 1
        next_code[bits] = code
    present = np.flatnonzero(lengths)
    order = present[np.lexsort((present, lengths[present]))]
    sorted_lengths = lengths[order]
    first_of_length = np.searchsorted(sorted_lengths, sorted_lengths, side="left")
    codes = np.zeros(len(lengths), dtype=np.uint32)
    rank = np.arange(len(order)) - first_of_length
    codes[order] = (next_code[sorted_lengths] + rank).astype(np.uint32)
    return codes


def table_problem(lengths: np.ndarray) -> str | None:
    """Why a stored length table cannot be a code this codec wrote, or None if it can."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or lengths.max() > MAX_CODE_LEN:
        return f"code lengths must lie in 1..{MAX_CODE_LEN}"
    used = lengths[lengths > 0]
    if used.size == 1:
        return None if used[0] == 1 else "a lone symbol must have a 1-bit code"
    kraft = int(np.sum(np.int64(1) << (MAX_CODE_LEN - used)))
    if kraft != 1 << MAX_CODE_LEN:
        return "code lengths do not form a complete prefix code"
    return None


def decode_table(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Lookup table indexed by the next `bits` stream bits: entry = symbol << 4 | code length.

    Returns (table uint16[2**bits], bits). Assumes table_problem(lengths) is None. A lone
    symbol fills both entries of a 1-bit table, so every entry is valid.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    present = np.flatnonzero(lengths)
    bits = int(lengths.max())
    if len(present) == 1:
        return np.full(2, (present[0] << 4) | 1, dtype=np.uint16), 1
    order = present[np.lexsort((present, lengths[present]))]  # ascending code value
    entries = (order << 4) | lengths[order]
    span = np.int64(1) << (bits - lengths[order])
    return np.repeat(entries, span).astype(np.uint16), bits


def pack_lengths(lengths: np.ndarray) -> tuple[int, np.ndarray]:
    """(first used symbol, 4-bit lengths from it to the last used symbol, two per byte with
    the low nibble first) - the stored form of a code table."""
    used = np.flatnonzero(lengths)
    first, last = int(used[0]), int(used[-1])
    span = np.zeros(-(-(last - first + 1) // 2) * 2, dtype=np.uint8)
    span[: last - first + 1] = lengths[first : last + 1]
    return first, span[0::2] | (span[1::2] << 4)


def unpack_lengths(first: int, packed: np.ndarray, num_symbols: int) -> np.ndarray | None:
    """The full length table (uint8[num_symbols]) from its stored form; None if the stored
    form does not fit the alphabet."""
    span = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)
    if first < 0 or first + len(span) > num_symbols + 1 or np.any(span[num_symbols - first :]):
        return None
    lengths = np.zeros(num_symbols, dtype=np.uint8)
    lengths[first : first + len(span)] = span[: num_symbols - first]
    return lengths
