"""Encode one tensor to an EncodedTensor and decode tensors back, on the C fast path where it
builds and the numpy reference otherwise. Decoding checks the planes against their metadata
and the result against the stored CRC-32C; any mismatch raises ModelFolderError naming the
source file and the tensor."""

import os
from collections.abc import Sequence

import numpy as np
import torch

from shared.codec import crc, native, reference
from shared.codec.format import (
    LAYOUTS,
    MAX_CODE_LEN,
    MAX_SYMBOL_BITS,
    MIN_CODED_ELEMENTS,
    CodedPlanes,
    EncodedTensor,
    FloatLayout,
    PlaneError,
    block_index_dtype,
    num_blocks,
    num_segments,
    padded_plane_bytes,
    raw_plane_bytes,
)
from shared.codec.huffman import code_lengths, pack_lengths, table_problem, unpack_lengths
from shared.errors import ModelFolderError

BACKENDS = ("auto", "native", "reference")


def encode_tensor(
    tensor: torch.Tensor,
    name: str = "",
    k: int | None = None,
    backend: str = "auto",
    num_threads: int | None = None,
) -> EncodedTensor:
    """Encodes a CPU tensor on up to num_threads threads (default: default_threads()), the
    planes the same whatever the count. Floats of two or more dimensions with enough elements
    are Huffman-coded at the split point k that stores fewest bytes (or at the given k);
    every other tensor, or one that coding would not shrink, is kept raw."""
    tensor = tensor.detach().contiguous()
    layout = LAYOUTS.get(tensor.dtype)
    if k is not None and (layout is None or not valid_split(layout, k)):
        raise ValueError(f"{name}: cannot code {tensor.dtype} with split point k={k}")
    lib = _library(backend)
    num_threads = num_threads or default_threads()
    shape, crc = tuple(tensor.shape), checksum(tensor, lib, num_threads)
    small = tensor.dim() < 2 or tensor.numel() < MIN_CODED_ELEMENTS
    if layout is not None and tensor.numel() and (k is not None or not small):
        planes = _encode_planes(tensor, layout, k, lib, num_threads)
        if planes is not None:
            return EncodedTensor(name, "<memory>", tensor.dtype, shape, crc, planes, None)
    return EncodedTensor(name, "<memory>", tensor.dtype, shape, crc, None, tensor)


def decode_tensor(
    encoded: EncodedTensor,
    backend: str = "auto",
    num_threads: int | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """The original CPU tensor, bit for bit. Raises ModelFolderError(source) naming the
    tensor if the planes are inconsistent or (verify) the result fails its CRC-32C."""
    return decode_tensors([encoded], backend, num_threads, verify)[0]


def decode_tensors(
    encoded: Sequence[EncodedTensor],
    backend: str = "auto",
    num_threads: int | None = None,
    verify: bool = True,
) -> list[torch.Tensor]:
    """decode_tensor of each, in one call to the C decoder: large tensors split across
    threads and small ones decode side by side, the checksums computed as the output is
    written. Raises ModelFolderError for the first bad tensor in the list."""
    lib = _library(backend)
    out = [torch.empty(e.shape, dtype=e.dtype) if e.planes is not None else None for e in encoded]
    coded = [(e, t) for e, t in zip(encoded, out) if t is not None]
    if lib is not None and coded:
        jobs = [_job(e, t) for e, t in coded]
        results = native.decode_batch(lib, jobs, num_threads or default_threads(), verify)
    else:
        results = [_decode_reference(e, t, verify) for e, t in coded]
    found = iter(results)
    for i, e in enumerate(encoded):
        if e.planes is None:
            out[i] = e.data.contiguous()
            found_crc = checksum(out[i], lib) if verify else e.crc32c
        else:
            status, found_crc = next(found)
            if status != 0:
                raise _corrupt(e, native.PROBLEMS.get(status, f"decoder status {status}"))
        if verify and found_crc != e.crc32c:
            raise _corrupt(
                e, f"checksum mismatch (CRC-32C {found_crc:#010x}, stored {e.crc32c:#010x})"
            )
    return out


def check_stored(encoded: EncodedTensor) -> None:
    """ModelFolderError unless the stored bytes (planes, or raw data) still have the CRC-32C
    they were written with: for tensors that will be decoded elsewhere, e.g. on a GPU."""
    lib = _library("auto")
    if encoded.planes is None:
        ok = checksum(encoded.data, lib) == encoded.crc32c
    else:
        ok = planes_checksum(encoded.planes, lib) == encoded.planes.crc32c
    if not ok:
        raise _corrupt(encoded, "checksum mismatch in the stored bytes")


def full_lengths(encoded: EncodedTensor) -> np.ndarray:
    """The code length of every symbol (uint8[2**symbol_bits]); ModelFolderError if the
    planes do not have the sizes their metadata implies or the table is not a valid code."""
    problem = planes_problem(encoded)
    if problem is None:
        planes = encoded.planes
        symbols = 1 << (LAYOUTS[encoded.dtype].width - 1 - planes.k)
        lengths = unpack_lengths(planes.first_symbol, planes.lengths.cpu().numpy(), symbols)
        problem = "code table does not fit the alphabet" if lengths is None else None
    if problem is None:
        problem = table_problem(lengths)
    if problem is not None:
        raise _corrupt(encoded, problem)
    return lengths


def planes_problem(encoded: EncodedTensor) -> str | None:
    """What is wrong with the planes' dtypes and sizes, or None."""
    layout = LAYOUTS.get(encoded.dtype)
    planes = encoded.planes
    if layout is None or not valid_split(layout, planes.k) or planes.total_bits < 0:
        return f"cannot decode {encoded.dtype} split at k={planes.k} from {planes.total_bits} bits"
    n_seg = num_segments(planes.total_bits)
    symbols = 1 << (layout.width - 1 - planes.k)
    expected = {
        "stream": (torch.uint8, padded_plane_bytes(planes.total_bits)),
        "raw": (torch.uint8, raw_plane_bytes(encoded.num_elements, planes.k + 1)),
        "lengths": (torch.uint8, min(planes.lengths.numel(), symbols // 2 + 1)),
        "gaps": (torch.uint8, -(-n_seg // 2)),
        "block_first": (block_index_dtype(encoded.num_elements), num_blocks(planes.total_bits)),
    }
    for plane, (dtype, size) in expected.items():
        t = getattr(planes, plane)
        if t.dtype != dtype or t.dim() != 1 or t.numel() != size:
            return f"plane {plane!r} is {t.dtype}[{t.numel()}], expected {dtype}[{size}]"
    return None


def valid_split(layout: FloatLayout, k: int) -> bool:
    return 0 <= k and 0 < layout.width - 1 - k <= MAX_SYMBOL_BITS


def checksum(tensor: torch.Tensor, lib=None, num_threads: int = 1) -> int:
    """CRC-32C of a CPU tensor's bytes (on the C fast path if `lib`, on up to num_threads
    threads)."""
    return _crc32c(tensor.contiguous().reshape(-1).view(torch.uint8), lib, 0, num_threads)


def planes_checksum(planes: CodedPlanes, lib=None) -> int:
    """CRC-32C of the planes' bytes, in the order of CodedPlanes.tensors()."""
    value = 0
    for t in planes.tensors().values():
        value = _crc32c(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8), lib, value)
    return value


def _crc32c(flat_bytes: torch.Tensor, lib, value: int, num_threads: int = 1) -> int:
    if lib is not None:
        return native.crc32c(lib, flat_bytes.data_ptr(), flat_bytes.numel(), value, num_threads)
    return crc.crc32c(flat_bytes.numpy(), value)


def default_threads() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


_INDEX_DTYPES = (torch.int32, torch.int64)


def _job(encoded: EncodedTensor, out: torch.Tensor) -> native.Job:
    """The C decoder's view of one tensor: planes must be 1-D contiguous CPU tensors of
    their dtypes (their sizes and contents are the C side's to check)."""
    p = encoded.planes
    planes = (p.stream, p.raw, p.lengths, p.gaps)
    if not (
        all(t.dtype == torch.uint8 and t.dim() == 1 for t in planes)
        and p.block_first.dtype in _INDEX_DTYPES
        and p.block_first.dim() == 1
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (*planes, p.block_first))
    ):
        raise _corrupt(encoded, planes_problem(encoded) or "planes are not contiguous CPU tensors")
    return native.Job(
        *(t.data_ptr() for t in (*planes, p.block_first)),
        *(t.numel() for t in planes),
        p.block_first.numel(), p.block_first.element_size(), p.first_symbol, p.total_bits,
        encoded.num_elements, encoded.dtype.itemsize, p.k, out.data_ptr(), 0, 0,
    )  # fmt: skip


def _decode_reference(encoded: EncodedTensor, out: torch.Tensor, verify: bool):
    """(0, CRC-32C or None): the numpy reference decoder into `out`."""
    planes = {name: t.cpu().numpy() for name, t in encoded.planes.tensors().items()}
    planes["lengths"] = full_lengths(encoded)
    planes["block_first"] = planes["block_first"].astype(np.int64)
    flat = _bits(out).reshape(-1)
    width = LAYOUTS[encoded.dtype].width
    try:
        k, total_bits = encoded.planes.k, encoded.planes.total_bits
        flat[:] = reference.decode(planes, width, k, total_bits, flat.size).astype(flat.dtype)
    except PlaneError as e:
        raise _corrupt(encoded, str(e)) from e
    return 0, checksum(out) if verify else None


def _encode_planes(
    tensor: torch.Tensor, layout: FloatLayout, k: int | None, lib, num_threads: int
) -> CodedPlanes | None:
    """The planes at the chosen split point, or None if raw storage is no bigger."""
    flat = _bits(tensor).reshape(-1)
    bounds = native.chunk_bounds(flat.size, num_threads) if lib is not None else None
    choice = _choose_split(lib, flat, layout, k, bounds, num_threads)
    if choice is None:
        return None
    k, lengths, sizes, chunk_bits = choice
    if lib is None:
        planes = reference.encode(flat, layout.width, k, lengths)
    else:
        planes = native.encode(lib, flat, k, lengths, sizes, bounds, chunk_bits, num_threads)
    first_symbol, packed = pack_lengths(lengths)
    index = planes["block_first"].astype(np.int32 if flat.size < 1 << 31 else np.int64)
    arrays = (planes["stream"], planes["raw"], packed, planes["gaps"], index)  # tensors() order
    value = 0
    for array in arrays:  # planes_checksum on the numpy arrays: no torch calls per plane
        if lib is None:
            value = crc.crc32c(array.view(np.uint8).reshape(-1), value)
        else:
            value = native.crc32c(lib, array.ctypes.data, array.nbytes, value, num_threads)
    stream, raw, lengths_plane, gaps, block_first = map(torch.from_numpy, arrays)
    return CodedPlanes(
        stream, raw, lengths_plane, gaps, block_first, k, sizes["total_bits"], first_symbol, value
    )


def _choose_split(lib, flat: np.ndarray, layout: FloatLayout, k: int | None, bounds, threads):
    """_best_split of the split points worth trying (or of the given k)."""
    candidates = _candidates(lib, flat, layout, k, bounds, threads)
    return _best_split(candidates, flat.size, flat.itemsize, forced=k is not None)


def _best_split(candidates, n: int, itemsize: int, forced: bool = False):
    """(k, code lengths, plane sizes, chunk_bits) of the candidate (k, code lengths, chunk_bits,
    bytes of its stored code table) storing the n elements in fewest bytes, or None if storing
    them raw is no bigger (unless `forced`: the one candidate given is taken). chunk_bits:
    where the codes of each chunk start in the stream, then the total."""
    best, best_bytes = None, None if forced else n * itemsize
    index_width = block_index_dtype(n).itemsize
    for candidate, lengths, chunk_bits, table_bytes in candidates:
        sizes = _plane_sizes(int(chunk_bits[-1]), n, candidate)
        stored = sizes["stream"] + sizes["raw"] + sizes["gaps"] + table_bytes
        stored += sizes["block_first"] * index_width
        if best_bytes is None or stored < best_bytes:
            best, best_bytes = (candidate, lengths, sizes, chunk_bits), stored
    return best


def _candidates(lib, flat: np.ndarray, layout: FloatLayout, k: int | None, bounds, threads):
    """(k, code lengths, chunk_bits) of each split point worth trying (or of the given k),
    from one histogram at the finest of them."""
    ks = layout.candidate_ks() if k is None else [k]
    finest = min(ks)
    if lib is not None:
        counts = native.histogram(lib, flat, finest, bounds, threads)  # (chunks, symbols)
        lengths, chunk_bits = native.split_candidates(
            lib, counts, max(ks) - finest + 1, MAX_CODE_LEN
        )
        return _candidate_splits(ks, lengths, chunk_bits)
    symbols, _ = reference.split(flat, layout.width, finest)
    counts = np.bincount(symbols, minlength=1 << (layout.width - 1 - finest))
    out = []
    for candidate in ks:
        # Symbols at a coarser split are the finer ones shifted right: sum runs of counts.
        merged = counts.reshape(-1, 1 << (candidate - finest)).sum(axis=1)
        lengths = code_lengths(merged)
        used = np.flatnonzero(lengths)
        table_bytes = (int(used[-1]) - int(used[0]) + 2) // 2  # len(pack_lengths(lengths)[1])
        chunk_bits = np.array([0, np.dot(merged, lengths.astype(np.int64))])
        out.append((candidate, lengths, chunk_bits, table_bytes))
    return out


def _candidate_splits(ks: list[int], lengths: np.ndarray, chunk_bits: np.ndarray) -> list:
    """(k, code lengths, chunk_bits, bytes of the stored code table) of each split point in ks
    from the C encoder's rows for them (native.split_candidates: row c is split min(ks) + c,
    its first symbols >> c lengths in use, the rest zero)."""
    finest, symbols = min(ks), lengths.shape[1]
    used = lengths != 0
    first, last = used.argmax(axis=1), symbols - 1 - used[:, ::-1].argmax(axis=1)
    table_bytes = (last - first + 2) // 2  # len(pack_lengths(lengths)[1])
    return [
        (c, lengths[c - finest, : symbols >> (c - finest)], chunk_bits[c - finest],
         int(table_bytes[c - finest]))
        for c in ks
    ]  # fmt: skip


def _plane_sizes(total_bits: int, n: int, k: int) -> dict:
    n_seg = num_segments(total_bits)
    return {
        "total_bits": total_bits,
        "num_segments": n_seg,
        "stream": padded_plane_bytes(total_bits),
        "raw": raw_plane_bytes(n, k + 1),
        "gaps": -(-n_seg // 2),
        "block_first": num_blocks(total_bits),
    }


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A float tensor's element bits as an unsigned numpy array sharing its memory."""
    layout = LAYOUTS[tensor.dtype]
    unsigned = {8: np.uint8, 16: np.uint16, 32: np.uint32}[layout.width]
    return tensor.view(layout.int_dtype).numpy().view(unsigned)


def _library(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if backend == "reference":
        return None
    lib = native.load()
    if lib is None and backend == "native":
        raise RuntimeError("the codec's C fast path could not be built (see the log)")
    return lib


def _corrupt(encoded: EncodedTensor, problem: str) -> ModelFolderError:
    return ModelFolderError(encoded.source, f"tensor {encoded.name!r}: {problem}")
