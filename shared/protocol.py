"""The wire contract: every NATS payload as a frozen dataclass, msgpack-encoded here and only here.

Each body is a msgpack map carrying `v` (SCHEMA_VERSION) and `t` (the message's KIND) besides
its fields. `decode` checks both plus every field's type (shared/wire.py) and raises
ProtocolError otherwise, so a service can log and drop a bad message instead of crashing.
Unknown extra keys are ignored (a newer peer may add optional fields). Messages carry ids,
counts and page numbers, never tensors.
"""

import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import msgpack

from shared.errors import InvalidRequestError, ProtocolError
from shared.sampling.logprobs import TokenLogprob  # on the wire as is, like SamplingParams
from shared.sampling.params import SamplingParams
from shared.wire import from_plain, to_plain

SCHEMA_VERSION = 1
_log = logging.getLogger(__name__)

# Submit reply statuses (SubmitReplyMsg.status); the gateway maps them to HTTP codes.
ACCEPTED = "accepted"  # 200: the request runs on prefill_worker / decode_worker
QUEUE_FULL = "queue_full"  # 429 + Retry-After
NO_WORKERS = "no_workers"  # 503
TOO_LONG = "too_long"  # 400: no decode worker's KV pool can ever hold it
EXPIRED = "expired"  # 503: the deadline passed while queued
QUEUED = "queued"  # not an outcome: scheduler_id holds it; the outcome follows on the same inbox

# SubmitMsg.priority values: the scheduler's admission lane (services/scheduler/admission.py).
INTERACTIVE = "interactive"  # served first
BATCH = "batch"  # only idle capacity, capped (x-tison-priority: batch)
PRIORITIES = (INTERACTIVE, BATCH)

# TokenItem.finish_reason values.
FINISH_STOP = "stop"  # EOS or a stop token (or, decided by the gateway, a stop string)
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_ABORT = "abort"  # cancelled
FINISH_ERROR = "error"  # worker failure; TokenItem.error says why


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request (OpenAI `usage`)."""

    prompt_tokens: int  # decode worker sets; gateway reports it
    completion_tokens: int  # decode worker sets (tokens generated, first one included)


@dataclass(frozen=True)
class TokenItem:
    """Tokens of one request produced in one step (empty `token_ids` with a finish is allowed).
    Every item of a request comes from its decode worker, in output order (the prefill worker's
    first token too, see KvReadyMsg), so each starts where the previous one ended."""

    request_id: str  # decode worker sets from the assignment; gateway demultiplexes by it
    index: int  # decode sets: output index of token_ids[0]; gateway fails the request if unexpected
    token_ids: tuple[int, ...] = ()  # decode worker sets: new tokens in order
    logprobs: tuple[TokenLogprob, ...] = ()  # decode sets, one per token, if sampling.logprobs
    finish_reason: str | None = None  # decode worker sets on the last item (FINISH_*)
    error: str = ""  # worker sets with FINISH_ERROR; gateway shows it to the client
    usage: Usage | None = None  # decode worker sets on the last item
    # decode sets on the item of index 0 if sampling.prompt_logprobs: one per prompt token from
    # the second on (from KvReadyMsg, or its own engine's when it computed the prompt); the
    # gateway returns them as prompt_logprobs (and with echo)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class SubmitMsg:
    """Gateway → scheduler (request/reply on scheduler_submit): run this request."""

    KIND: ClassVar[str] = "submit"
    request_id: str  # gateway sets (unique); every process keys the request by it
    gateway_id: str  # gateway sets; workers publish tokens to gateway_tokens(gateway_id)
    prompt_token_ids: tuple[int, ...]  # gateway sets (tokenized, chat template applied)
    sampling: SamplingParams  # gateway sets from the OpenAI body; workers sample with it
    deadline: float  # gateway sets (unix time); scheduler drops it if still queued then
    session_id: str = ""  # gateway sets (x-session-affinity, else the body's session_id or
    # user); "" → none. The scheduler keeps a session on the workers it last used
    acknowledge: bool = False  # sender sets: a QUEUED reply first (SubmitReplyMsg.scheduler_id)
    priority: str = INTERACTIVE  # gateway sets (x-tison-priority); the scheduler's lane: a
    # BATCH request waits while an INTERACTIVE one does and fills idle capacity only

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:  # decode() turns this into a ProtocolError
            raise InvalidRequestError(
                "priority", f"must be one of {PRIORITIES}, got {self.priority[:40]!r}"
            )


@dataclass(frozen=True)
class SubmitReplyMsg:
    """Scheduler → gateway: the request runs (on which workers), or why not."""

    KIND: ClassVar[str] = "submit_reply"
    request_id: str  # scheduler copies from SubmitMsg
    status: str  # scheduler sets: QUEUED first, then ACCEPTED, QUEUE_FULL, NO_WORKERS, ...
    reason: str = ""  # scheduler sets when not accepted; gateway puts it in the error message
    retry_after_s: float = 0.0  # scheduler sets with QUEUE_FULL; gateway sends Retry-After
    limit: int = 0  # scheduler sets with TOO_LONG: the most tokens any decode worker can hold
    prefill_worker: str = ""  # scheduler sets with ACCEPTED; gateway watches its heartbeats
    decode_worker: str = ""  # scheduler sets with ACCEPTED; gateway watches its heartbeats
    scheduler_id: str = ""  # scheduler sets with QUEUED; gateway watches its beats


@dataclass(frozen=True)
class SchedulerBeatMsg:
    """Scheduler → gateways, every interval_s: a submit acknowledged by a scheduler that stops
    beating fails at once (it died holding the request)."""

    KIND: ClassVar[str] = "scheduler_beat"
    scheduler_id: str  # scheduler sets: unique per process
    interval_s: float  # scheduler sets: seconds between beats


@dataclass(frozen=True)
class CancelMsg:
    """Gateway → everyone (gateway_cancel): forget the request and free its pages."""

    KIND: ClassVar[str] = "cancel"
    request_id: str  # gateway sets; scheduler, prefill and decode workers read it
    reason: str = ""  # gateway sets (disconnect, stop string, worker died); logged only


@dataclass(frozen=True)
class KVRankPool:
    """One rank's part of a decode worker's KV pool."""

    layers: tuple[int, ...]  # [first, end) global layers it holds
    units: tuple[int, ...]  # [first, end) units of the layout it holds (MHA: KV heads)
    shm: str  # its pool file (same host); "" when it has none
    cuda_ipc: bytes = b""  # a GPU pool's CUDA IPC handle (transfer/cuda_ipc.py); b"" on CPU
    # capped chunked layers (shared/kv/chunk_cache.py): each of its layers' page group, in
    # layer order (0: the request's page_ids; k >= 1: its chunk_page_ids[k - 1]); its pool
    # then holds unit pages, a layer at its index among its group's; () when none is capped
    kv_groups: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVPool:
    """Where a prefill worker can write a decode worker's pages (shared/transfer/handoff.py)."""

    layout: str  # KVSpec.layout of the whole model's KV; the prefill worker's must equal it
    host: str  # transfer.base.host_id(): equal on the same boot of the same machine
    ranks: tuple[KVRankPool, ...]  # rank order
    tcp: str = ""  # "host:port" of its authenticated TCP KV server; "" when off
    dist: str = ""  # "host:port" of its torch.distributed KV server's store; "" when off


@dataclass(frozen=True)
class PrefixStats:
    """A worker's prefix-cache counters (LLMEngine.prefix_stats(); all 0 without a cache)."""

    queried_requests: int = 0  # cumulative: admissions that looked the cache up
    hit_requests: int = 0  # cumulative: those that found at least one page
    queried_tokens: int = 0  # cumulative: their prompt tokens
    hit_tokens: int = 0  # cumulative: the tokens found cached
    evicted_pages: int = 0  # cumulative: cached pages reused for other KV
    cached_pages: int = 0  # now: pages named in the cache (held or free)


@dataclass(frozen=True)
class GatewayBeatMsg:
    """Gateway → decode workers, every interval_s: requests of a gateway that stops beating are
    orphans (no client can read their tokens), cancelled and their pages freed."""

    KIND: ClassVar[str] = "gateway_beat"
    gateway_id: str  # gateway sets
    interval_s: float  # gateway sets: seconds between beats


@dataclass(frozen=True)
class HeartbeatMsg:
    """Worker → scheduler and gateways (heartbeat(role, id)), every `interval_s`."""

    KIND: ClassVar[str] = "heartbeat"
    worker_id: str  # worker sets (unique per process); scheduler routes by it
    role: str  # worker sets: "prefill" or "decode"
    model: str  # worker sets: served model name; gateway lists it
    max_model_len: int  # worker sets: context length; gateway rejects longer prompts
    interval_s: float  # worker sets: period; a registry counts missed beats with it
    queued_tokens: int = 0  # worker sets: prompt tokens waiting to be computed
    running_seqs: int = 0  # worker sets: requests it holds
    decoding_seqs: int = 0  # decode worker sets: requests in its batch (not waiting for KV)
    local_prefill: bool = False  # decode worker sets: it can compute a prompt itself
    free_pages: int = 0  # worker sets: KV pages free (decode); scheduler checks fit
    # worker sets: with data-parallel ranks, the most free pages of one rank's pool, all one
    # request can take; 0: free_pages
    rank_free_pages: int = 0
    total_pages: int = 0  # worker sets: KV pool size; gateway /metrics
    # worker sets: the tokens one sequence can hold in its pool (fewer than total_pages x
    # page_size where chunked layers are capped: their pages share the pool); 0: that product
    max_sequence_tokens: int = 0
    page_size: int = 16  # worker sets: tokens per KV page; scheduler sizes requests
    # decode worker sets where it caps chunked layers (shared/kv/chunk_cache.py): their chunk
    # and page groups, whose window pages a reservation takes too (pages.pages_to_reserve)
    chunk_tokens: int = 0
    chunk_groups: int = 0
    kv_transfer_bytes: int = 0  # worker sets: cumulative KV bytes sent/received; /metrics
    kv_transfer_seconds: float = 0.0  # worker sets: cumulative transfer time; /metrics
    prefix: PrefixStats = PrefixStats()  # worker sets from its engine; gateway /metrics
    dropped_messages: int = 0  # worker sets: NATS messages it dropped as malformed; /metrics


@dataclass(frozen=True)
class DecodeAssignMsg:
    """Scheduler → decode worker (request/reply on assign("decode", id)): reserve pages."""

    KIND: ClassVar[str] = "decode_assign"
    request_id: str  # scheduler copies from SubmitMsg
    gateway_id: str  # scheduler copies; decode publishes tokens there
    prefill_worker: str  # scheduler sets: who will write the pages
    prompt_token_ids: tuple[int, ...]  # scheduler copies; decode needs them for penalties
    sampling: SamplingParams  # scheduler copies; decode samples with it
    prefill_here: bool = False  # scheduler sets: the decode worker computes the prompt itself
    background: bool = False  # scheduler sets: a BATCH request (the engine's Request.background)


@dataclass(frozen=True)
class DecodeAssignReplyMsg:
    """Decode worker → scheduler: pages reserved for the request, or a refusal."""

    KIND: ClassVar[str] = "decode_assign_reply"
    request_id: str  # decode copies
    accepted: bool  # decode sets: False when its pool cannot hold the request now
    page_ids: tuple[int, ...] = ()  # decode sets: reserved pages; prefill writes KV there
    kv: KVPool | None = None  # decode sets when accepting: where to write
    reason: str = ""  # decode sets when refusing; scheduler logs it
    cached_tokens: int = 0  # decode sets: prompt tokens whose KV the pages hold already (its
    # prefix cache, whole pages); prefill writes only the tokens after them
    # decode sets where it caps chunked layers (KVRankPool.kv_groups): their reserved pages,
    # one list a page group, which hold logical pages chunk_first_page on (the prompt's last
    # chunk)
    chunk_page_ids: tuple[tuple[int, ...], ...] = ()
    chunk_first_page: int = 0


@dataclass(frozen=True)
class PrefillAssignMsg:
    """Scheduler → prefill worker (assign("prefill", id)): compute this prompt into D's pages."""

    KIND: ClassVar[str] = "prefill_assign"
    request_id: str  # scheduler copies from SubmitMsg
    gateway_id: str  # scheduler copies (the first token reaches it through the decode worker)
    prompt_token_ids: tuple[int, ...]  # scheduler copies
    sampling: SamplingParams  # scheduler copies; prefill samples the first token with it
    decode_worker: str  # scheduler sets; prefill sends KvReadyMsg to decode_kv(decode_worker)
    decode_kv: KVPool | None  # scheduler copies from DecodeAssignReplyMsg.kv
    page_ids: tuple[int, ...]  # scheduler copies from DecodeAssignReplyMsg.page_ids
    decode_cached_tokens: int = 0  # scheduler copies from DecodeAssignReplyMsg.cached_tokens
    decode_chunk_page_ids: tuple[tuple[int, ...], ...] = ()  # scheduler copies from the reply
    decode_chunk_first_page: int = 0  # ... chunk_page_ids and chunk_first_page
    background: bool = False  # scheduler sets: a BATCH request (the engine's Request.background)


@dataclass(frozen=True)
class KvReadyMsg:
    """Prefill → decode worker (decode_kv(id)): the pages are written, with the first token, or
    prefill failed. The first token travels only here: the decode worker publishes it to the
    gateway on receipt (not with its next step), then decodes from it."""

    KIND: ClassVar[str] = "kv_ready"
    request_id: str  # prefill copies
    prefill_worker: str  # prefill sets; logged
    ok: bool  # prefill sets: False on a transfer or compute error
    first_token_id: int = -1  # prefill sets when ok: the first token; decode sends it as index 0
    first_logprob: TokenLogprob | None = None  # prefill sets if logprobs were asked; goes with it
    error: str = ""  # prefill sets when not ok; decode forwards it to the gateway
    # prefill sets when ok if sampling.prompt_logprobs: one per prompt token from the second on
    # (all computed, its cached prefix and decode_cached_tokens' alike); decode relays them
    # in the index-0 TokenItem
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class TokensMsg:
    """Decode worker → gateway (gateway_tokens(id)): every token of that gateway's requests in a
    step; also, at once, first tokens that arrived in KvReadyMsg and prefill failures."""

    KIND: ClassVar[str] = "tokens"
    worker_id: str  # decode worker sets; logged
    items: tuple[TokenItem, ...]  # decode worker sets: one per request that advanced
    step_s: float = 0.0  # decode sets: the engine step that made these tokens; 0: made by none
    cycle_s: float = 0.0  # worker sets: its previous step's end to this one's (step + loop)
    sent_at: float = 0.0  # worker sets: its time.time() at publish (transit, on one host)


@dataclass(frozen=True)
class KVEventsMsg:
    """Worker → scheduler (kv_events(role, id)), once a heartbeat interval: how the set of page
    hashes its prefix cache names changed since its previous message (shared/kv/events.py).

    Messages of a worker id are numbered 0, 1, 2...; the scheduler applies them in order and on
    a gap (a lost message, or a scheduler that started after the worker) forgets the worker's
    pages and asks for a snapshot (KVSnapshotAskMsg). A snapshot is a message with `reset`, the
    whole set in `stored`, continued (when over MAX_HASHES_PER_MSG) by the next numbers."""

    KIND: ClassVar[str] = "kv_events"
    worker_id: str  # worker sets (its role's id); the scheduler's index is keyed by it
    role: str  # worker sets: "prefill" or "decode"; the scheduler asks kv_snapshot(role, id)
    seq: int  # worker sets: 0, 1, 2... per worker id; scheduler detects a lost message
    stored: tuple[int, ...] = ()  # worker sets: hashes newly named (block_hash.page_hashes)
    evicted: tuple[int, ...] = ()  # worker sets: hashes no longer named (disjoint from stored)
    reset: bool = False  # worker sets on a snapshot: drop what you hold of me, then apply


@dataclass(frozen=True)
class KVSnapshotAskMsg:
    """Scheduler → one worker (kv_snapshot(role, id)): send the whole set next time."""

    KIND: ClassVar[str] = "kv_snapshot_ask"
    worker_id: str  # scheduler sets; the worker checks it is its own
    reason: str = ""  # scheduler sets (gap at which seq); logged


@dataclass(frozen=True)
class WeightsAskMsg:
    """New worker → running workers (request/reply on weights_ask()): who serves this model's
    weights? Workers serving other models stay silent; the first offer wins."""

    KIND: ClassVar[str] = "weights_ask"
    model: str  # new worker sets: its served model name; a peer answers if it serves it


@dataclass(frozen=True)
class WeightsOfferMsg:
    """Running worker → the asking worker: its weights server (shared/peer/server.py)."""

    KIND: ClassVar[str] = "weights_offer"
    worker_id: str  # the peer sets; the new worker logs it
    model: str  # the peer copies (its served model name)
    endpoint: str  # the peer sets: host:port of its weights server (TISON_KV_SECRET auth)
    compressed: bool = False  # the peer sets: it sends compressed planes (else raw bytes)


Message = (
    SubmitMsg
    | SubmitReplyMsg
    | CancelMsg
    | HeartbeatMsg
    | DecodeAssignMsg
    | DecodeAssignReplyMsg
    | PrefillAssignMsg
    | KvReadyMsg
    | TokensMsg
    | KVEventsMsg
    | KVSnapshotAskMsg
    | WeightsAskMsg
    | WeightsOfferMsg
)
M = TypeVar("M")


def encode(msg: Message) -> bytes:
    """msgpack bytes of a message, tagged with SCHEMA_VERSION and its KIND."""
    body = to_plain(msg)
    body["v"] = SCHEMA_VERSION
    body["t"] = msg.KIND
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes, cls: type[M]) -> M:
    """The message of type `cls` in `data`; ProtocolError if it is anything else."""
    kind = cls.KIND  # type: ignore[attr-defined]
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(kind, f"not msgpack ({e})") from None
    if not isinstance(body, dict):
        raise ProtocolError(kind, f"body is a {type(body).__name__}, not a map")
    if body.get("v") != SCHEMA_VERSION:
        raise ProtocolError(kind, f"schema version {body.get('v')!r} != {SCHEMA_VERSION}")
    if body.get("t") != kind:
        raise ProtocolError(kind, f"kind is {body.get('t')!r}")
    return from_plain(cls, body, kind)


DROPPED: Counter[str] = Counter()  # this process's messages dropped as malformed, per kind
DROP_LOG_S = 10.0  # after a kind's first drop, one log line per this period at most
_drop_logged: dict[str, float] = {}


def dropped(kind: str, subject: str, error: ProtocolError) -> None:
    """Counts a malformed message; logs it unless a line for its kind was logged within
    DROP_LOG_S (a flood of garbage must not flood the log)."""
    DROPPED[kind] += 1
    now = time.monotonic()
    if now - _drop_logged.get(kind, -DROP_LOG_S) >= DROP_LOG_S:
        _drop_logged[kind] = now
        _log.warning("dropped %s on %s: %s (%d so far)", kind, subject, error, DROPPED[kind])


def on_message(cls: type[M]):
    """Decorates an async NATS callback method `handler(self, body: cls, msg)`: a message that
    does not decode as `cls` is dropped and counted (DROPPED), so garbage never crashes a
    service."""

    def wrap(handler):
        @functools.wraps(handler)
        async def callback(self, msg) -> None:
            try:
                body = decode(msg.data, cls)
            except ProtocolError as e:
                dropped(cls.KIND, msg.subject, e)
                return
            await handler(self, body, msg)

        return callback

    return wrap
