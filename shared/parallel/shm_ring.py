"""Messages from one rank of a worker to others through shared memory, as vLLM's shm_broadcast
MessageQueue carries its scheduler's output to its workers: rank 0's step plans to every other
rank, a CPU stage's hidden states to the next stage, the last stage's samples back to rank 0
(comm.py). Over gloo's TCP loopback a message took 2-2.5 ms from send to receipt (2-core
Zen 5 VM), which the receiver spent waiting: rank 0 in the step's first all-reduce, 2.1 ms of a
4.9 ms tp=2 batch-1 decode step. Here a message costs a copy in, a counter and a copy out.

One mapping (shm_group.py's lines: a counter a member, their pids) and a ring of `slots`
slots: the writer (member 0) writes message n into slot n % slots, once every reader has read
message n - slots (their counters), and publishes n; a reader waits until the writer's counter
reaches n, copies the message out and publishes n. A message larger than a slot is marked so
and goes over the process group, in order (the same pair and tag). A reader waits as long as
the writer lives; after a while it naps a millisecond at a time (_shm_sync.c), so an idle
worker spins no core. The writer runs at most `slots` messages ahead of its slowest reader:
rank 0 launches at most P micro-batches ahead of its last stage (RING_SLOTS)."""

import math
import struct
from pathlib import Path

from shared.parallel import shm_group

_LENGTH = struct.Struct("<q")  # a slot's first 8 bytes: the message's length, or -1 (gloo)
_FOREVER = math.inf


class ShmRing:
    """Member 0 sends, every other member receives each message once, in order. ranks: each
    member's rank (in errors); name: what the messages are."""

    def __init__(
        self, name: str, path: Path, ranks: tuple[int, ...], member: int, create: bool,
        slots: int, slot: int,
    ):  # fmt: skip
        self.name, self.ranks, self.member, self.size = name, ranks, member, len(ranks)
        self.slots, self.slot_bytes = slots, slot
        self._map, self._lines, self._pids, self._ring = shm_group.shared_lines(
            path, member, self.size, slots * slot, create
        )
        self._lib = shm_group.sync_library()
        self._sent = 0  # the last message sent (member 0) or received

    def send(self, message) -> bool:
        """Member 0: publishes the next message (a bytes-like object); False where it does not
        fit a slot (then send it to every reader over the process group, after this call).
        RuntimeError where a reader is gone (or stuck) while the ring is full."""
        n = self._sent + 1
        if n > self.slots:  # its slot held message n - slots: every reader must have read it
            self._wait(n, self._lines[1:], self._pids[1:], self.size - 1, n - self.slots, 1)
        at = self._ring + (n - 1) % self.slots * self.slot_bytes
        length = len(message)
        fits = length <= self.slot_bytes - _LENGTH.size
        _LENGTH.pack_into(self._map, at, length if fits else -1)
        if fits:
            self._map[at + _LENGTH.size : at + _LENGTH.size + length] = message
        self._publish(n)
        return fits

    def recv(self) -> bytearray | None:
        """Member r > 0: the next message (a copy of its own, one copy out of the slot), or
        None where it comes over the process group."""
        n = self._sent + 1
        self._wait(n, self._lines, self._pids, 1, n, 0)
        at = self._ring + (n - 1) % self.slots * self.slot_bytes + _LENGTH.size
        (length,) = _LENGTH.unpack_from(self._map, at - _LENGTH.size)
        data = None
        if length >= 0:
            with memoryview(self._map) as ring:
                data = bytearray(ring[at : at + length])
        self._publish(n)  # its slot is free again: the message is copied out
        return data

    def _publish(self, n: int) -> None:
        self._lib.tison_shm_post(self._lines[self.member].data_ptr(), n)
        self._sent = n

    def _wait(self, message: int, lines, pids, count: int, until: int, first: int) -> None:
        """For message `message`: until each of `count` counters (lines[i, 0]; members first,
        first + 1, ...) reaches `until`: readers as long as the writer lives, the writer up to
        shm_group.TIMEOUT_S."""
        timeout = _FOREVER if self.member else shm_group.TIMEOUT_S
        status = self._lib.tison_shm_wait(
            lines.data_ptr(), shm_group.LINE, pids.data_ptr(), count, until, timeout
        )
        if status < 0:
            rank = self.ranks[first - 1 - status] if status > -1 - count else None
            why = "timed out" if rank is None else f"rank {rank}'s process is gone"
            raise RuntimeError(f"{self.name} {message}: {why}")


def open_ring(
    store, name: str, ranks: tuple[int, ...], rank: int, slots: int, slot_bytes: int
) -> ShmRing | None:
    """The ring of `ranks` (the first writes), on `rank`, made over the TCPStore they all use
    (call on each, in the same order as their other rendezvous); None (messages over gloo) as
    shm_group.rendezvous says."""
    member = ranks.index(rank)

    def make(path: Path, create: bool) -> ShmRing:
        return ShmRing(name, path, ranks, member, create, slots, slot_bytes)

    return shm_group.rendezvous(store, name.replace(" ", "-"), member, len(ranks), make)
