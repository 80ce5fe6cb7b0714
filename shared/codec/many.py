"""Encoding many tensors on a few threads. A tensor of more than MAX_BATCHED_ELEMENTS encodes
alone on every thread (the C encoder cuts it in chunks). Smaller ones go in batches of up to
BATCH_ELEMENTS, and a batch takes two C calls in all (_many.c), each tensor on one thread:
its CRC-32C, histogram, candidate splits, the split chosen and its plane sizes; then, once
Python has laid out one buffer for all the planes, its planes. Called one by one, a small
tensor's ~9 calls through ctypes each gave up the GIL and waited for it back, and on 2 threads
such tensors encoded at 1.14x of one thread. The planes are the same however the work is dealt
(encode_tensor's)."""

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from shared.codec import native
from shared.codec.format import (
    LAYOUTS,
    MAX_CODE_LEN,
    MIN_CODED_ELEMENTS,
    CodedPlanes,
    EncodedTensor,
)
from shared.codec.tensor import default_threads, encode_tensor

MAX_BATCHED_ELEMENTS = 1 << 22  # 8 MiB of bf16: ~4 ms of C, split 8 ways when encoded alone
BATCH_ELEMENTS = 1 << 25  # what a batch holds at most (the tensors are loaded together)
BATCH_TENSORS = 1024  # and its tensors: each has up to 8 KiB of code-length scratch


def encode_tensors(
    tensors: Mapping[str, torch.Tensor], num_threads: int | None = None
) -> list[EncodedTensor]:
    """encode_tensor of each (name, tensor), in order, on up to num_threads threads."""
    names = list(tensors)
    out: list[EncodedTensor] = []
    encode_lazily(names, lambda n: tensors[n].numel(), tensors.__getitem__, num_threads, out.append)
    return out


def encode_lazily(
    names: Sequence[str],
    num_elements: Callable[[str], int],
    load: Callable[[str], torch.Tensor],
    num_threads: int | None,
    on_encoded: Callable[[EncodedTensor], None],
) -> None:
    """Encodes load(name) for each name, calling on_encoded with each result in the order of
    `names`; a tensor is loaded only when its batch (or, if large, itself) is next."""
    threads = num_threads or default_threads()
    lib = native.load()
    native.keep_freed_memory()
    batch: list[tuple[str, torch.Tensor]] = []
    held = 0  # elements in `batch`

    def flush() -> None:
        nonlocal held
        for encoded in encode_batch(lib, batch, threads):
            on_encoded(encoded)
        batch.clear()
        held = 0

    with native.helpers_polling(lib) if lib is not None else contextlib.nullcontext():
        for name in names:
            size = num_elements(name)
            if lib is None or size > MAX_BATCHED_ELEMENTS:
                flush()
                on_encoded(encode_tensor(load(name), name, num_threads=threads))
                continue
            if held + size > BATCH_ELEMENTS or len(batch) == BATCH_TENSORS:
                flush()
            batch.append((name, load(name)))
            held += size
        flush()


def encode_batch(
    lib, items: Sequence[tuple[str, torch.Tensor]], num_threads: int
) -> list[EncodedTensor]:
    """encode_tensor(tensor, name) of each item, in order, in two calls of the C library `lib`
    on up to num_threads threads (largest tensors first, so that the threads finish together).
    Python only lists the tensors and lays out one buffer for every plane: the split choice and
    the plane sizes are the C library's (tensor.py's _best_split, FORMAT.md's sizes)."""
    if not items:
        return []
    tensors = [t.detach().contiguous() for _, t in items]
    order = sorted(range(len(items)), key=lambda i: -tensors[i].numel())
    jobs = np.zeros(len(items), dtype=native.MANY_JOB)
    ts = [tensors[i] for i in order]
    jobs["bits"] = [t.data_ptr() for t in ts]
    jobs["n"] = [t.numel() for t in ts]
    jobs["width"] = [t.element_size() for t in ts]
    splits = np.array([_splits(t) for t in ts], dtype=np.int64)  # (jobs, 3)
    jobs["finest"], jobs["ncand"] = splits[:, 0], splits[:, 1]
    lengths = _scratch(splits[:, 1] * splits[:, 2])  # each candidate's code lengths
    jobs["lengths"] = lengths[1]
    chunk_bits = np.zeros((len(items), 2 * MAX_CANDIDATES), dtype=np.int64)
    jobs["chunk_bits"] = chunk_bits.ctypes.data + np.arange(len(items)) * chunk_bits.strides[0]
    native.stats_many(lib, jobs, MAX_CODE_LEN, num_threads)

    coded = np.flatnonzero(jobs["k"] >= 0)
    sub = jobs[coded]  # a copy: the coded jobs, contiguous
    sizes = np.stack([sub[f"{p}_len"] for p in PLANES[:4]] + [sub["n_blocks"]], axis=1)
    sizes[:, 4] *= sub["index_width"]  # (coded, 5) bytes of each plane, tensors() order
    planes = _scratch(sizes.reshape(-1), zeroed=False)
    starts = planes[1].reshape(-1, len(PLANES))
    for column, plane in enumerate(PLANES):
        sub[plane] = starts[:, column]
    native.encode_many(lib, sub, num_threads)

    out: list[EncodedTensor | None] = [None] * len(items)
    for j, i in enumerate(order):
        name, t, job = items[i][0], tensors[i], jobs[j]
        shape, crc = tuple(t.shape), int(job["crc"])
        out[i] = EncodedTensor(name, "<memory>", t.dtype, shape, crc, None, t)
    buffer, at = planes[0], starts - planes[0].ctypes.data
    for row, (job, i) in enumerate(zip(sub, (order[j] for j in coded))):
        spans = zip(at[row].tolist(), sizes[row].tolist())
        arrays = [torch.from_numpy(buffer[a : a + nbytes]) for a, nbytes in spans]
        arrays[4] = arrays[4].view(torch.int32 if job["index_width"] == 4 else torch.int64)
        coded_planes = CodedPlanes(
            *arrays, int(job["k"]), int(job["total_bits"]), int(job["first_symbol"]),
            int(job["planes_crc"]),
        )  # fmt: skip
        out[i] = dataclasses.replace(out[i], planes=coded_planes, data=None)
    return out


MAX_CANDIDATES = 4  # FloatLayout.candidate_ks: the exponent plus 0..3 mantissa bits
PLANES = ("stream", "raw", "packed", "gaps", "index")  # MANY_JOB's addresses, tensors() order


def _splits(t: torch.Tensor) -> tuple[int, int, int]:
    """(finest candidate split, number of candidates, symbols at the finest) of a tensor
    encode_tensor may code, else zeros: it is kept raw."""
    layout = LAYOUTS.get(t.dtype)
    if layout is None or t.dim() < 2 or t.numel() < MIN_CODED_ELEMENTS:
        return 0, 0, 0
    ks = layout.candidate_ks()
    assert len(ks) <= MAX_CANDIDATES and ks == sorted(ks, reverse=True)  # as _many.c tries them
    return min(ks), len(ks), 1 << (layout.width - 1 - min(ks))


def _scratch(nbytes: np.ndarray, zeroed: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(one buffer, zeroed or native.plane_buffer's, the address of each of its parts of
    nbytes[i] bytes, each 64-byte aligned). One allocation a batch, not several a tensor:
    freshly mapped planes fault their pages in, and unmapping them interrupts every core the
    process runs on (a TLB shootdown), which with two encoding threads on a virtual machine
    took more system time than the encoding (4,400 faults and ~30 ms a batch of MiniLM's 39
    small tensors)."""
    rounded = -(-nbytes // 64) * 64
    offsets = np.concatenate([[0], np.cumsum(rounded)[:-1]]) if len(nbytes) else rounded
    size = int(rounded.sum()) + 64
    buffer = np.zeros(size, dtype=np.uint8) if zeroed else native.plane_buffer(size)
    base = -buffer.ctypes.data % 64
    return buffer[base:], buffer.ctypes.data + base + offsets
