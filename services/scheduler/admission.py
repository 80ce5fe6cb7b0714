"""The scheduler's admission queue: requests admitted but not yet placed on workers, in one FIFO
lane per SubmitMsg.priority. Pure: no NATS, no clock (time is passed in).

Interactive requests go first: `head()` and `pop()` offer a batch request only while no
interactive one waits, so a batch request that cannot be placed (policy.Router's batch caps)
never holds up an interactive one, whenever that arrives. Each lane has its own bound: the
interactive lane `max_waiting` requests and `max_waiting_tokens` prompt tokens, the batch lane
`max_waiting_batch` requests; a full lane refuses submits of its priority only (QUEUE_FULL, the
gateway answers 429).
"""

from collections import deque
from dataclasses import dataclass, field

from shared.protocol import BATCH, INTERACTIVE, SubmitMsg

DEFAULT_MAX_WAITING_BATCH = 4096


@dataclass(frozen=True)
class Pending:
    """A queued request and where to send the scheduler's reply."""

    submit: SubmitMsg
    reply_to: str


def _prompt_tokens(pending: Pending) -> int:
    return len(pending.submit.prompt_token_ids)


@dataclass
class Lane:
    """Bounded FIFO of one priority: at most `max_waiting` requests and `max_waiting_tokens`
    prompt tokens (0: no token bound), so a burst of long prompts is refused early (429,
    Retry-After) rather than left to expire in the queue."""

    max_waiting: int
    max_waiting_tokens: int = 0
    _queue: deque[Pending] = field(default_factory=deque)
    tokens: int = 0  # prompt tokens queued in this lane

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, pending: Pending) -> bool:
        """Queue the request; False when the lane is full."""
        over = self.max_waiting_tokens and self.tokens + _prompt_tokens(pending) > (
            self.max_waiting_tokens
        )
        if len(self._queue) >= self.max_waiting or (over and self._queue):
            return False  # one request alone may exceed the token bound: it waits alone
        self._queue.append(pending)
        self.tokens += _prompt_tokens(pending)
        return True

    def push_front(self, pending: Pending) -> None:
        """Put back a request that could not be placed, keeping its turn (may exceed the bound)."""
        self._queue.appendleft(pending)
        self.tokens += _prompt_tokens(pending)

    def head(self) -> Pending | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Pending:
        pending = self._queue.popleft()
        self.tokens -= _prompt_tokens(pending)
        return pending

    def remove(self, request_id: str) -> bool:
        """Drop a cancelled request; True if it was queued here."""
        for pending in self._queue:
            if pending.submit.request_id == request_id:
                self._drop(pending)
                return True
        return False

    def take_expired(self, now: float) -> list[Pending]:
        """Remove and return the requests whose deadline has passed."""
        expired = [p for p in self._queue if p.submit.deadline <= now]
        for pending in expired:
            self._drop(pending)
        return expired

    def take_all(self) -> list[Pending]:
        taken = list(self._queue)
        self._queue.clear()
        self.tokens = 0
        return taken

    def _drop(self, pending: Pending) -> None:
        self._queue.remove(pending)
        self.tokens -= _prompt_tokens(pending)


@dataclass
class AdmissionQueue:
    """The interactive and the batch lane (see the module's docstring). `len()` and `tokens`
    count both lanes; `lane(priority)` has one lane's."""

    max_waiting: int  # interactive lane: requests
    max_waiting_tokens: int = 0  # interactive lane: prompt tokens (0: no bound)
    max_waiting_batch: int = DEFAULT_MAX_WAITING_BATCH  # batch lane: requests (no token bound)

    def __post_init__(self) -> None:
        # priority → its lane, in the order they are served
        self._lanes = {
            INTERACTIVE: Lane(self.max_waiting, self.max_waiting_tokens),
            BATCH: Lane(self.max_waiting_batch),
        }

    def __len__(self) -> int:
        return sum(map(len, self._lanes.values()))

    @property
    def tokens(self) -> int:
        """Prompt tokens queued in both lanes."""
        return sum(lane.tokens for lane in self._lanes.values())

    def lane(self, priority: str) -> Lane:
        return self._lanes[priority]

    def waiting_ahead(self, priority: str) -> int:
        """Requests that a new one of `priority` would wait behind: the interactive ones for an
        interactive request, all of them for a batch one."""
        return len(self._lanes[INTERACTIVE]) if priority == INTERACTIVE else len(self)

    def push(self, pending: Pending) -> bool:
        """Queue the request in its lane; False when that lane is full (the gateway answers 429)."""
        return self._lanes[pending.submit.priority].push(pending)

    def push_front(self, pending: Pending) -> None:
        """Put back a request that could not be placed, keeping its turn in its lane."""
        self._lanes[pending.submit.priority].push_front(pending)

    def head(self) -> Pending | None:
        """The next request to place: the interactive lane's, else the batch lane's."""
        return next((lane.head() for lane in self._lanes.values() if len(lane)), None)

    def pop(self) -> Pending:
        """Remove and return `head()`."""
        return next(lane for lane in self._lanes.values() if len(lane)).pop()

    def remove(self, request_id: str) -> bool:
        """Drop a cancelled request; True if it was queued."""
        return any(lane.remove(request_id) for lane in self._lanes.values())

    def take_expired(self, now: float) -> list[Pending]:
        """Remove and return the requests of both lanes whose deadline has passed."""
        return [p for lane in self._lanes.values() for p in lane.take_expired(now)]

    def take_all(self) -> list[Pending]:
        """Remove and return every queued request (e.g. when no worker is left)."""
        return [p for lane in self._lanes.values() for p in lane.take_all()]
