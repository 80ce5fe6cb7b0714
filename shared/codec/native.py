"""The C fast path (_encode.c, _decode.c, _crc32c.c, _batch.c, _pool.c; declarations in
_codec.h): built on first use with the system C compiler into a cache folder keyed by the
sources' hash, loaded with ctypes (which releases the GIL during calls). `load()` returns None
where no compiler works (or on a big-endian or 32-bit host); callers then use the numpy
reference."""

import ctypes
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from kernels.build import build_library
from shared.codec.format import SEG_BITS, SEGS_PER_BLOCK, raw_layout
from shared.codec.huffman import canonical_codes

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / f for f in ("_encode.c", "_decode.c", "_crc32c.c", "_batch.c", "_pool.c")]
_HEADER = _HERE / "_codec.h"
_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-pthread"]
_lock = threading.Lock()
_state: dict = {}  # "lib": the CDLL or None

_i64, _int, _u32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p


class Job(ctypes.Structure):
    """One tensor for tc_decode_batch (tc_job in _batch.c): its planes (addresses and byte
    sizes), its entry's fields, the output buffer; status and crc are set by the call."""

    _fields_ = [
        *[(name, _ptr) for name in ("stream", "raw", "lengths", "gaps", "block_first")],
        *[(name, _i64) for name in ("stream_len", "raw_len", "lengths_len", "gaps_len")],
        *[(name, _i64) for name in ("n_blocks", "index_width", "first_symbol", "total_bits")],
        *[(name, _i64) for name in ("n", "width", "k")],
        ("out", _ptr),
        ("status", _i64),
        ("crc", _i64),
    ]


_SIGNATURES = {
    "tc_histogram": (None, [_ptr, _i64, _int, _int, _ptr]),
    "tc_encode": (
        _i64,
        [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64],
    ),
    "tc_decode_batch": (_int, [ctypes.POINTER(Job), _i64, _int, _int]),
    "tc_crc32c": (_u32, [_u32, _ptr, _i64]),
    "tc_crc32c_by": (_i64, [_int, _u32, _ptr, _i64]),
}

# tc_decode_batch's status codes (_codec.h) -> what is wrong with the planes.
PROBLEMS = {
    -1: "cannot decode this dtype at this split point",
    -2: "plane sizes do not match the entry",
    -3: "code table does not fit the alphabet",
    -4: "code lengths do not form a complete prefix code",
    -5: "block index is not an increasing list of element indices",
    -6: "code stream overrun",
    -7: "code stream does not match its block index",
}
NO_MEMORY = -8


def load() -> ctypes.CDLL | None:
    """The compiled library, building it if needed; None if it cannot be built."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _build_and_load()
        return _state["lib"]


def _build_and_load() -> ctypes.CDLL | None:
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        lib = ctypes.CDLL(str(build_library("tison_codec", _SOURCES, _FLAGS, (_HEADER,))))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("codec: no C fast path (%s); using the numpy reference decoder", e)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _addr(array: np.ndarray) -> int:
    return array.ctypes.data


def histogram(lib, bits: np.ndarray, k: int) -> np.ndarray:
    """Symbol counts of the flat element bits for split point k."""
    width = bits.itemsize
    counts = np.zeros(1 << (width * 8 - 1 - k), dtype=np.int64)
    lib.tc_histogram(_addr(bits), bits.size, width, k, _addr(counts))
    return counts


def encode(lib, bits: np.ndarray, k: int, lengths: np.ndarray, sizes: dict) -> dict:
    """Code planes (numpy) of the flat element bits; `sizes` gives each plane's byte size
    and the total bit count the caller computed from the histogram."""
    planes = {name: np.zeros(sizes[name], dtype=np.uint8) for name in ("stream", "raw", "gaps")}
    planes["block_first"] = np.zeros(sizes["block_first"], dtype=np.int64)
    codes = canonical_codes(lengths)
    lens = np.ascontiguousarray(lengths, dtype=np.uint8)
    parts = np.array(raw_layout(bits.size, k + 1), dtype=np.int64).reshape(-1)
    total = lib.tc_encode(
        _addr(bits), bits.size, bits.itemsize, k, _addr(codes), _addr(lens),
        _addr(planes["stream"]), _addr(planes["raw"]), _addr(parts), len(parts) // 3,
        _addr(planes["gaps"]),
        _addr(planes["block_first"]), sizes["num_segments"], SEG_BITS, SEGS_PER_BLOCK,
    )  # fmt: skip
    if total != sizes["total_bits"]:
        raise AssertionError(f"encoder wrote {total} bits, expected {sizes['total_bits']}")
    return planes


def decode_batch(lib, jobs: list[Job], num_threads: int, verify: bool) -> list[tuple[int, int]]:
    """Decodes every job into its output buffer on up to num_threads threads. Returns per
    job (status: 0 or a key of PROBLEMS, CRC-32C of the output if verify)."""
    array = (Job * len(jobs))(*jobs)
    if lib.tc_decode_batch(array, len(jobs), num_threads, int(verify)) == NO_MEMORY:
        raise MemoryError("codec: no memory for the decoder's bookkeeping")
    return [(done.status, done.crc) for done in array]


def crc32c(lib, address: int, nbytes: int, crc: int = 0) -> int:
    """CRC-32C of nbytes at address, continuing from crc (0 to start)."""
    return lib.tc_crc32c(crc, address, nbytes)
