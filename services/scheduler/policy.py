"""Admission and routing policy of the scheduler. Pure: no NATS, no clock (time is passed in).

Admission: a request is refused outright when no prefill or no decode worker is alive, or when
no decode worker's whole KV pool could ever hold its prompt + max_tokens; otherwise it waits in
a bounded FIFO lane of its priority (admission.py; full → QUEUE_FULL, the gateway answers 429)
until a decode worker would accept it now: the page rule of shared/kv/pages.py (room for the
prompt and one token). Interactive requests go first; a batch one (SubmitMsg.priority) is
offered only while no interactive one waits, and fills idle capacity only: it is placed only
on a decode worker whose pages in use (heartbeat plus assigned since) stay at most
`batch_max_share` of its pool once it is placed (or that holds nothing: a prompt larger than
the share still runs on an idle worker), and only with a computing worker (prefill, or the
decode worker itself) that has fewer than `batch_prefill_tokens` prompt tokens queued, so
interactive prompts never queue behind many batch prompts.

Routing, among the decode workers with room and the live prefill workers: the session's pin
(affinity.py) if it holds, else by the mode (routing.py: the KV cost over what each worker's
prefix cache holds, the load, or round robin). Heartbeats are up to one interval old, so the
router adds what it assigned since each worker's last heartbeat to that heartbeat's load.

Conditional disaggregation: the chosen decode worker computes a prompt itself (real ones can,
fake ones not) when what it would compute (the prompt less the prefix its cache holds) plus
what it already has to compute is at most `local_prefill_tokens`, and either
- its batch is empty and it has fewer prompt tokens to compute than the prefill worker: a
  burst no longer waits on one prefill worker while the decode worker idles, or
- it holds a prefix of the prompt and finishes its part no later than the prefill worker would
  (that one's queue plus what it would compute): the next turn of a conversation extends the
  KV in place instead of being recomputed and sent again, unless the prefill side is faster.
The bound means that running streams wait for one short prompt at most.
"""

from dataclasses import dataclass, field

from services.scheduler import routing
from services.scheduler.affinity import Pin, SessionTable
from services.scheduler.kv_index import KVIndex
from services.scheduler.routing import PromptPages, RoutingConfig
from shared import protocol
from shared.kv.pages import fits, pages_for, pages_to_reserve
from shared.protocol import HeartbeatMsg, KVEventsMsg, SubmitMsg
from shared.registry import WorkerRegistry


def max_request_tokens(submit: SubmitMsg) -> int:
    """Tokens a request may occupy in the KV cache at its longest (the TOO_LONG check only)."""
    return len(submit.prompt_token_ids) + submit.sampling.max_tokens


@dataclass(frozen=True)
class Choice:
    """The workers picked for one request, and why."""

    prefill: HeartbeatMsg
    decode: HeartbeatMsg
    compute_tokens: int  # prompt tokens the computing worker computes (uncached there)
    local: bool = False  # the decode worker computes the prompt (see the module's docstring)
    decode_reason: str = routing.BY_LOAD  # routing.BY_*
    prefill_reason: str = routing.BY_LOAD
    decode_cached_tokens: int = 0  # of the prompt, cached on the decode worker (its index)
    prefill_cached_tokens: int = 0  # of the prompt, cached on the prefill worker

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
    """Worker registry, KV index, session pins and the load assigned since each heartbeat;
    picks workers per request."""

    registry: WorkerRegistry = field(default_factory=WorkerRegistry)
    config: RoutingConfig = field(default_factory=RoutingConfig)
    index: KVIndex = field(default_factory=KVIndex)
    _since: dict[str, _SinceBeat] = field(default_factory=dict)
    _last: dict[str, str] = field(default_factory=dict)  # role → last worker chosen (round robin)

    def __post_init__(self) -> None:
        self.sessions = SessionTable(self.config.max_sessions)

    def observe(self, beat: HeartbeatMsg, now: float) -> None:
        self.registry.observe(beat, now)
        self._since[beat.worker_id] = _SinceBeat()

    def observe_kv(self, events: KVEventsMsg) -> bool:
        """Apply a worker's KV events; False when its set is unknown: ask it for a snapshot."""
        return self.index.apply(events)

    def reap(self, now: float) -> list[HeartbeatMsg]:
        dead = self.registry.reap(now)
        for beat in dead:
            self._since.pop(beat.worker_id, None)
            self.index.forget(beat.worker_id)
        return dead

    def admission_status(self, submit: SubmitMsg, now: float) -> tuple[str, int]:
        """(status, limit) before queueing: ACCEPTED (may queue), NO_WORKERS or TOO_LONG."""
        decoders = self.registry.alive("decode", now)
        if not decoders or not self.registry.alive("prefill", now):
            return protocol.NO_WORKERS, 0
        limit = max(b.max_sequence_tokens or b.total_pages * b.page_size for b in decoders)
        if max_request_tokens(submit) > limit:
            return protocol.TOO_LONG, limit
        return protocol.ACCEPTED, limit

    def choose(self, submit: SubmitMsg, now: float) -> Choice | None:
        """Workers for the request now, or None when no decode worker has room at the moment
        (for a batch request: none within the batch caps, see the module's docstring)."""
        prompt_len = len(submit.prompt_token_ids)
        decoders, prefills = self._candidates(submit, now)
        if not decoders or not prefills:
            return None
        prompt = PromptPages(submit)
        pin = self.sessions.get(submit.session_id) if submit.session_id else None
        decode, decode_reason, decode_cached = self._pick(
            "decode", decoders, prompt, pin and pin.decode_worker
        )
        prefill, prefill_reason, prefill_cached = self._pick(
            "prefill", prefills, prompt, pin and pin.prefill_worker
        )
        mine, theirs = self._tokens(decode), self._tokens(prefill)
        uncached = prompt_len - decode_cached
        local = (
            decode.local_prefill
            and mine + uncached <= self.config.local_prefill_tokens
            and (submit.priority != protocol.BATCH or mine < self.config.batch_prefill_tokens)
            and (
                (decode.decoding_seqs == 0 and mine < theirs)
                or (decode_cached > 0 and mine + uncached <= theirs + prompt_len - prefill_cached)
            )
        )
        return Choice(
            prefill=prefill,
            decode=decode,
            compute_tokens=uncached if local else prompt_len - prefill_cached,
            local=local,
            decode_reason=decode_reason,
            prefill_reason=routing.BY_LOCAL_PREFILL if local else prefill_reason,
            decode_cached_tokens=decode_cached,
            prefill_cached_tokens=prefill_cached,
        )

    def _candidates(self, submit: SubmitMsg, now: float):
        """(decode workers with room, live prefill workers) in id order; for a batch request
        only those within the batch caps."""
        prompt_len = len(submit.prompt_token_ids)
        decoders = [b for b in self.registry.alive("decode", now) if self._fits(b, prompt_len)]
        prefills = self.registry.alive("prefill", now)
        if submit.priority == protocol.BATCH:
            decoders = [b for b in decoders if self._within_share(b, prompt_len)]
            prefills = [b for b in prefills if self._tokens(b) < self.config.batch_prefill_tokens]
        return decoders, prefills

    def _pick(self, role: str, beats: list[HeartbeatMsg], prompt: PromptPages, pinned):
        """(worker, reason, its cached prompt tokens) among `beats` (in id order)."""
        cached = {b.worker_id: 0 for b in beats}
        if self.config.mode == routing.KV and any(self.index.num_pages(w) for w in cached):
            for b in beats:
                overlap = self.index.overlap(b.worker_id, prompt.hashes(b.page_size))
                cached[b.worker_id] = prompt.cached_tokens(overlap, b.page_size)
        by_load = self._decode_load if role == "decode" else self._prefill_load
        chosen = next((b for b in beats if b.worker_id == pinned), None)
        if chosen is not None:
            reason = routing.BY_AFFINITY
        elif self.config.mode == routing.ROUND_ROBIN:
            chosen = routing.next_in_cycle(beats, self._last.get(role))
            reason = routing.BY_ROUND_ROBIN
        elif any(cached.values()):

            def cost(b: HeartbeatMsg):
                overlap = cached[b.worker_id] // b.page_size
                load_pages = self._load_pages(role, b)
                weight = self.config.kv_overlap_weight
                return (prompt.kv_cost(weight, overlap, b.page_size, load_pages), *by_load(b))

            chosen = min(beats, key=cost)
            reason = routing.BY_KV_OVERLAP if cached[chosen.worker_id] else routing.BY_LOAD
        else:
            chosen, reason = min(beats, key=by_load), routing.BY_LOAD
        return chosen, reason, cached[chosen.worker_id]

    def record(self, choice: Choice, submit: SubmitMsg) -> None:
        """Count an assignment against both workers until their next heartbeat; pin its
        session there; move the round-robin cursors."""
        decode = self._since.setdefault(choice.decode.worker_id, _SinceBeat())
        decode.seqs += 1
        decode.pages += _reserves(choice.decode, len(submit.prompt_token_ids))
        computes = self._since.setdefault(choice.prefill_worker, _SinceBeat())
        computes.tokens += choice.compute_tokens
        self._last["decode"] = choice.decode.worker_id
        self._last["prefill"] = choice.prefill.worker_id
        if submit.session_id:
            self.sessions.pin(
                submit.session_id, Pin(choice.prefill_worker, choice.decode.worker_id)
            )

    def refused(self, decode_worker: str) -> None:
        """The decode worker refused (or did not answer): skip it until it reports again."""
        self._since.setdefault(decode_worker, _SinceBeat()).refused = True

    def _fits(self, beat: HeartbeatMsg, num_prompt_tokens: int) -> bool:
        since = self._since.get(beat.worker_id, _SinceBeat())
        free, chunk, groups = self._free(beat), beat.chunk_tokens, beat.chunk_groups
        if beat.rank_free_pages:  # data-parallel ranks: the request's pages are one rank's
            free = min(free, beat.rank_free_pages)
        return not since.refused and fits(free, num_prompt_tokens, beat.page_size, chunk, groups)

    def _within_share(self, beat: HeartbeatMsg, num_prompt_tokens: int) -> bool:
        """A batch request may take pages here: the pages in use once it is placed are at most
        batch_max_share of the pool, or the worker holds none now."""
        in_use = beat.total_pages - self._free(beat)
        after = in_use + _reserves(beat, num_prompt_tokens)
        return in_use <= 0 or after <= self.config.batch_max_share * beat.total_pages

    def _decode_load(self, beat: HeartbeatMsg) -> tuple:
        return (self._seqs(beat), -self._free(beat), beat.worker_id)

    def _prefill_load(self, beat: HeartbeatMsg) -> tuple:
        return (self._tokens(beat), beat.running_seqs, beat.worker_id)

    def _load_pages(self, role: str, beat: HeartbeatMsg) -> int:
        """The kv cost's load: pages in use (decode), pages of prompt tokens queued (prefill)."""
        if role == "decode":
            return beat.total_pages - self._free(beat)
        return pages_for(self._tokens(beat), beat.page_size)

    def _free(self, beat: HeartbeatMsg) -> int:
        return beat.free_pages - self._since.get(beat.worker_id, _SinceBeat()).pages

    def _seqs(self, beat: HeartbeatMsg) -> int:
        return beat.running_seqs + self._since.get(beat.worker_id, _SinceBeat()).seqs

    def _tokens(self, beat: HeartbeatMsg) -> int:
        return beat.queued_tokens + self._since.get(beat.worker_id, _SinceBeat()).tokens


def _reserves(beat: HeartbeatMsg, num_prompt_tokens: int) -> int:
    """Pages the decode worker of `beat` reserves for a prompt (its capped window's too)."""
    return pages_to_reserve(num_prompt_tokens, beat.page_size, beat.chunk_tokens, beat.chunk_groups)
