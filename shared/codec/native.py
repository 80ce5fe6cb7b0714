"""The C fast path (_native.c): built on first use with the system C compiler into a cache
folder keyed by the source's hash, loaded with ctypes. `load()` returns None where no
compiler works (or on a big-endian host); callers then use the numpy reference."""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from shared.codec.crc import crc32_combine
from shared.codec.format import SEG_BITS, SEGS_PER_BLOCK, PlaneError, raw_layout
from shared.codec.huffman import canonical_codes, decode_table

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
_lock = threading.Lock()
_state: dict = {}  # "lib": the CDLL or None; "pool": (executor, size); "madvise": libc's

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "tc_histogram": (None, [_ptr, _i64, _int, _int, _ptr]),
    "tc_encode": (
        _i64,
        [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64],
    ),
    "tc_decode": (
        _int,
        [_ptr, _i64, _ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _int, _int, _ptr, _ptr, _int],
    ),
}


def load() -> ctypes.CDLL | None:
    """The compiled library, building it if needed; None if it cannot be built."""
    with _lock:
        if "lib" not in _state:
            _state["lib"] = _build_and_load()
        return _state["lib"]


def _build_and_load() -> ctypes.CDLL | None:
    if sys.byteorder != "little":
        return None
    try:
        source = _SOURCE.read_bytes()
        key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
        target = _cache_dir() / f"tison_codec_{key}.so"
        if not target.exists():
            _compile(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("codec: no C fast path (%s); using the numpy reference decoder", e)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tison"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        return Path(tempfile.gettempdir())


def _compile(target: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    # Build beside the target and rename: concurrent builders never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", tmp, str(_SOURCE)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
    parts = _parts(bits.size, k)
    total = lib.tc_encode(
        _addr(bits), bits.size, bits.itemsize, k, _addr(codes), _addr(lens),
        _addr(planes["stream"]), _addr(planes["raw"]), _addr(parts), len(parts) // 3,
        _addr(planes["gaps"]),
        _addr(planes["block_first"]), sizes["num_segments"], SEG_BITS, SEGS_PER_BLOCK,
    )  # fmt: skip
    if total != sizes["total_bits"]:
        raise AssertionError(f"encoder wrote {total} bits, expected {sizes['total_bits']}")
    return planes


MAX_LANES = 4  # runs one C call interleaves (tc_decode)
MIN_ELEMENTS_PER_THREAD = 1 << 20  # below this, handing work to a thread costs more than it saves


def decode(
    lib, planes: dict, k: int, total_bits: int, out: np.ndarray, num_threads: int, verify: bool
) -> int | None:
    """Decodes into `out` (flat uint array of the element width; plane sizes validated). The
    blocks are cut into up to num_threads * MAX_LANES runs of about equal size; each thread
    (the caller's and pool threads) decodes up to MAX_LANES of them interleaved. Returns the
    CRC-32 of out's bytes if `verify`, else None. Raises PlaneError where the planes
    contradict each other."""
    n = out.size
    _prefer_huge_pages(out)
    starts = planes["block_first"]
    if len(starts) == 0 or starts[0] != 0 or np.any(starts[1:] < starts[:-1]) or starts[-1] > n:
        raise PlaneError("block index is not an increasing list of element indices")
    table, bits = decode_table(planes["lengths"])
    seg = np.arange(len(starts), dtype=np.int64) * SEGS_PER_BLOCK
    gaps = (planes["gaps"][seg >> 1] >> (4 * (seg & 1))) & 15
    block_bit = np.append(seg * SEG_BITS + gaps, total_bits)  # first code of each block, end
    block_elem = np.append(starts, n)
    num_threads = max(1, min(num_threads, n // MIN_ELEMENTS_PER_THREAD))
    cuts = _cut_points(starts, n, num_threads * MAX_LANES)
    pos, first = block_bit[cuts[:-1]], block_elem[cuts[:-1]]
    count = block_elem[cuts[1:]] - first
    parts = _parts(n, k)

    def run(lo: int, hi: int) -> tuple[int | None, int]:
        status = lib.tc_decode(
            _addr(planes["stream"]), planes["stream"].size, _addr(table), bits, hi - lo,
            _addr(pos) + 8 * lo, _addr(first) + 8 * lo, _addr(count) + 8 * lo, _addr(out),
            out.itemsize, k, _addr(planes["raw"]), _addr(parts), len(parts) // 3,
        )  # fmt: skip
        if status != 0:
            raise PlaneError("code stream overrun")
        a, b = int(first[lo]), int(first[hi - 1] + count[hi - 1])
        return (zlib.crc32(out[a:b].view(np.uint8)) if verify else None), (b - a) * out.itemsize

    per_thread = -(-len(first) // num_threads)
    runs = [(lo, min(lo + per_thread, len(first))) for lo in range(0, len(first), per_thread)]
    others = [_pool(len(runs) - 1).submit(run, *r) for r in runs[1:]] if len(runs) > 1 else []
    results = [run(*runs[0])] + [future.result() for future in others]
    if np.any(pos != block_bit[cuts[1:]]):
        raise PlaneError("code stream does not match its block index")
    if not verify:
        return None
    crc = results[0][0]
    for part_crc, length in results[1:]:
        crc = crc32_combine(crc, part_crc, length)
    return crc


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _prefer_huge_pages(out: np.ndarray) -> None:
    """Asks Linux to back a fresh output buffer with 2 MiB pages: first-touch page faults on
    4 KiB pages otherwise cost about a third of the decode time of a large tensor."""
    if sys.platform != "linux" or out.nbytes < 2 * _HUGE_PAGE:
        return
    start = -(-out.ctypes.data // _HUGE_PAGE) * _HUGE_PAGE
    end = (out.ctypes.data + out.nbytes) // _HUGE_PAGE * _HUGE_PAGE
    with _lock:
        if "madvise" not in _state:
            libc = ctypes.CDLL(None)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _state["madvise"] = libc.madvise
    if end > start:
        _state["madvise"](start, end - start, _MADV_HUGEPAGE)  # advice only: errors ignored


def _pool(num_threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least num_threads workers (threads cost a start-up)."""
    with _lock:
        pool, size = _state.get("pool", (None, 0))
        if size < num_threads:
            if pool is not None:
                pool.shutdown(wait=False)
            pool = ThreadPoolExecutor(num_threads, "tison-codec")
            _state["pool"] = (pool, num_threads)
        return pool


def _parts(n: int, k: int) -> np.ndarray:
    """The raw plane layout as the C side reads it: (bits, shift, offset) per part, flat."""
    return np.array(raw_layout(n, k + 1), dtype=np.int64).reshape(-1)


def _cut_points(starts: np.ndarray, n: int, parts: int) -> np.ndarray:
    """Block indices cutting the blocks into at most `parts` runs of about equal element
    counts: 0 first, len(starts) last."""
    targets = np.arange(1, parts, dtype=np.int64) * n // parts
    inner = np.searchsorted(starts, targets)
    return np.unique(
        np.concatenate([[0], inner[(inner > 0) & (inner < len(starts))], [len(starts)]])
    )
