"""Pipelined checkpoint reads: a reader thread reads the bytes of the tensors a load needs, at
most `readahead_bytes` ahead of the caller, and groups them in batches; a decoder thread turns
each batch into tensors (for a compressed folder: one multi-threaded decode_tensors call, which
releases the GIL); the caller places batch i into the model while batch i+1 decodes and batch
i+2 is read. File reads go through os.preadv, which releases the GIL too.

TISON_READ_LIMIT_MBPS (benchmarks only) caps the reads of every pipelined load of the process
at that many MB/s, raw and compressed alike: a stand-in for storage slower than the decoder."""

import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.codec.format import DTYPES_BY_NAME
from shared.errors import ModelFolderError

READ_LIMIT_ENV = "TISON_READ_LIMIT_MBPS"
READAHEAD_BYTES = 256 << 20  # read, not yet placed: bounds the load's extra memory
# decoded bytes a batch gathers before it is handed on: the last batch's decode and placement
# are the part that cannot overlap, and the batches in flight stay in cache. 16 MiB against 64,
# fresh processes alternated 6 times on a Zen 3 (2 cores), the median load_weights: 1 GB
# compressed 1.16 s against 1.26, 1 GB raw 0.95 against 1.00, the 150M compressed at 300 MB/s
# reads 0.79 against 0.83.
BATCH_BYTES = 16 << 20
_CHUNK = 8 << 20  # one preadv; the read limit is applied chunk by chunk
_POLL_S = 0.05  # how often a blocked thread checks whether the load stopped


@dataclass(frozen=True)
class StoredTensor:
    """Where a safetensors file keeps one tensor's bytes."""

    dtype: str  # safetensors' name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Tensor name -> StoredTensor of a safetensors file (its header only)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        base = 8 + size
        return {
            name: StoredTensor(
                e["dtype"],
                tuple(e["shape"]),
                base + e["data_offsets"][0],
                e["data_offsets"][1] - e["data_offsets"][0],
            )  # fmt: skip
            for name, e in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise ModelFolderError(str(path), f"not a readable safetensors file ({e})") from e


def open_fd(path: Path, files: ExitStack) -> int:
    """A read-only descriptor of `path`, closed with `files`."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ModelFolderError(str(path), f"unreadable ({e})") from e
    files.callback(os.close, fd)
    return fd


class ReadLimit:
    """At most `bytes_per_s` read since the first read (None: no limit); shared by threads."""

    def __init__(self, bytes_per_s: float | None):
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._start: float | None = None
        self._done = 0

    @classmethod
    def from_env(cls) -> "ReadLimit":
        value = os.environ.get(READ_LIMIT_ENV, "").strip()
        return cls(float(value) * 1e6 if value else None)

    def wait(self, nbytes: int) -> None:
        """Sleeps until `nbytes` more may be read."""
        if self.bytes_per_s is None:
            return
        with self._lock:
            now = time.monotonic()
            self._start = now if self._start is None else self._start
            self._done += nbytes
            due = self._start + self._done / self.bytes_per_s
        if due > now:
            time.sleep(due - now)


def pread_tensor(
    fd: int, where: StoredTensor, limit: ReadLimit, path: Path, name: str
) -> torch.Tensor:
    """The bytes of tensor `name` read from `fd` (the open file `path`) into a uint8 tensor."""
    out = torch.empty(where.nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()) if where.nbytes else memoryview(b"")
    if limit.bytes_per_s is None and where.nbytes:  # the kernel reads the rest meanwhile
        os.posix_fadvise(fd, where.start, where.nbytes, os.POSIX_FADV_WILLNEED)
    done = 0
    while done < where.nbytes:
        n = min(_CHUNK, where.nbytes - done)
        limit.wait(n)
        got = os.preadv(fd, [view[done : done + n]], where.start + done)
        if got <= 0:
            problem = f"truncated ({done} of its {where.nbytes} bytes in the file)"
            raise ModelFolderError(str(path), f"tensor {name!r}: {problem}")
        done += got
    return out


def as_stored(data: torch.Tensor, where: StoredTensor, path: Path, name: str) -> torch.Tensor:
    """The bytes pread_tensor read, as the tensor of the dtype and shape the header gives."""
    try:
        return data.view(DTYPES_BY_NAME[where.dtype]).reshape(where.shape)
    except (KeyError, RuntimeError) as e:
        problem = f"{where.nbytes} bytes stored as {where.dtype}{list(where.shape)} ({e})"
        raise ModelFolderError(str(path), f"tensor {name!r}: {problem}") from e


@dataclass
class _Batch:
    names: list[str]
    items: list  # what read() gave for each name
    nbytes: int  # bytes read for the batch, released when the caller takes it


_DONE = object()  # end of the stream, after the last batch


def pipelined(
    jobs: list[tuple[str, int, int]],  # (name, bytes to read, bytes once decoded), in order
    read: Callable[[str], object],  # name -> what decode takes (from the file, on the reader)
    decode: Callable[[list], list[torch.Tensor]],  # a batch's items -> their tensors
    readahead_bytes: int = READAHEAD_BYTES,
    batch_bytes: int = BATCH_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every job, read and decoded on two threads ahead of the caller. An
    error on either thread is raised here; closing the iterator early (or an error) stops and
    joins both threads."""
    budget = _Budget(readahead_bytes)
    stop = threading.Event()
    read_q: queue.Queue = queue.Queue()  # bounded by the budget
    decoded_q: queue.Queue = queue.Queue(maxsize=1)  # one decoded batch waits for the caller
    threads = [
        threading.Thread(
            target=_reader, args=(jobs, read, batch_bytes, budget, read_q, stop), daemon=True,
            name="tison-read",
        ),
        threading.Thread(
            target=_decoder, args=(decode, read_q, decoded_q, stop), daemon=True,
            name="tison-decode",
        ),
    ]  # fmt: skip
    for t in threads:
        t.start()
    try:
        while True:
            batch = _get(decoded_q, stop)
            if batch is _DONE:
                return
            if isinstance(batch, BaseException):
                raise batch
            budget.release(batch.nbytes)
            yield from zip(batch.names, batch.items)
    finally:
        stop.set()
        budget.release(0)  # wakes a reader waiting for budget
        for t in threads:
            t.join()


class _Budget:
    """Bytes read and not yet taken by the caller, at most `limit` (one batch always fits)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cond = threading.Condition()

    def fits(self, nbytes: int) -> bool:
        with self._cond:
            return not self.used or self.used + nbytes <= self.limit

    def take(self, nbytes: int, stop: threading.Event) -> bool:
        with self._cond:
            while self.used and self.used + nbytes > self.limit and not stop.is_set():
                self._cond.wait(_POLL_S)
            self.used += nbytes
            return not stop.is_set()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.used -= nbytes
            self._cond.notify_all()


def _reader(jobs, read, batch_bytes, budget: _Budget, out: queue.Queue, stop) -> None:
    batch, decoded = _Batch([], [], 0), 0
    try:
        for name, nbytes, out_bytes in jobs:
            if batch.names and not budget.fits(nbytes):  # hand it on rather than wait on it
                out.put(batch)
                batch, decoded = _Batch([], [], 0), 0
            if not budget.take(nbytes, stop):
                return
            batch.names.append(name)
            batch.items.append(read(name))
            batch.nbytes += nbytes
            decoded += out_bytes
            if decoded >= batch_bytes:
                out.put(batch)
                batch, decoded = _Batch([], [], 0), 0
        if batch.names:
            out.put(batch)
        out.put(_DONE)
    except BaseException as e:  # handed to the caller, raised there
        out.put(e)


def _decoder(decode, source: queue.Queue, out: queue.Queue, stop) -> None:
    while not stop.is_set():
        batch = _get(source, stop)
        if isinstance(batch, _Batch):
            try:
                batch.items = decode(batch.items)
            except BaseException as e:
                batch = e
        if batch is None or not _put(out, batch, stop) or not isinstance(batch, _Batch):
            return


def _get(q: queue.Queue, stop: threading.Event):
    """The next item, or None once the load stopped."""
    while not stop.is_set():
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            continue
    return None


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False
