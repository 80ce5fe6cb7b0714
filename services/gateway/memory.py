"""Hands the gateway's freed heap back to the system after large requests. Parsing and
tokenizing a body near the limit allocates some hundred MB in the worker threads (Python's
objects, the tokenizer's encodings); glibc keeps what they free in per-thread arenas, so the
gateway's RSS would stay near its peak (bursts of 8 concurrent 1 MiB chat bodies: 63 MB idle,
1367 MB held after; trimmed, 115 MB: loadtest/scenarios/gateway_memory.py).
malloc_trim(0) returns the free pages of every arena: it runs, in a thread, when the last
large request in flight ends (a burst trims once). Elsewhere than glibc it does nothing."""

import asyncio
import ctypes
import ctypes.util
from contextlib import asynccontextmanager

LARGE_BODY_BYTES = 256 << 10  # requests at least this large trim the heap when they end


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS)


class HeapTrimmer:
    def __init__(self):
        self._trim = _malloc_trim()
        self.in_flight = 0  # large requests not ended yet
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    @asynccontextmanager
    async def request(self, body_bytes: int):
        """Around one request of body_bytes."""
        large = self._trim is not None and body_bytes >= LARGE_BODY_BYTES
        self.in_flight += large
        try:
            yield
        finally:
            self.in_flight -= large
            if large and not self.in_flight:
                self.trims += 1
                await asyncio.to_thread(self._trim, 0)
