"""Collectives of a worker's CPU ranks through shared memory, as vLLM's CPU backend does: on a
host, gloo's TCP loopback takes 165-650 us for an all-to-all or all-gather of a few rows and
0.75-1.5 ms for an all-reduce (2-core Zen 5 VM), more than a decode step's layer; here one takes
a copy in, a wait on the peers' step counters (_shm_sync.c) and a copy out: 26-36 us.

One mapping a group, made by rank 0 and unlinked once every rank has it open: a cache line of
step counter a rank, each rank's pid, then two sets (alternate steps) of SLOT_BYTES a rank. A
rank writes its part of step n into set n % 2, publishes n, waits until every counter reaches
n, and reads. It can write set n % 2 again only at step n + 2, after every rank published
n + 1, which each does after reading step n: no step's data is overwritten while read.

A part larger than its slot goes over the process group instead: every rank learns of it in
the same step (a flag beside its counter, one for each set), so all of them fall back
together. A peer whose process is gone, or a wait over TIMEOUT_S, raises. The mapping's memory
is taken when it is made: where /dev/shm has no room for it, the ranks use gloo.
`TISON_CPU_COLLECTIVES=gloo` keeps every collective on gloo (and is how the tests run that path
on every machine)."""

import ctypes
import logging
import math
import mmap
import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kernels.build import build_library
from kernels.cpu import all_reduce
from kernels.cpu.all_reduce import ShmReduce

log = logging.getLogger(__name__)

ENV_VAR = "TISON_CPU_COLLECTIVES"  # shm (default) | gloo
SLOT_BYTES = 8 << 20  # a rank's part of one step
TIMEOUT_S = 300.0  # a collective waiting longer has lost a peer
LINE = 8  # int64s a cache line: each rank's counter and flag on a line of its own
_lib: list = []  # [the loaded _shm_sync library, or None], once tried
T = TypeVar("T")


def sync_library():
    if not _lib:
        source = Path(__file__).with_name("_shm_sync.c")
        try:
            lib = ctypes.CDLL(
                str(build_library("tison_shm_sync", [source], ["-O2", "-shared", "-fPIC"]))
            )
            lib.tison_shm_post.argtypes = [ctypes.c_void_p, ctypes.c_int64]
            lib.tison_shm_wait.restype = ctypes.c_int64
            lib.tison_shm_wait.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            lib.tison_shm_wait.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
        except (OSError, subprocess.SubprocessError) as e:
            log.info("shared-memory collectives: %s; the ranks use gloo", e)
            lib = None
        _lib.append(lib)
    return _lib[0]


class ShmGroup:
    """`size` ranks' collectives on CPU tensors; each returns None (all_reduce: False) when a
    part does not fit its slot, on every rank alike: the caller then uses its process group."""

    def __init__(self, path: Path, rank: int, size: int, create: bool):
        self.rank, self.size = rank, size
        self._map, self._lines, self._pids, slots = shared_lines(
            path, rank, size, 2 * size * SLOT_BYTES, create
        )
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8)[slots:]
        self._slots = self._slots.view(2, size, SLOT_BYTES)
        lib = sync_library()
        # the step counter's owner, which the C all-reduce advances too
        self.c = ShmReduce(
            self._lines.data_ptr(), self._pids.data_ptr(), self._slots.data_ptr(), LINE,
            SLOT_BYTES, rank, size, 0, 0, TIMEOUT_S,
            ctypes.cast(lib.tison_shm_post, ctypes.c_void_p),
            ctypes.cast(lib.tison_shm_wait, ctypes.c_void_p),
        )  # fmt: skip
        self._lib = lib

    def all_reduce(self, x: torch.Tensor) -> bool:
        """x summed over the ranks in place (in float32 for a bf16 x, in rank order, the same
        bits on every rank): by the C kernels (all_reduce.c, as the fused decoder) where they
        take x."""
        if all_reduce.takes(x, SLOT_BYTES):
            all_reduce.all_reduce(self.c, x)
            return True
        parts = self._exchange(x)
        if parts is None:
            return False
        wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
        total = parts[0].to(wide)
        for part in parts[1:]:
            total = total + part.to(wide)
        x.copy_(total)
        return True

    def all_gather_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Every rank's rows (rank s holds rows[s] of them), concatenated along dim 0."""
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        slots = self._next()
        fits = max(rows) * row_bytes <= SLOT_BYTES
        if fits:
            slots[self.rank, : len(x) * row_bytes].copy_(x.reshape(-1).view(torch.uint8))
        if not self._sync(fits):
            return None
        return torch.cat([self._rows(slots[s], 0, n, x) for s, n in enumerate(rows)])

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x (the same shape on each) concatenated along the last dim."""
        parts = self._exchange(x)
        return None if parts is None else torch.cat(parts, dim=-1)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor | None:
        """TPGroup.all_to_all's rows: those for rank d go to the d-th part of this rank's slot."""
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        part = SLOT_BYTES // self.size // 64 * 64  # aligned for any dtype's view
        slots = self._next()
        fits = max(max(send), max(recv)) * row_bytes <= part
        if fits:
            flat, at = x.reshape(-1).view(torch.uint8), 0
            for d, n in enumerate(send):
                slots[self.rank, d * part : d * part + n * row_bytes].copy_(
                    flat[at : at + n * row_bytes]
                )
                at += n * row_bytes
        if not self._sync(fits):
            return None
        return torch.cat([self._rows(slots[s], self.rank * part, n, x) for s, n in enumerate(recv)])

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (the same shape on each), in rank order, as views of the slots."""
        nbytes = x.numel() * x.element_size()
        slots = self._next()
        fits = nbytes <= SLOT_BYTES
        if fits:
            slots[self.rank, :nbytes].copy_(x.reshape(-1).view(torch.uint8))
        if not self._sync(fits):
            return None
        return [slots[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]

    def _next(self) -> torch.Tensor:
        """(size, SLOT_BYTES) the slots of the next step."""
        return self._slots[(self.c.step + 1) % 2]

    def _sync(self, fits: bool) -> bool:
        """Publishes this rank's next step (and whether its part fit), waits for every rank's;
        whether every part fit."""
        step = self.c.step = self.c.step + 1
        flag = 1 + step % 2  # a flag a parity: a peer a step ahead keeps this one
        line = self._lines[self.rank]
        line[flag] = 1 if fits else 0  # read by the peers once they see the step (release below)
        self._lib.tison_shm_post(line.data_ptr(), step)
        status = self._lib.tison_shm_wait(
            self._lines.data_ptr(), LINE, self._pids.data_ptr(), self.size, step, TIMEOUT_S
        )
        if status < 0:
            self.c.error = status
            raise RuntimeError(all_reduce.failure(self.c))
        return bool(self._lines[:, flag].all())

    @staticmethod
    def _rows(slot: torch.Tensor, at: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """n rows shaped as like's, from byte `at` of a slot."""
        row_bytes = math.prod(like.shape[1:]) * like.element_size()
        data = slot[at : at + n * row_bytes].view(like.dtype)
        return data.view(n, *like.shape[1:])


def shared_lines(path: Path, rank: int, size: int, extra: int, create: bool):
    """The mapping of `path` (made with create, its memory taken now: a full /dev/shm fails
    here, not by a fault mid-step): a line of int64s for each of `size` ranks (counters and
    flags), their pids (this rank's set), then `extra` bytes. Returns (mapping, lines (size,
    LINE), pids (size,), the offset of the extra bytes)."""
    header = size * LINE * 8 + math.ceil(size / LINE) * LINE * 8
    total = header + extra
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create and hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, total)
        elif create:
            os.ftruncate(fd, total)
        mapping = mmap.mmap(fd, total)
    finally:
        os.close(fd)
    memory = torch.frombuffer(mapping, dtype=torch.uint8)
    lines = memory[: size * LINE * 8].view(torch.int64).view(size, LINE)
    pids = memory[size * LINE * 8 : header].view(torch.int64)
    pids[rank] = os.getpid()
    return mapping, lines, pids, header


def rendezvous(store, prefix: str, rank: int, size: int, make: Callable[[Path, bool], T]):
    """make(path, create) on every rank (call on every rank, in the same order as their process
    groups): rank 0 creates a /dev/shm file, the others open it, and it is unlinked once all
    have it mapped. None on every rank alike (rank 0 decides) where TISON_CPU_COLLECTIVES=gloo,
    the sync library cannot be built, or /dev/shm has no room."""
    key = f"{prefix}/shm"
    if rank == 0:
        path, made = "", None
        if os.environ.get(ENV_VAR, "shm") != "gloo" and sync_library() is not None:
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
            path = str(base / f"tison-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            try:
                made = make(Path(path), True)
            except OSError as e:  # /dev/shm too small (a container's 64 MiB default)
                log.warning("shared memory for %s: %s; the ranks use gloo", prefix, e)
                Path(path).unlink(missing_ok=True)
                path = ""
        store.set(key, path)
        if path:
            store.wait([f"{prefix}/mapped{r}" for r in range(1, size)])
            os.unlink(path)  # each rank holds its mapping: nothing is left behind
        return made
    path = store.get(key).decode()
    if not path:
        return None
    made = make(Path(path), False)
    store.set(f"{prefix}/mapped{rank}", "1")
    return made


def open_group(store, prefix: str, rank: int, size: int) -> ShmGroup | None:
    """The ranks' shared-memory group, made over the TCPStore all of them use (rendezvous)."""
    return rendezvous(
        store, prefix, rank, size, lambda path, create: ShmGroup(path, rank, size, create)
    )
