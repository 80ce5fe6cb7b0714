"""The scheduler's view of every worker's prefix cache, from their KV events. Pure.

Per worker id, the set of page hashes (shared/kv/block_hash.py) its cache names, kept in step
with its numbered KVEventsMsg (shared/kv/events.py has the worker's side): a snapshot (`reset`)
replaces the set, the next number applies its delta, any other number means a message was
lost or the scheduler started after the worker: the set is dropped (no overlap is credited
rather than a wrong one) until a snapshot arrives, and `apply` says to ask for one.
A worker that leaves the registry is forgotten (`forget`).

A request's overlap with a worker is the number of its leading page hashes the worker names:
a prefix cache can only use a prefix, so the first miss ends it.
"""

from dataclasses import dataclass, field

from shared.protocol import KVEventsMsg


@dataclass
class KVIndex:
    """Page hashes named by each worker's prefix cache."""

    _named: dict[str, set[int]] = field(default_factory=dict)
    _next_seq: dict[str, int] = field(default_factory=dict)  # absent: waiting for a snapshot

    def apply(self, msg: KVEventsMsg) -> bool:
        """Apply one message; False when the worker's set is unknown and a snapshot is needed."""
        worker = msg.worker_id
        if msg.reset:
            self._named[worker] = set()
        elif self._next_seq.get(worker) != msg.seq:
            self.forget(worker)
            return False
        named = self._named[worker]
        named.update(msg.stored)
        named.difference_update(msg.evicted)
        self._next_seq[worker] = msg.seq + 1
        return True

    def forget(self, worker_id: str) -> None:
        """Drop a worker (dead, or its set out of step)."""
        self._named.pop(worker_id, None)
        self._next_seq.pop(worker_id, None)

    def num_pages(self, worker_id: str) -> int:
        """How many page hashes the worker's cache names, as far as the index knows."""
        return len(self._named.get(worker_id, ()))

    def overlap(self, worker_id: str, hashes: list[int]) -> int:
        """Leading pages of `hashes` (a request's, in order) that the worker's cache names."""
        named = self._named.get(worker_id)
        if not named:
            return 0
        for i, page_hash in enumerate(hashes):
            if page_hash not in named:
                return i
        return len(hashes)
