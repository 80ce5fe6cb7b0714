"""LLMEngine: requests in, tokens out, one step at a time (continuous batching)."""

import contextlib
import dataclasses
import itertools
import logging
import random
import threading
from dataclasses import dataclass, field

from shared.engine.config import EngineConfig
from shared.engine.data_parallel import make_schedulers
from shared.engine.executor import StepResult, start_executor
from shared.engine.grammars import Grammars
from shared.engine.micro_batch import schedule_micro_batch, split_launched
from shared.engine.pool_size import capped_chunk_of, pool_pages, sequence_pages
from shared.engine.prompt_logprobs import merge
from shared.engine.request import FinishReason, Request, check_stop
from shared.engine.shard import (
    model_kv_groups,
    model_kv_spec,
    rank_kv_spec,
)
from shared.errors import InvalidRequestError, PromptTooLongError
from shared.kv.prefix_cache import PrefixStats
from shared.models.config import ModelConfig, generation_eos_ids
from shared.sampling.batch import request_stop_token_ids
from shared.sampling.logprobs import TokenLogprob
from shared.sampling.params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step did for one request: the tokens it sampled, or (a chunk of a prompt that
    asked for prompt logprobs) none but the prompt logprobs it computed."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]  # one per new token if the request asked for logprobs
    # if params.prompt_logprobs: those this step computed (chunked prefill: chunk by chunk),
    # the next of request.prompt_logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.request.finished


@dataclass(frozen=True)
class Reservation:
    """The pages a decode engine holds for a prompt that a prefill worker computes (`reserve`):
    the prefill worker writes the prompt's KV there, but for the first `cached_tokens` tokens
    (the decode engine's cached prefix). With capped chunked layers, theirs go to
    chunk_page_ids (one list a page group), which hold logical pages chunk_first_page on: the
    prompt's last chunk. With data-parallel ranks, all are in rank dp_rank's pool."""

    page_ids: tuple[int, ...]
    cached_tokens: int
    chunk_page_ids: tuple[tuple[int, ...], ...] = ()
    chunk_first_page: int = 0
    dp_rank: int = 0  # --dp: the rank whose pool the pages are in


class LLMEngine:
    def __init__(self, config: EngineConfig, extra_eos_ids: frozenset[int] = frozenset()):
        self.config = config
        self.model_config = cfg = ModelConfig.from_dir(config.model_dir)
        self.dtype = config.torch_dtype(cfg.torch_dtype)
        shape = config.parallel
        shape.validate(cfg.num_heads, cfg.num_kv_heads, cfg.num_layers)  # before any process
        self.kv_spec = model_kv_spec(cfg, config.page_size, self.dtype)  # the whole model's
        # rank 0's pool sizes every rank's: page ids are the same everywhere
        rank0 = rank_kv_spec(self.kv_spec, shape, 0)
        self.chunk = capped_chunk_of(config, cfg)
        # capped chunked layers: R page groups, each layer's group (shared/kv/chunk_cache.py)
        self.chunk_groups, self.kv_groups = 0, ()
        if self.chunk is not None:
            self.chunk_groups, self.kv_groups = model_kv_groups(cfg, shape)
        num_pages = pool_pages(config, cfg, rank0, self.chunk is not None)
        # Held by `step` except while the model computes (`_computing`): a command that only
        # adds (a reservation) may take it then, see EngineLoop.call_now.
        self.lock = threading.Lock()
        self.executor = start_executor(config, cfg, self.kv_spec, num_pages, self.kv_groups)
        self.runner = self.executor.runner  # rank 0's part of the model
        self.model, self.kv = self.runner.model, self.runner.kv
        self.handoff = self.executor.handoff  # prefill workers: writes KV to decode workers
        self.scheduler, self.allocator = make_schedulers(
            config, num_pages, self.chunk_groups, self.chunk
        )
        # the allocator hands out the pages itself where it is the prefix cache
        self.prefix_cache = self.allocator if config.enable_prefix_caching else None
        self._in_flight: set[Request] = set()  # requests whose sampled token is on its way
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        # the longest sequence the pool holds (capped: beside its chunked layers' pages)
        self.pool_tokens = sequence_pages(config, num_pages, self.chunk_groups, self.chunk) * (
            config.page_size
        )
        if not self.pool_tokens:
            raise InvalidRequestError("num_pages", f"{num_pages} KV pages hold no sequence")
        self.eos_token_ids = generation_eos_ids(config.model_dir) | extra_eos_ids
        self.requests: dict[str, Request] = {}
        self.grammars = Grammars(config.model_dir, cfg.vocab_size, self.eos_token_ids)
        self._seeds = random.Random(config.seed)
        self._arrivals = itertools.count()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
        background: bool = False,
    ) -> Request:
        """Queues a request; raises (naming the field or limit) if it can never run.
        prefill_only: compute the prompt and sample the first token, then finish (prefill worker).
        background: a batch request (Request.background).
        """
        req = self._new_request(request_id, prompt_token_ids, params)
        req.prefill_only, req.background = prefill_only, background
        self.grammars.add(req)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        background: bool = False,
    ) -> Reservation | None:
        """Decode side of a handoff: holds pages for the prompt's KV, which a prefill worker
        writes; None when the pools cannot hold it now. background: a batch request
        (Request.background), should it compute its prompt here (start_local)."""
        req = self._new_request(request_id, prompt_token_ids, params)
        req.background = background
        self.grammars.add(req)  # before the pages: it raises on a grammar it cannot compile
        if not self.scheduler.reserve(req):
            self.grammars.drop(request_id)
            return None
        self.requests[request_id] = req
        return _reservation(req)

    def reservation(self, request_id: str) -> Reservation | None:
        """What `reserve` returned for a request whose KV has not arrived yet; None otherwise."""
        req = self.scheduler.reserved.get(request_id)
        return None if req is None else _reservation(req)

    def dp_rank(self, request_id: str) -> int:
        """The data-parallel rank whose pool holds a request's pages (0 if it is gone)."""
        req = self.requests.get(request_id)
        return 0 if req is None else req.dp_rank

    def reserved_pages(self, request_id: str, layer: int) -> list[int] | None:
        """Pages a prefill worker may write for global layer `layer` of a reserved request
        whose KV has not arrived yet (not those of its cached prefix: other requests read
        them; a capped chunked layer's: its group's); None otherwise."""
        req = self.scheduler.reserved.get(request_id)
        if req is None:
            return None
        if self.kv_groups and not 0 <= layer < len(self.kv_groups):
            return None
        group = self.kv_groups[layer] if self.kv_groups else 0
        if group:  # from logical page chunk_first_page on
            cached = max(0, req.num_cached_pages - req.chunk_first_page)
            return req.chunk_page_ids[group - 1][cached:] if req.chunk_page_ids else []
        return req.page_ids[req.num_cached_pages :]

    def handoff_bytes(self, request_id: str) -> int:
        """KV bytes a prefill worker writes for a reserved request: every layer's of the tokens
        after its cached prefix, the capped chunked layers' from their first page on too."""
        req = self.requests.get(request_id)
        if req is None:
            return 0
        spec, new = self.kv_spec, req.num_prompt_tokens - req.num_computed_tokens
        first = max(req.chunk_first_page * spec.page_size, req.num_computed_tokens)
        window = max(0, req.num_prompt_tokens - first)
        groups = self.kv_groups or (0,) * spec.num_layers
        return sum(
            (window if groups[i] else new) * spec.layer_token_bytes(i)
            for i in range(spec.num_layers)
        )

    def start_remote(
        self,
        request_id: str,
        first_token: int,
        logprob: TokenLogprob | None,
        prompt_logprobs: tuple[TokenLogprob, ...] = (),
    ):
        """The prompt KV of a reserved request arrived with its first token (and the prompt
        logprobs, if it asked: a recompute after preemption then scores none again): decode
        from here. Returns the request (finished at once if that token ends it), None if it
        is gone. Its grammar, if any, consumes the token first (the prefill worker sampled it
        masked)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_token_ids.append(first_token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        req.prompt_logprobs = list(prompt_logprobs)
        self.scheduler.activate(req, computed=True)
        reason = self.grammars.advance(req, first_token) or check_stop(req)
        if reason is not None:
            self.finish(request_id, reason)
        return req

    def start_local(self, request_id: str) -> bool:
        """Colocated: compute a reserved request's prompt here (its pages are already held)."""
        req = self.requests.get(request_id)
        if req is not None:
            self.scheduler.activate(req, computed=False)
        return req is not None

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        self._validate_prompt(prompt_token_ids)
        self._validate_bias(params)
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=params.seed if params.seed is not None else self._seeds.getrandbits(63),
            stop_token_ids=request_stop_token_ids(params, self.eos_token_ids),
            max_total_tokens=min(self.max_model_len, self.pool_tokens),
            arrival=next(self._arrivals),
        )

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        # room for the prompt and at least one generated token
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                len(ids), self.max_model_len - 1, "model's context length (max_model_len - 1)"
            )
        if len(ids) >= self.pool_tokens:
            raise PromptTooLongError(len(ids), self.pool_tokens - 1, "KV cache pool capacity")

    def _validate_bias(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise InvalidRequestError(
                "logit_bias", f"token id {outside[0]} is outside the vocabulary [0, {vocab})"
            )

    def abort(self, request_id: str) -> bool:
        """Stops a request at once and frees its pages. False if it is unknown or already done."""
        req = self._forget(request_id)
        return req is not None and self.scheduler.abort(request_id) is not None

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """Ends a request for a reason decided outside the engine (a stop string matched)."""
        req = self._forget(request_id)
        if req is not None:
            self.scheduler.finish(req, reason)

    def _forget(self, request_id: str) -> Request | None:
        """Drops a request that is ending from the engine's tables (its matcher included)."""
        self.grammars.drop(request_id)
        return self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        """Requests to run, or micro-batches whose results are still to be collected."""
        return self.scheduler.has_work() or self.executor.num_in_flight > 0

    @property
    def num_pages_used(self) -> int:
        return self.allocator.num_used

    def load(self) -> dict[str, int]:
        """What a worker's heartbeat reports (HeartbeatMsg's fields of the same names)."""
        sched, pools = self.scheduler, getattr(self.allocator, "pools", ())
        queued = sum(
            r.num_prompt_tokens - min(r.num_computed_tokens, r.num_prompt_tokens)
            for r in list(sched.waiting)
        )
        return dict(
            queued_tokens=queued,
            running_seqs=len(sched.running) + len(sched.reserved),
            decoding_seqs=len(sched.running),
            free_pages=self.allocator.num_free,
            rank_free_pages=max((p.num_free for p in pools), default=0),  # --dp
            total_pages=self.allocator.num_pages,
            max_sequence_tokens=self.pool_tokens,
            chunk_tokens=self.chunk or 0,
            chunk_groups=self.chunk_groups,
        )

    def kv_events(self) -> tuple[list[int], list[int]]:
        """(hashes of the pages cached, of those evicted) since the previous call: what a
        worker tells the router (shared/kv/block_hash.py names them); empty without a cache."""
        if self.prefix_cache is None:
            return [], []
        return self.prefix_cache.drain_events()

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters (PrefixStats; all 0 without a cache)."""
        stats = self.prefix_cache.stats if self.prefix_cache is not None else PrefixStats()
        return dataclasses.asdict(stats)

    def step(self) -> list[StepOutput]:
        """Launches micro-batches until `depth` are in flight, then applies the oldest one's
        results. Without pipeline stages: schedule, run, update, as one step."""
        with self.lock:
            while self.executor.num_in_flight < self.executor.depth:
                out = schedule_micro_batch(self.scheduler, self._in_flight, self.executor.depth)
                if not out.scheduled:
                    break
                self._launch(out)
            if not self.executor.num_in_flight:
                return []
            with self._computing():
                result = self.executor.collect()
            return self._apply(result)

    def _launch(self, out) -> None:
        masks = self.grammars.masks([s.request for s in out.scheduled if s.samples])
        with self._computing():
            self.executor.launch(out, masks)
        self.allocator.mark_launched()
        early, _ = split_launched(out)
        self.scheduler.update(early, {})  # chunks that sample nothing count as computed now
        self._in_flight.update(s.request for s in out.scheduled if s.samples)

    @contextlib.contextmanager
    def _computing(self):
        """The lock let go while the model computes. Whoever takes it meanwhile must leave the
        launched requests and every page alone but free ones: pages freed now would skip their
        quarantine, which counts this micro-batch only once it is marked launched."""
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def _apply(self, result: StepResult) -> list[StepOutput]:
        self.allocator.mark_collected()
        _, out = split_launched(result.out)
        self._in_flight.difference_update(s.request for s in out.scheduled)
        if result.error is not None:
            failed = [s.request for s in result.out.scheduled]
            for req in failed:
                self.finish(req.request_id, FinishReason.ERROR)
            return [StepOutput(req, [], []) for req in failed]
        samples, sampled, logprobs = result.samples, {}, {}
        if samples is not None:
            tokens = samples.token_list()
            for row, i in enumerate(result.sample_index):
                req = result.out.scheduled[i].request
                if req.finished:  # aborted while its micro-batch was in flight
                    continue
                sampled[req] = tokens[row]
                if req.params.logprobs is not None:
                    logprobs[req] = _logprobs(samples, row, tokens[row], req.params.logprobs)
        prompt = _merge_prompt_logprobs(result)
        verdicts = self._advance_grammars(sampled)
        self.scheduler.update(out, sampled)
        results = []
        for req, token in sampled.items():
            if req in verdicts:
                self._end_by_grammar(req, verdicts[req])
            if req in logprobs:
                req.output_logprobs.append(logprobs[req])
            new_logprobs = [logprobs[req]] if req in logprobs else []
            results.append(StepOutput(req, [token], new_logprobs, prompt.pop(req, [])))
            if req.finished:
                self._forget(req.request_id)
        results += [StepOutput(req, [], [], values) for req, values in prompt.items()]
        return results

    def _advance_grammars(self, sampled: dict[Request, int]) -> dict[Request, FinishReason]:
        """The sampled tokens fed to their matchers: the requests whose grammar ends them.
        A prefill worker's matcher is left alone: the decode worker's consumes the token."""
        verdicts = {}
        for req, token in sampled.items():
            verdict = None if req.prefill_only else self.grammars.advance(req, token)
            if verdict is not None:
                verdicts[req] = verdict
        return verdicts

    def _end_by_grammar(self, req: Request, reason: FinishReason) -> None:
        """The grammar's verdict stands over a length cap the same token reached: the output
        is complete (STOP) or broken (ERROR) either way."""
        if not req.finished:
            self.scheduler.finish(req, reason)
        elif req.finish_reason == FinishReason.LENGTH:
            req.finish_reason = reason

    def close(self) -> None:
        """Stops the other ranks and releases the KV pool (unlinks its shm file)."""
        self.grammars.close()
        self.executor.close()


def _merge_prompt_logprobs(result: StepResult) -> dict[Request, list[TokenLogprob]]:
    """Adds the step's prompt logprobs to their requests; returns those new to each."""
    added = {}
    for chunk in result.prompt_logprobs:
        req = result.out.scheduled[chunk.index].request
        if not req.finished:  # else aborted while its micro-batch was in flight
            new = merge(req.prompt_logprobs, chunk)
            if new:
                added[req] = new
    return added


def _logprobs(samples, row: int, token_id: int, n: int) -> TokenLogprob:
    """Row `row` of the sampler's results as the logprobs of `token_id` and its top `n`."""
    ids: tuple[int, ...] = ()
    values: tuple[float, ...] = ()
    if n:
        ids = tuple(samples.top_logprob_ids[row, :n].tolist())
        values = tuple(samples.top_logprobs[row, :n].tolist())
    return TokenLogprob(token_id, float(samples.logprobs[row]), ids, values)


def _reservation(req: Request) -> Reservation:
    return Reservation(
        tuple(req.page_ids),
        req.num_computed_tokens,
        tuple(map(tuple, req.chunk_page_ids)),
        req.chunk_first_page,
        req.dp_rank,
    )
