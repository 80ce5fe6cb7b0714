"""Heartbeats for the scheduler's router tests."""

from shared.protocol import HeartbeatMsg

PAGE = 4  # tokens a page


def beat(worker_id, role="decode", **load):
    load.setdefault("page_size", PAGE)
    if role == "decode":
        load.setdefault("free_pages", 100)
        load.setdefault("total_pages", 100)
    return HeartbeatMsg(worker_id, role, "m", 4096, 0.5, **load)
