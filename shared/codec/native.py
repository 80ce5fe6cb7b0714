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
from shared.codec.format import BLOCK_BITS, SEG_BITS, SEGS_PER_BLOCK, PlaneError, raw_layout
from shared.codec.huffman import canonical_codes, decode_table, pair_table

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("_native.c")
_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC"]
_lock = threading.Lock()
_state: dict = {}  # "lib": the CDLL (None if it cannot be built); "pool": (executor, size)

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "tc_histogram": (None, [_ptr, _i64, _int, _int, _ptr]),
    "tc_encode": (
        _i64,
        [_ptr, _i64, _int, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64],
    ),
    "tc_decode": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _int, _int, _ptr, _ptr, _ptr, _ptr, _int, _int, _ptr, _ptr, _int],
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
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"tison_codec_{key}.so"
    try:
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


def decode(
    lib, planes: dict, k: int, total_bits: int, out: np.ndarray, num_threads: int, verify: bool
) -> int | None:
    """Decodes into `out` (flat uint array of the element width; plane sizes validated) on up
    to num_threads threads, each taking a run of whole blocks and interleaving up to
    MAX_LANES sub-runs. Returns the CRC-32 of out's bytes if `verify`, else None. Raises
    PlaneError where the planes contradict each other."""
    n = out.size
    starts = planes["block_first"]
    if len(starts) and (starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] > n):
        raise PlaneError("block index is not an increasing list of element indices")
    table, bits = decode_table(planes["lengths"])
    pairs = pair_table(table, bits)
    nibbles = planes["gaps"]
    n_blocks = len(starts)
    parts = _parts(n, k)

    def start_bit(block: int) -> int:
        if block == n_blocks:
            return total_bits
        seg = block * SEGS_PER_BLOCK
        return block * BLOCK_BITS + ((int(nibbles[seg >> 1]) >> (4 * (seg & 1))) & 15)

    def first_element(block: int) -> int:
        return n if block == n_blocks else int(starts[block])

    def run(b0: int, b1: int) -> tuple[int | None, int]:
        cuts = _cut_points(starts[b0:b1], first_element(b1), MAX_LANES, offset=b0)
        lanes = len(cuts) - 1
        pos = np.array([start_bit(b) for b in cuts[:-1]], dtype=np.int64)
        first = np.array([first_element(b) for b in cuts[:-1]], dtype=np.int64)
        count = np.array([first_element(b) for b in cuts[1:]], dtype=np.int64) - first
        status = lib.tc_decode(
            _addr(planes["stream"]), planes["stream"].size, _addr(table), _addr(pairs), bits, lanes,
            _addr(pos), _addr(first), _addr(count), _addr(out), out.itemsize, k,
            _addr(planes["raw"]), _addr(parts), len(parts) // 3,
        )  # fmt: skip
        if status != 0 or pos.tolist() != [start_bit(b) for b in cuts[1:]]:
            raise PlaneError("code stream does not match its block index")
        lo, hi = first_element(b0), first_element(b1)
        crc = zlib.crc32(out[lo:hi].view(np.uint8)) if verify else None
        return crc, (hi - lo) * out.itemsize

    cuts = _cut_points(starts, n, num_threads)
    if len(cuts) <= 2:
        return run(0, n_blocks)[0]
    parts = list(_pool(len(cuts) - 1).map(run, cuts[:-1], cuts[1:]))
    crc = parts[0][0]
    if not verify:
        return None
    for part_crc, length in parts[1:]:
        crc = crc32_combine(crc, part_crc, length)
    return crc


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


def _cut_points(starts: np.ndarray, end: int, parts: int, offset: int = 0) -> list[int]:
    """Block indices (offset + i) splitting blocks starts[0:] (whose elements run up to
    `end`) into at most `parts` runs of about equal element counts; first and last are the
    range's ends."""
    if len(starts) == 0:
        return [offset, offset]
    lo = int(starts[0])
    targets = [lo + (end - lo) * i // parts for i in range(1, parts)]
    inner = np.searchsorted(starts, targets).tolist()
    blocks = {0, *(b for b in inner if 0 < b < len(starts)), len(starts)}
    return [offset + b for b in sorted(blocks)]
