"""Continuous-batching scheduler: pure policy over counters and the page allocator.

Each step is a mixed batch under a token budget: running requests that decode first (a token
each), then running requests still prefilling (oldest first), each getting the tokens it has not
computed yet, capped by what is left of the budget (chunked prefill); when pages run out the
newest running request is preempted (pages freed, recomputed later). Then waiting requests are
admitted while the budget, the sequence limit and the free pages allow. Pages follow the rule of
shared/kv/pages.py: a request gets its admission pages at once, then one page at a time as it
decodes. Background (batch) requests are admitted after every other waiting request, and their
prompts take at most max_background_tokens of a step: a request arriving while they prefill
waits for a short step only. With a prefix cache (shared/kv/prefix_cache.py) a request starts on
the cached pages of its longest cached prefix and computes the rest; its pages are named as
their KV is computed."""

from collections import deque
from dataclasses import dataclass, field

from shared.engine.request import FinishReason, Request, check_stop
from shared.kv.allocator import PageAllocator
from shared.kv.block_hash import group_hash, page_hashes
from shared.kv.pages import chunk_window, pages_for, pages_to_admit, pages_to_grow
from shared.kv.prefix_cache import PrefixCache


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step
    num_tokens: int  # tokens computed this step
    samples: bool  # this step computes the request's last pending token, so it samples one

    @classmethod
    def of(cls, req: Request, num_tokens: int) -> "ScheduledRequest":
        start = req.num_computed_tokens
        return cls(req, start, num_tokens, start + num_tokens == req.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def _decodes_first(req: Request) -> tuple[bool, float]:
    """Running requests that decode (one token pending) before those still prefilling, each
    group oldest first: a long prompt takes what the decode rows leave of the budget, so
    running streams never wait more than one chunk (Sarathi-Serve's stall-free batching)."""
    return (req.num_tokens - req.num_computed_tokens > 1, req.arrival)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator | PrefixCache,  # a prefix cache hands out the pages itself
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        chunk_groups: int = 0,  # capped chunked layers' page groups (0: none capped)
        chunk: int | None = None,  # ... and their chunk size
        max_background_tokens: int | None = None,  # background prompt tokens a step; None: all
    ):
        self.allocator = allocator
        self.cache = allocator if isinstance(allocator, PrefixCache) else None
        self.chunk_groups, self.chunk = chunk_groups, chunk
        self.page_size = page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_background_tokens = max_background_tokens
        # interactive requests first, then background ones; each in arrival order (preempted
        # ones at the front)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved: dict[str, Request] = {}  # pages held for a prefill done elsewhere

    def reserve(self, req: Request) -> bool:
        """Holds req's admission pages, its prompt's to be written by a prefill worker (or by
        this engine, start_local). All or nothing, and never pages that the waiting requests
        need to be admitted first (a preempted one would otherwise starve while new
        reservations took its room). With a prefix cache, the pages of the prompt's cached
        prefix are held as they are, counted computed: only the rest is to be written. With
        capped chunked layers, their pages from the window of the first decoded token on too
        (the prompt's last chunk, which the prefill worker writes there)."""
        cached, held = self._cached_prefix(req, computes_prompt=False)
        own = max(0, self._admission_pages(req) - len(cached))
        taken = self.cache.num_free_among(cached + _flat(held)) if cached else 0
        waiting = sum(map(self._admission_pages, self.waiting))
        first, end = self._decode_window(req)
        new_chunk = end - first - (len(held[0]) if held else 0)  # past the cached ones
        if not self.allocator.can_allocate(own + taken + waiting + self._units(new_chunk)):
            return False
        self._start_on(req, cached, held)
        req.page_ids += self.allocator.allocate(own)
        req.chunk_first_page = first
        self._allocate_chunk(req, new_chunk)
        self.reserved[req.request_id] = req
        return True

    def _decode_window(self, req: Request) -> tuple[int, int]:
        """[first, end) logical pages a capped chunked layer holds for req's first decode
        step (its prompt's chunk and the token sampled from it); (0, 0) when none is capped."""
        if self.chunk is None:
            return 0, 0
        return chunk_window(req.num_tokens, req.num_tokens + 1, self.chunk, self.page_size)

    def _admission_pages(self, req: Request) -> int:
        """Pages req needs to join the batch, beyond those it holds (a reserved request holds
        them all). A prefill-only request never writes the KV of the token it samples."""
        admit = pages_for if req.prefill_only else pages_to_admit
        return max(0, admit(req.num_tokens, self.page_size) - len(req.page_ids))

    def activate(self, req: Request, computed: bool) -> None:
        """A reserved request joins the batch: decoding if its prompt KV arrived (`computed`:
        num_computed_tokens was set), else to compute the rest of its prompt here; one that
        wants prompt logprobs then lets its cached prefix go, to compute its whole prompt."""
        del self.reserved[req.request_id]
        if (
            not computed
            and req.num_computed_tokens
            and (req.needs_prompt_logprobs or self.chunk is not None)
        ):  # capped: its chunked pages start at the last chunk, the prefix's window is before
            self._release(req)  # admitted again as a new request
        if computed:
            self.running.append(req)
        else:
            self._free_chunk(req)  # the prompt's first chunks come first: pages as they go
            self.add(req)

    def add(self, req: Request) -> None:
        """Queue req behind the waiting requests of its kind, ahead of every background one
        when it is not one itself."""
        if not req.background:
            for i, other in enumerate(self.waiting):
                if other.background:
                    self.waiting.insert(i, req)
                    return
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Removes the request wherever it is and frees its pages at once."""
        if request_id in self.reserved:
            req = self.reserved.pop(request_id)
            self._finish(req, FinishReason.ABORT)
            return req
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._finish(req, FinishReason.ABORT)
                    return req
        return None

    def schedule(
        self, exclude: frozenset | set = frozenset(), max_requests: int | None = None
    ) -> SchedulerOutput:
        """The next batch. `exclude`: requests still in flight in a pipeline (neither scheduled
        nor preempted; they count against max_num_seqs); `max_requests` caps the batch."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        background = self.max_background_tokens or budget  # background prompt tokens left
        room = max_requests if max_requests is not None else len(self.running) + len(self.waiting)
        for req in sorted(self.running, key=_decodes_first):
            if budget == 0 or len(out.scheduled) == room:
                break
            if req in exclude or req not in self.running:  # in flight, or preempted just now
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.background and n > 1:  # a background prompt chunk (a decode row is not)
                n = min(n, background)
                if n == 0:
                    continue
                background -= n
            if self._reserve(req, n, out, exclude):
                out.scheduled.append(ScheduledRequest.of(req, n))
                budget -= n
        while (
            self.waiting
            and budget > 0
            and len(out.scheduled) < room
            and not out.preempted
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if req.background and background == 0:
                break  # the rest wait too: background requests come last
            cached, window = self._cached_prefix(req)
            start = req.num_computed_tokens + len(cached) * self.page_size
            n = min(req.num_tokens - start, budget)
            if req.background:
                n = min(n, background)
            extra = max(0, self._admission_pages(req) - len(cached))
            extra_chunk = self._chunk_grow(req, n, start) - len(window[0] if window else ())
            held = cached + _flat(window)
            taken = self.cache.num_free_among(held) if held else 0
            if not self.allocator.can_allocate(extra + taken + self._units(extra_chunk)):
                break
            self.waiting.popleft()
            if not req.page_ids:  # not a reserved request computing its prompt here
                self._start_on(req, cached, window)
            req.page_ids += self.allocator.allocate(extra)
            self._allocate_chunk(req, extra_chunk)
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, n))
            budget -= n
            background -= n if req.background else 0
        return out

    def _cached_prefix(
        self, req: Request, computes_prompt: bool = True
    ) -> tuple[list[int], list[list[int]]]:
        """The cached pages a waiting request without pages (new, or preempted) starts on,
        and with capped chunked layers each page group's cached pages of the window it needs
        from there (shared/kv/chunk_cache.py); none if this engine computes its prompt and it
        wants prompt logprobs (every position must run; vLLM skips the cache for them too).
        That window is the chunk of the first token to compute, or for a reservation
        (computes_prompt=False) the prompt's last chunk, whose other pages the prefill worker
        writes; the prefix ends where every group holds it cached (at a chunk's start none
        is needed). Its pages are still named as computed."""
        if self.cache is None or req.page_ids or (computes_prompt and req.needs_prompt_logprobs):
            return [], []
        pages = self.cache.match(self._hashes(req, req.num_tokens), req.num_tokens)
        if self.chunk is None:
            return pages, []
        last_chunk = None if computes_prompt else self._decode_window(req)[0]
        while True:  # cut back to the first window page a group lacks, then check there
            first = self._window_first(len(pages)) if last_chunk is None else last_chunk
            window = self._cached_run(req, first, len(pages))
            if first + len(window[0]) >= len(pages):
                return pages, window
            del pages[first + len(window[0]) :]

    def cached_pages(self, req: Request) -> int:
        """How many of req's prompt's pages it would start on here now (_cached_prefix)."""
        return len(self._cached_prefix(req)[0])

    def _window_first(self, num_pages: int) -> int:
        """The first logical page of the chunk of token num_pages * S."""
        return num_pages * self.page_size // self.chunk * self.chunk // self.page_size

    def _cached_run(self, req: Request, first: int, end: int) -> list[list[int]]:
        """Each page group's cached pages of logical pages first, first + 1, ... before `end`,
        up to the first that a group lacks (all lists as long)."""
        window: list[list[int]] = [[] for _ in range(self.chunk_groups)]
        for p in range(first, end):
            names = (group_hash(req.page_hashes[p], g) for g in range(1, self.chunk_groups + 1))
            found = [self.cache.lookup(name) for name in names]
            if None in found:
                break
            for pages, page in zip(window, found):
                pages.append(page)
        return window

    def _start_on(self, req: Request, cached: list[int], window=()) -> None:
        """A request without pages starts on `cached`, its prefix's cached pages (counted),
        and `window`, its capped groups' (_cached_prefix)."""
        if self.cache is None:
            return
        self.cache.count(req.num_tokens, len(cached))
        if cached:
            self.cache.acquire(cached)
            req.page_ids = list(cached)
            req.num_cached_pages = len(cached)
            req.num_computed_tokens = len(cached) * self.page_size
        if window and window[0]:  # chunk_first_page: _chunk_grow's, from that token on
            self.cache.acquire([page for pages in window for page in pages])
            req.chunk_page_ids = [list(pages) for pages in window]

    def _hashes(self, req: Request, num_tokens: int) -> list[int]:
        """req.page_hashes extended to the full pages of its first `num_tokens` tokens."""
        known, S = len(req.page_hashes), self.page_size
        if num_tokens // S > known:
            parent = req.page_hashes[-1] if known else None
            tokens = req.token_ids(0, num_tokens)
            salt = req.params.cache_salt
            req.page_hashes += page_hashes(tokens, S, salt, parent, first_page=known)
        return req.page_hashes

    def _name_computed_pages(self, req: Request) -> None:
        """Names req's pages whose every token's KV is computed (the cache's `register`), and
        its capped groups' pages of the same tokens (named per group, not announced)."""
        full = min(req.num_computed_tokens // self.page_size, len(req.page_ids))
        if self.cache is None or full <= req.num_cached_pages:
            return
        hashes = self._hashes(req, full * self.page_size)
        for i in range(req.num_cached_pages, full):
            self.cache.register(req.page_ids[i], hashes[i])
        first = req.chunk_first_page
        held = first + (len(req.chunk_page_ids[0]) if req.chunk_page_ids else 0)
        for p in range(max(req.num_cached_pages, first), min(full, held)):
            for group, pages in enumerate(req.chunk_page_ids, 1):
                self.cache.register(pages[p - first], group_hash(hashes[p], group), False)
        req.num_cached_pages = full

    def _reserve(self, req: Request, n: int, out: SchedulerOutput, exclude) -> bool:
        """Pages for req's next n tokens, preempting the newest running requests (never one in
        flight) if needed. False when req itself was preempted or nothing could be."""
        extra = pages_to_grow(len(req.page_ids), req.num_computed_tokens + n, self.page_size)
        extra_chunk = self._chunk_grow(req, n)
        while not self.allocator.can_allocate(extra + self._units(extra_chunk)):
            victims = [r for r in self.running if r not in exclude]
            if not victims:
                return False
            victim = max(victims, key=lambda r: r.arrival)
            self._preempt(victim, out)
            if victim is req:
                return False
        req.page_ids += self.allocator.allocate(extra)
        self._allocate_chunk(req, extra_chunk)
        return True

    def _chunk_grow(self, req: Request, n: int, start: int | None = None) -> int:
        """Frees req's chunked pages before the window of its next n tokens, from `start`
        (num_computed_tokens, or where its cached prefix ends; no later step reads them; a
        pipeline's earlier micro-batches are covered by the quarantine) and returns how many
        logical pages it needs beyond those it holds (in each group)."""
        if self.chunk is None:
            return 0
        start = req.num_computed_tokens if start is None else start
        first, end = chunk_window(start, start + n, self.chunk, self.page_size)
        held = len(req.chunk_page_ids[0]) if req.chunk_page_ids else 0
        drop = max(0, min(first - req.chunk_first_page, held))
        if drop:
            for pages in req.chunk_page_ids:
                self.allocator.free(pages[:drop])
                del pages[:drop]
        if drop == held:
            req.chunk_first_page = first
        else:
            req.chunk_first_page += drop
        return max(0, end - req.chunk_first_page - (held - drop))

    def _units(self, logical: int) -> int:
        """Pages of `logical` chunked logical pages: one in each group."""
        return logical * self.chunk_groups

    def _allocate_chunk(self, req: Request, n: int) -> None:
        """n more logical chunked pages for req: a page in each group for each."""
        if not n:
            return
        if not req.chunk_page_ids:
            req.chunk_page_ids = [[] for _ in range(self.chunk_groups)]
        for pages in req.chunk_page_ids:
            pages += self.allocator.allocate(n)

    def _free_chunk(self, req: Request) -> None:
        for pages in req.chunk_page_ids:
            self.allocator.free(pages)
        req.chunk_page_ids, req.chunk_first_page = [], 0

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        self._release(req)
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        """req lets all its pages go: it computes everything again."""
        self.allocator.free(req.page_ids)
        req.page_ids = []
        self._free_chunk(req)
        req.num_computed_tokens = req.num_cached_pages = 0

    def update(self, out: SchedulerOutput, sampled: dict[Request, int]) -> list[Request]:
        """Advances counters after the step ran; appends sampled tokens; returns the finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            self._name_computed_pages(req)
            if req in sampled:
                req.output_token_ids.append(sampled[req])
                reason = check_stop(req)
                if reason is not None:
                    self.running.remove(req)
                    self._finish(req, reason)
                    finished.append(req)
        return finished

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Ends a request for a reason found outside the step (a stop string, a failed step)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.reserved.pop(req.request_id, None)
        if not req.finished:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        if req.page_ids:
            self.allocator.free(req.page_ids)
            req.page_ids = []
        self._free_chunk(req)


def _flat(groups: list[list[int]]) -> list[int]:
    return [page for pages in groups for page in pages]
