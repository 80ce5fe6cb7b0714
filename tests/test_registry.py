"""Worker registry: liveness from heartbeats with the time passed in."""

from shared.protocol import HeartbeatMsg
from shared.registry import WorkerRegistry


def beat(worker_id, role="decode", interval_s=0.5, **load):
    return HeartbeatMsg(worker_id, role, "m", 256, interval_s, **load)


def test_alive_by_role_and_expiry_after_missed_beats():
    reg = WorkerRegistry(miss_limit=3)
    assert reg.observe(beat("d1"), now=10.0)
    assert not reg.observe(beat("d1", free_pages=4), now=10.4)
    reg.observe(beat("p1", role="prefill", interval_s=1.0), now=10.0)
    assert [b.worker_id for b in reg.alive("decode", 11.0)] == ["d1"]
    assert reg.get("d1").free_pages == 4
    # d1 last seen at 10.4: dead after 3 * 0.5 s; p1 (1 s interval) lives until 13.0.
    assert reg.is_alive("d1", 11.9) and not reg.is_alive("d1", 11.95)
    assert reg.alive("decode", 12.0) == [] and len(reg.alive("prefill", 12.0)) == 1
    assert [b.worker_id for b in reg.reap(12.0)] == ["d1"]
    assert reg.reap(12.0) == []  # reported once
    assert reg.get("d1") is None and not reg.is_alive("d1", 12.0)
    assert reg.observe(beat("d1"), now=20.0)  # back under the same id: new again
    assert [b.worker_id for b in reg.reap(20.0)] == ["p1"]


def test_unknown_worker_is_not_alive():
    reg = WorkerRegistry()
    assert not reg.is_alive("nobody", 0.0)
    assert reg.alive("prefill", 0.0) == []
