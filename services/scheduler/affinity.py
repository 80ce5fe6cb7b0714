"""Session affinity: the workers a session's last request ran on, in a bounded LRU table. Pure.

A session (SubmitMsg.session_id: the x-session-affinity header, else the body's session_id or
user) keeps its prefill and decode workers while they are alive and have room: its next turn
finds its KV where the last one left it, whatever the index knows yet. The router decides
when a pin holds (policy.py); this table only remembers, and forgets the least recently used
session beyond `max_sessions`.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class Pin:
    """Where a session's last request ran."""

    prefill_worker: str  # the worker that computed its prompt (its decode worker when local)
    decode_worker: str


@dataclass
class SessionTable:
    """session id → Pin, least recently used first."""

    max_sessions: int = DEFAULT_MAX_SESSIONS
    _pins: OrderedDict[str, Pin] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session_id: str) -> Pin | None:
        """The session's pin (and it becomes the most recently used); None if unknown."""
        pin = self._pins.get(session_id)
        if pin is not None:
            self._pins.move_to_end(session_id)
        return pin

    def pin(self, session_id: str, pin: Pin) -> None:
        """Remember where the session ran last; the oldest session goes when over the bound."""
        self._pins[session_id] = pin
        self._pins.move_to_end(session_id)
        if len(self._pins) > self.max_sessions:
            self._pins.popitem(last=False)
