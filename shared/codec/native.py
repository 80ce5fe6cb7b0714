"""The C fast path (_encode.c, _pack.c, _huffman.c, _many.c, _decode.c, _crc32c.c, _batch.c,
_pool.c; declarations in _codec.h): built on first use with the system C compiler into a cache
folder keyed by the sources' hash, loaded with ctypes (which releases the GIL during calls).
`load()` returns None where no compiler works (or on a big-endian or 32-bit host); callers then
use the numpy reference."""

import contextlib
import ctypes
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kernels.build import build_library
from kernels.cpu import isa
from shared.codec.format import raw_layout

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [
    _HERE / f
    for f in ("_encode.c", "_pack.c", "_huffman.c", "_many.c", "_decode.c", "_crc32c.c")
    + ("_batch.c", "_pool.c")
]
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


# One tensor of tc_stats_many and tc_encode_many (tc_many_job in _many.c, every field 8 bytes):
# the caller's inputs, tc_stats_many's split and plane sizes, the caller's plane addresses,
# tc_encode_many's plane CRC-32C. A numpy record array of these is the calls' job list.
MANY_JOB = np.dtype(
    [(name, np.int64) for name in (
        "bits", "n", "width", "finest", "ncand", "lengths", "chunk_bits",
        "status", "crc", "k", "total_bits", "stream_len", "raw_len", "packed_len", "gaps_len",
        "n_blocks", "index_width", "first_symbol",
        "stream", "raw", "packed", "gaps", "index", "planes_crc",
    )]
)  # fmt: skip


_SIGNATURES = {
    "tc_stats_many": (None, [_ptr, _i64, _int, _int]),
    "tc_encode_many": (None, [_ptr, _i64, _int]),
    "tc_histogram": (None, [_ptr, _int, _int, _ptr, _i64, _ptr, _int]),
    "tc_code_lengths": (_int, [_ptr, _i64, _int, _ptr]),
    "tc_split_candidates": (_int, [_ptr, _i64, _i64, _int, _int, _ptr, _ptr]),
    "tc_encode": (
        _int,
        [_ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _ptr, _i64, _int],
    ),
    "tc_decode_batch": (_int, [ctypes.POINTER(Job), _i64, _int, _int]),
    "tc_crc32c": (_u32, [_u32, _ptr, _i64, _int]),
    "tc_crc32c_by": (_i64, [_int, _u32, _ptr, _i64]),
    "tc_pool_poll": (None, [_int]),
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


def flags() -> list[str]:
    """The compiler flags: the hot loops' AVX2 clones left out at the portable tier (when
    TISON_CPU_ISA caps Tison there), so that the baseline code runs and is tested anywhere."""
    baseline = isa.active().name == "portable"
    return [*_FLAGS, *(["-DTC_BASELINE_ONLY"] if baseline else [])]


def _build_and_load() -> ctypes.CDLL | None:
    if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        lib = ctypes.CDLL(str(build_library("tison_codec", _SOURCES, flags(), (_HEADER,))))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("codec: no C fast path (%s); using the numpy reference decoder", e)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _addr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]  # array.ctypes.data takes ~10 us


MIN_CHUNK_ELEMENTS = 1 << 16
CHUNKS_PER_THREAD = 4


def chunk_bounds(n: int, num_threads: int) -> np.ndarray:
    """Where the encoder cuts n elements for num_threads threads: int64[chunks + 1], from 0 to
    n at multiples of 128 elements (one owner per 16-byte group of a raw plane). Up to
    CHUNKS_PER_THREAD chunks a thread, taken from a shared counter, so that a thread the OS
    holds back delays the others less; but at least MIN_CHUNK_ELEMENTS a chunk (waking a
    thread costs ~20 us)."""
    most = 1 if num_threads <= 1 else CHUNKS_PER_THREAD * num_threads
    chunks = max(1, min(most, n // max(MIN_CHUNK_ELEMENTS, 128)))
    bounds = np.arange(chunks + 1, dtype=np.int64) * n // chunks // 128 * 128
    bounds[-1] = n
    return bounds


def histogram(lib, bits: np.ndarray, k: int, bounds: np.ndarray, num_threads: int) -> np.ndarray:
    """Symbol counts (int64[chunks, symbols]) of each chunk of the flat element bits for split
    point k."""
    width = bits.itemsize
    counts = np.zeros((len(bounds) - 1, 1 << (width * 8 - 1 - k)), dtype=np.int64)
    lib.tc_histogram(_addr(bits), width, k, _addr(bounds), len(bounds) - 1, _addr(counts),
                     num_threads)  # fmt: skip
    return counts


def code_lengths(lib, counts: np.ndarray, max_len: int) -> np.ndarray:
    """huffman.code_lengths(counts, max_len), computed in C."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    lengths = np.zeros(len(counts), dtype=np.uint8)
    status = lib.tc_code_lengths(_addr(counts), len(counts), max_len, _addr(lengths))
    _check_lengths_status(status, max_len)
    return lengths


def split_candidates(
    lib, counts: np.ndarray, num_candidates: int, max_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """For c = 0 .. num_candidates - 1, symbols merged in runs of 2**c (split point finest + c)
    from the finest symbols' counts per chunk (int64[chunks, symbols]): (lengths uint8[c,
    symbols], of which the first symbols >> c count; chunk_bits int64[c, chunks + 1], where
    each chunk's codes start, then the total)."""
    chunks, symbols = counts.shape
    lengths = np.zeros((num_candidates, symbols), dtype=np.uint8)
    chunk_bits = np.zeros((num_candidates, chunks + 1), dtype=np.int64)
    status = lib.tc_split_candidates(_addr(counts), chunks, symbols, num_candidates, max_len,
                                     _addr(lengths), _addr(chunk_bits))  # fmt: skip
    _check_lengths_status(status, max_len)
    return lengths, chunk_bits


def _check_lengths_status(status: int, max_len: int) -> None:
    if status == NO_MEMORY:
        raise MemoryError("codec: no memory for package-merge")
    if status != 0:
        raise ValueError(f"too many symbols for codes of at most {max_len} bits")


def plane_buffer(nbytes: int) -> np.ndarray:
    """Uninitialized bytes for encoder planes: the C encoder writes every byte of its planes
    (zeroing itself the few it ORs into), so zeroing them here would be one more pass over
    all of them, on one thread, before the encoder's threads start."""
    return np.empty(nbytes, dtype=np.uint8)


def encode(
    lib, bits: np.ndarray, k: int, lengths: np.ndarray, sizes: dict, bounds: np.ndarray,
    chunk_bits: np.ndarray, num_threads: int,
) -> dict:  # fmt: skip
    """Code planes (numpy) of the flat element bits, cut into chunks at `bounds` whose codes
    start at stream bits `chunk_bits` (int64[chunks + 1], the total last); `sizes` gives each
    plane's byte size. The caller computed both from the chunks' histograms."""
    planes = {name: plane_buffer(sizes[name]) for name in ("stream", "raw", "gaps")}
    planes["block_first"] = plane_buffer(8 * sizes["block_first"]).view(np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint8)
    parts = np.array(raw_layout(bits.size, k + 1), dtype=np.int64).reshape(-1)
    chunk_bits = np.ascontiguousarray(chunk_bits, dtype=np.int64)
    status = lib.tc_encode(
        _addr(bits), bits.itemsize, k, _addr(lengths), _addr(planes["stream"]),
        _addr(planes["raw"]), _addr(parts), len(parts) // 3, _addr(planes["gaps"]),
        _addr(planes["block_first"]), _addr(bounds), _addr(chunk_bits), len(bounds) - 1,
        num_threads,
    )  # fmt: skip
    _check_encode_status(status)
    return planes


def _check_encode_status(status: int) -> None:
    if status == NO_MEMORY:
        raise MemoryError("codec: no memory for the encoder's bookkeeping")
    if status != 0:
        raise AssertionError(f"encoder status {status}: codes do not fill the expected bits")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> None:
    """Asks glibc's malloc to keep up to 256 MiB of freed memory and to serve blocks of up to
    64 MiB from it, instead of unmapping them: the encoder allocates and frees its planes
    tensor after tensor, and a fresh mapping faults every page in while unmapping one stops
    every core the process runs on (a TLB shootdown). Left to itself, glibc unmapped MiniLM's
    planes every round: ~1,900 faults and 12-37 ms of system time in a 40-60 ms encode on 2
    threads. For the whole process, once; nothing where the C library has no mallopt."""
    if "malloc" in _state:
        return
    _state["malloc"] = True
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        mallopt(_M_TRIM_THRESHOLD, 256 << 20)


@contextlib.contextmanager
def helpers_polling(lib) -> Iterator[None]:
    """Keeps the C library's helper threads polling for work, not asleep, while the block
    runs: for a series of calls with Python in between. An encode of many tensors returns to
    Python for up to ~0.5 ms between calls (laying out planes, loading tensors), longer than
    helpers poll on their own (_pool.c's SPIN_NS, kept short for callers that share the cores
    with other work), and waking a helper whose virtual CPU went idle took 0.2-0.5 ms, each
    time: MiniLM's encode on 2 threads, after 50 ms idle, ran at a median 2.0-2.2 GB/s
    instead of 3.0."""
    lib.tc_pool_poll(1)
    try:
        yield
    finally:
        lib.tc_pool_poll(-1)


def stats_many(lib, jobs: np.ndarray, max_len: int, num_threads: int) -> None:
    """tc_stats_many on the MANY_JOB records `jobs` (contiguous), on up to num_threads threads;
    raises on the first job whose code lengths could not be made."""
    lib.tc_stats_many(_addr(jobs), len(jobs), max_len, num_threads)
    for status in jobs["status"][jobs["status"] != 0][:1]:
        _check_lengths_status(int(status), max_len)


def encode_many(lib, jobs: np.ndarray, num_threads: int) -> None:
    """tc_encode_many on the MANY_JOB records `jobs` (contiguous): their planes, on up to
    num_threads threads."""
    lib.tc_encode_many(_addr(jobs), len(jobs), num_threads)
    for status in jobs["status"][jobs["status"] != 0][:1]:
        _check_encode_status(int(status))


def decode_batch(lib, jobs: list[Job], num_threads: int, verify: bool) -> list[tuple[int, int]]:
    """Decodes every job into its output buffer on up to num_threads threads. Returns per
    job (status: 0 or a key of PROBLEMS, CRC-32C of the output if verify)."""
    array = (Job * len(jobs))(*jobs)
    if lib.tc_decode_batch(array, len(jobs), num_threads, int(verify)) == NO_MEMORY:
        raise MemoryError("codec: no memory for the decoder's bookkeeping")
    return [(done.status, done.crc) for done in array]


def crc32c(lib, address: int, nbytes: int, crc: int = 0, num_threads: int = 1) -> int:
    """CRC-32C of nbytes at address, continuing from crc (0 to start), on up to num_threads
    threads."""
    return lib.tc_crc32c(crc, address, nbytes, num_threads)
