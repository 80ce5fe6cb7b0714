"""Step plans from rank 0 to a worker's other ranks through shared memory, as vLLM's
shm_broadcast MessageQueue carries its scheduler's output to its workers. Over gloo's TCP
loopback a plan took 2-2.5 ms from send to receipt (2-core Zen 5 VM), and rank 0 waited that
long in its step's first all-reduce for the other ranks to arrive: 2.1 ms of a 4.9 ms tp=2
batch-1 decode step. Here a plan costs a copy in, a counter and a copy out.

One mapping (shm_group.py's lines: a step counter a rank, their pids) and a ring of SLOTS
slots: rank 0 writes plan n into slot n % SLOTS, once every reader has read plan n - SLOTS
(their counters), and publishes n; a reader waits until rank 0's counter reaches n, copies the
plan out and publishes n. A plan larger than a slot is marked so and goes over the process
group, in order (the same pair and tag). A reader waits for plans as long as rank 0 lives;
after a while it naps a millisecond at a time (_shm_sync.c), so an idle worker spins no
core."""

import math
import struct
from pathlib import Path

from shared.parallel import shm_group

SLOTS = 8  # plans in flight: a pipeline's micro-batches, ahead of its last stage
SLOT_BYTES = 512 << 10  # a plan of a batch's new prompts fits (~60k tokens); larger: gloo
_LENGTH = struct.Struct("<q")  # a slot's first 8 bytes: the plan's length, or -1 (gloo)
_FOREVER = math.inf


class PlanChannel:
    """Rank 0 sends, every other rank receives each plan once, in order."""

    def __init__(self, path: Path, rank: int, size: int, create: bool):
        self.rank, self.size = rank, size
        self._map, self._lines, self._pids, self._ring = shm_group.shared_lines(
            path, rank, size, SLOTS * SLOT_BYTES, create
        )
        self._lib = shm_group.sync_library()
        self._plan = 0  # the last plan sent (rank 0) or received

    def send(self, plan: bytes) -> bool:
        """Rank 0: publishes the next plan; False where it does not fit a slot (then send it
        to every rank over the process group, after this call). RuntimeError where a reader
        is gone (or stuck) while the ring is full."""
        n = self._plan + 1
        if n > SLOTS:  # its slot held plan n - SLOTS: every reader must have read it
            self._wait(n, self._lines[1:], self._pids[1:], self.size - 1, n - SLOTS, 1)
        at = self._ring + (n - 1) % SLOTS * SLOT_BYTES
        fits = len(plan) <= SLOT_BYTES - _LENGTH.size
        _LENGTH.pack_into(self._map, at, len(plan) if fits else -1)
        if fits:
            self._map[at + _LENGTH.size : at + _LENGTH.size + len(plan)] = plan
        self._publish(n)
        return fits

    def recv(self) -> bytes | None:
        """Rank r > 0: the next plan, or None where it comes over the process group."""
        n = self._plan + 1
        self._wait(n, self._lines, self._pids, 1, n, 0)
        at = self._ring + (n - 1) % SLOTS * SLOT_BYTES
        (length,) = _LENGTH.unpack_from(self._map, at)
        plan = None if length < 0 else self._map[at + _LENGTH.size : at + _LENGTH.size + length]
        self._publish(n)  # its slot is free again: the plan is copied out
        return plan

    def _publish(self, n: int) -> None:
        self._lib.tison_shm_post(self._lines[self.rank].data_ptr(), n)
        self._plan = n

    def _wait(self, plan: int, lines, pids, count: int, until: int, first: int) -> None:
        """For plan `plan`: until each of `count` counters (lines[i, 0]; ranks first, first + 1,
        ...) reaches `until`: readers as long as rank 0 lives, rank 0 up to TIMEOUT_S."""
        timeout = _FOREVER if self.rank else shm_group.TIMEOUT_S
        status = self._lib.tison_shm_wait(
            lines.data_ptr(), shm_group.LINE, pids.data_ptr(), count, until, timeout
        )
        if status < 0:
            rank = first - 1 - status
            why = "timed out" if status == -1 - count else f"rank {rank}'s process is gone"
            raise RuntimeError(f"step plan {plan}: {why}")


def open_channel(store, rank: int, size: int) -> PlanChannel | None:
    """The worker's plan channel, made over the TCPStore every rank uses (call on every rank,
    in the same order); None (plans over gloo) as shm_group.rendezvous says."""

    def make(path: Path, create: bool) -> PlanChannel:
        return PlanChannel(path, rank, size, create)

    return shm_group.rendezvous(store, "plans", rank, size, make)
