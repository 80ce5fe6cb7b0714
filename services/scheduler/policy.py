"""Admission and routing policy of the scheduler. Pure: no NATS, no clock (time is passed in).

Admission: a request is refused outright when no prefill or no decode worker is alive, or when
no decode worker's whole KV pool could ever hold its prompt + max_tokens; otherwise it waits in
a bounded FIFO queue (full → QUEUE_FULL, the gateway answers 429) until a decode worker would
accept it now: the page rule of shared/kv/pages.py (room for the prompt and one token).

Routing: decode = fewest running sequences among those with room (ties: most free pages);
prefill = fewest queued prompt tokens. Heartbeats are up to one interval old, so the router adds
what it assigned since each worker's last heartbeat to that heartbeat's load.

Conditional prefill: the chosen decode worker computes a prompt itself (real ones can, fake
ones not) when its batch is empty, it has fewer prompt tokens to compute than the prefill
worker, and at most LOCAL_PREFILL_TOKENS with this one: a burst no longer waits on one
prefill worker while the decode worker idles, and the streams that the prefill worker starts
meanwhile wait for one short prompt at most.
"""

from collections import deque
from dataclasses import dataclass, field

from shared import protocol
from shared.kv.pages import fits, pages_to_admit
from shared.protocol import HeartbeatMsg, SubmitMsg
from shared.registry import WorkerRegistry

LOCAL_PREFILL_TOKENS = 256


def max_request_tokens(submit: SubmitMsg) -> int:
    """Tokens a request may occupy in the KV cache at its longest (the TOO_LONG check only)."""
    return len(submit.prompt_token_ids) + submit.sampling.max_tokens


@dataclass(frozen=True)
class Choice:
    """The workers picked for one request."""

    prefill: HeartbeatMsg
    decode: HeartbeatMsg
    local: bool = False  # the decode worker computes the prompt (see the module's docstring)

    @property
    def prefill_worker(self) -> str:
        return self.decode.worker_id if self.local else self.prefill.worker_id


@dataclass
class _SinceBeat:
    """What the router assigned to one worker since its last heartbeat."""

    seqs: int = 0
    pages: int = 0
    tokens: int = 0  # prompt tokens to compute (a prefill worker's, or a decode worker's own)
    refused: bool = False  # the worker refused a reservation: skip it until it reports again


@dataclass
class Router:
    """Worker registry plus the load assigned since each heartbeat; picks workers per request."""

    registry: WorkerRegistry = field(default_factory=WorkerRegistry)
    _since: dict[str, _SinceBeat] = field(default_factory=dict)

    def observe(self, beat: HeartbeatMsg, now: float) -> None:
        self.registry.observe(beat, now)
        self._since[beat.worker_id] = _SinceBeat()

    def reap(self, now: float) -> list[HeartbeatMsg]:
        dead = self.registry.reap(now)
        for beat in dead:
            self._since.pop(beat.worker_id, None)
        return dead

    def admission_status(self, submit: SubmitMsg, now: float) -> tuple[str, int]:
        """(status, limit) before queueing: ACCEPTED (may queue), NO_WORKERS or TOO_LONG."""
        decoders = self.registry.alive("decode", now)
        if not decoders or not self.registry.alive("prefill", now):
            return protocol.NO_WORKERS, 0
        limit = max(b.total_pages * b.page_size for b in decoders)
        if max_request_tokens(submit) > limit:
            return protocol.TOO_LONG, limit
        return protocol.ACCEPTED, limit

    def choose(self, submit: SubmitMsg, now: float) -> Choice | None:
        """Workers for the request now, or None when no decode worker has room at the moment."""
        prompt_len = len(submit.prompt_token_ids)
        decoders = [b for b in self.registry.alive("decode", now) if self._fits(b, prompt_len)]
        prefills = self.registry.alive("prefill", now)
        if not decoders or not prefills:
            return None
        decode = min(decoders, key=lambda b: (self._seqs(b), -self._free(b), b.worker_id))
        prefill = min(prefills, key=lambda b: (self._tokens(b), b.running_seqs, b.worker_id))
        mine = self._tokens(decode)
        local = (
            decode.local_prefill
            and decode.decoding_seqs == 0
            and mine + prompt_len <= LOCAL_PREFILL_TOKENS
            and mine < self._tokens(prefill)
        )
        return Choice(prefill=prefill, decode=decode, local=local)

    def record(self, choice: Choice, submit: SubmitMsg) -> None:
        """Count an assignment against both workers until their next heartbeat."""
        decode = self._since.setdefault(choice.decode.worker_id, _SinceBeat())
        decode.seqs += 1
        decode.pages += pages_to_admit(len(submit.prompt_token_ids), choice.decode.page_size)
        computes = self._since.setdefault(choice.prefill_worker, _SinceBeat())
        computes.tokens += len(submit.prompt_token_ids)

    def refused(self, decode_worker: str) -> None:
        """The decode worker refused (or did not answer): skip it until it reports again."""
        self._since.setdefault(decode_worker, _SinceBeat()).refused = True

    def _fits(self, beat: HeartbeatMsg, num_prompt_tokens: int) -> bool:
        since = self._since.get(beat.worker_id, _SinceBeat())
        return not since.refused and fits(self._free(beat), num_prompt_tokens, beat.page_size)

    def _free(self, beat: HeartbeatMsg) -> int:
        return beat.free_pages - self._since.get(beat.worker_id, _SinceBeat()).pages

    def _seqs(self, beat: HeartbeatMsg) -> int:
        return beat.running_seqs + self._since.get(beat.worker_id, _SinceBeat()).seqs

    def _tokens(self, beat: HeartbeatMsg) -> int:
        return beat.queued_tokens + self._since.get(beat.worker_id, _SinceBeat()).tokens


@dataclass(frozen=True)
class Pending:
    """A queued request and where to send the scheduler's reply."""

    submit: SubmitMsg
    reply_to: str


@dataclass
class AdmissionQueue:
    """Bounded FIFO of requests admitted but not yet placed on workers."""

    max_waiting: int
    _queue: deque[Pending] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, pending: Pending) -> bool:
        """Queue the request; False when the queue is full (the gateway answers 429)."""
        if len(self._queue) >= self.max_waiting:
            return False
        self._queue.append(pending)
        return True

    def push_front(self, pending: Pending) -> None:
        """Put back a request that could not be placed, keeping its turn (may exceed the bound)."""
        self._queue.appendleft(pending)

    def head(self) -> Pending | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Pending:
        return self._queue.popleft()

    def remove(self, request_id: str) -> bool:
        """Drop a cancelled request; True if it was queued."""
        for pending in self._queue:
            if pending.submit.request_id == request_id:
                self._queue.remove(pending)
                return True
        return False

    def take_expired(self, now: float) -> list[Pending]:
        """Remove and return the requests whose deadline has passed."""
        expired = [p for p in self._queue if p.submit.deadline <= now]
        for pending in expired:
            self._queue.remove(pending)
        return expired

    def take_all(self) -> list[Pending]:
        """Remove and return every queued request (e.g. when no worker is left)."""
        taken = list(self._queue)
        self._queue.clear()
        return taken
