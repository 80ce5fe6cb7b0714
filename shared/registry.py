"""Which workers are alive, from their heartbeats. Pure: the caller passes the time.

Both the scheduler (to route) and the gateway (to fail the requests of a dead worker, and for
/health and /metrics) keep one. A worker is dead once it has missed `miss_limit` of its own
heartbeat intervals; `reap` removes it and reports it exactly once. A worker that comes back
under the same id after being reaped is simply registered again.
"""

from dataclasses import dataclass, field

from shared.protocol import HeartbeatMsg

DEFAULT_MISS_LIMIT = 3


@dataclass
class WorkerRegistry:
    """Latest heartbeat and arrival time of every live worker, keyed by worker id."""

    miss_limit: int = DEFAULT_MISS_LIMIT
    _beats: dict[str, HeartbeatMsg] = field(default_factory=dict)
    _seen_at: dict[str, float] = field(default_factory=dict)

    def observe(self, beat: HeartbeatMsg, now: float) -> bool:
        """Record a heartbeat; True when the worker is new (or back after being reaped)."""
        is_new = beat.worker_id not in self._beats
        self._beats[beat.worker_id] = beat
        self._seen_at[beat.worker_id] = now
        return is_new

    def _expired(self, worker_id: str, now: float) -> bool:
        beat = self._beats[worker_id]
        return now - self._seen_at[worker_id] > self.miss_limit * beat.interval_s

    def reap(self, now: float) -> list[HeartbeatMsg]:
        """Remove and return the workers that missed too many heartbeats."""
        dead = [w for w in self._beats if self._expired(w, now)]
        for worker_id in dead:
            del self._seen_at[worker_id]
        return [self._beats.pop(w) for w in dead]

    def alive(self, role: str, now: float) -> list[HeartbeatMsg]:
        """Latest heartbeats of the live workers of `role`, in worker id order."""
        return [
            beat
            for worker_id, beat in sorted(self._beats.items())
            if beat.role == role and not self._expired(worker_id, now)
        ]

    def get(self, worker_id: str) -> HeartbeatMsg | None:
        """Latest heartbeat of a registered worker (possibly expired but not reaped yet)."""
        return self._beats.get(worker_id)

    def is_alive(self, worker_id: str, now: float) -> bool:
        return worker_id in self._beats and not self._expired(worker_id, now)
