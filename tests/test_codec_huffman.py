"""The pure pieces of the codec: bounded Huffman code lengths, canonical codes, decode
tables and the stored table form."""

import heapq

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.codec.format import MAX_CODE_LEN, raw_parts
from shared.codec.huffman import (
    canonical_codes,
    code_lengths,
    decode_table,
    pack_lengths,
    table_problem,
    unpack_lengths,
)

counts_strategy = st.lists(st.integers(0, 10**9), min_size=2, max_size=300).filter(
    lambda c: sum(x > 0 for x in c) >= 2
)


def huffman_cost(counts) -> int:
    """Cost (total bits) of an unbounded Huffman code, by the textbook merge."""
    heap = [int(c) for c in counts if c > 0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        cost += merged
        heapq.heappush(heap, merged)
    return cost


@settings(max_examples=60, deadline=None)
@given(counts_strategy)
def test_unbounded_lengths_are_optimal(counts):
    counts = np.array(counts, dtype=np.int64)
    lengths = code_lengths(counts, max_len=40)
    assert int(np.dot(counts, lengths)) == huffman_cost(counts)


@settings(max_examples=60, deadline=None)
@given(counts_strategy)
def test_bounded_lengths_form_a_complete_code(counts):
    counts = np.array(counts, dtype=np.int64)
    lengths = code_lengths(counts)
    assert lengths.max() <= MAX_CODE_LEN
    assert np.all((lengths > 0) == (counts > 0))
    assert table_problem(lengths) is None
    assert int(np.dot(counts, lengths)) >= huffman_cost(counts)


def test_skewed_counts_are_bounded_at_twelve_bits():
    counts = np.array([2**i for i in range(30)], dtype=np.int64)  # Huffman wants 29 bits
    lengths = code_lengths(counts)
    assert lengths.max() == MAX_CODE_LEN and table_problem(lengths) is None


def test_lone_symbol_gets_one_bit_and_fills_the_table():
    lengths = code_lengths(np.array([0, 0, 7, 0]))
    assert lengths.tolist() == [0, 0, 1, 0]
    table, bits = decode_table(lengths)
    assert bits == 1 and (table >> 4).tolist() == [2, 2] and (table & 15).tolist() == [1, 1]


@settings(max_examples=40, deadline=None)
@given(counts_strategy)
def test_decode_table_inverts_canonical_codes(counts):
    lengths = code_lengths(np.array(counts, dtype=np.int64))
    codes = canonical_codes(lengths)
    table, bits = decode_table(lengths)
    assert len(table) == 1 << bits
    for symbol in np.flatnonzero(lengths):
        length = int(lengths[symbol])
        start = int(codes[symbol]) << (bits - length)
        entries = table[start : start + (1 << (bits - length))]
        assert np.all(entries >> 4 == symbol) and np.all(entries & 15 == length)


def test_incomplete_or_overlong_tables_are_rejected():
    assert table_problem(np.array([1, 2, 0, 0])) is not None  # Kraft sum 3/4
    assert table_problem(np.array([1, 1, 1])) is not None  # Kraft sum 3/2
    assert table_problem(np.array([13, 1])) is not None
    assert table_problem(np.array([0, 2])) is not None
    assert table_problem(np.array([0, 0])) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=64).filter(any))
def test_stored_table_form_round_trips(lengths):
    lengths = np.array(lengths, dtype=np.uint8)
    first, packed = pack_lengths(lengths)
    assert np.array_equal(unpack_lengths(first, packed, len(lengths)), lengths)
    assert unpack_lengths(len(lengths), packed, len(lengths)) is None


def test_raw_parts_are_the_binary_digits_of_the_field_width():
    assert raw_parts(6) == [(4, 0), (2, 4)]
    assert raw_parts(8) == [(8, 0)]
    assert raw_parts(11) == [(8, 0), (2, 8), (1, 10)]
    assert raw_parts(24) == [(16, 0), (8, 16)]
    for bits in range(1, 25):
        assert sum(b for b, _ in raw_parts(bits)) == bits
