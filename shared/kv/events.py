"""A worker's KV events: the page hashes its prefix cache names, as numbered KVEventsMsg. Pure.

The engine reports, once an interval, the hashes it named and those it dropped since its last
report (LLMEngine.kv_events()). The stream keeps the whole named set (the snapshot's content)
and sends what changed. Protocol (the scheduler's side is services/scheduler/kv_index.py):

- messages of one worker id are numbered 0, 1, 2..., one at least per interval (empty ones too),
  so a lost message shows as a gap within an interval;
- the first message is a snapshot (`reset`), so a scheduler already running starts clean;
- on a gap, or when it starts after the worker, the scheduler asks for a snapshot
  (KVSnapshotAskMsg → `ask_snapshot`) and ignores the worker's deltas until it comes;
- a message holds at most `max_hashes` hashes; a longer snapshot or delta continues in the
  next numbers (a snapshot's continuations are plain deltas: additions to the reset set).

The engine names a hash at most once at a time (a duplicate page stays unnamed), so within one
report a hash's stores and evictions alternate, and its final state is its state before plus
stores minus evictions (0 or 1): the stream sends net changes, disjoint, in any order.
"""

from collections import Counter

from shared.protocol import KVEventsMsg

MAX_HASHES_PER_MSG = 32_768  # ~300 KB of msgpack, under NATS's default 1 MB payload limit


class KVEventStream:
    """The named set of one worker id and the numbering of its messages; one owner (its
    publisher)."""

    def __init__(self, worker_id: str, role: str, max_hashes: int = MAX_HASHES_PER_MSG):
        if max_hashes < 1:
            raise ValueError("max_hashes must be >= 1")
        self.worker_id, self.role, self.max_hashes = worker_id, role, max_hashes
        self.named: set[int] = set()  # hashes the worker's cache names now
        self._next_seq = 0
        self._snapshot_due = True

    def ask_snapshot(self) -> None:
        """The next `messages` sends the whole set (the scheduler lost track)."""
        self._snapshot_due = True

    def messages(self, stored: list[int], evicted: list[int]) -> list[KVEventsMsg]:
        """Apply one engine report; the messages to publish, in order (one at least)."""
        counts = Counter(stored)
        counts.subtract(evicted)
        added, dropped = [], []
        for page_hash, delta in counts.items():
            before = page_hash in self.named
            if before + delta > 0 and not before:
                added.append(page_hash)
            elif before + delta <= 0 and before:
                dropped.append(page_hash)
        self.named.update(added)
        self.named.difference_update(dropped)
        if self._snapshot_due:
            self._snapshot_due = False
            return self._split(list(self.named), [], reset=True)
        return self._split(added, dropped, reset=False)

    def _split(self, stored: list[int], evicted: list[int], reset: bool) -> list[KVEventsMsg]:
        out, n = [], self.max_hashes
        while True:
            s, stored = stored[:n], stored[n:]
            e, evicted = evicted[: n - len(s)], evicted[n - len(s) :]
            seq = self._next_seq
            out.append(KVEventsMsg(self.worker_id, self.role, seq, tuple(s), tuple(e), reset))
            self._next_seq += 1
            reset = False
            if not stored and not evicted:
                return out
