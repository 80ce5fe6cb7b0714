"""Data-parallel attention's bookkeeping (`--dp D`). Each of the D ranks holds a KV pool of its
own, so each has a Scheduler of its own over its pages (and its prefix cache).
`DataParallelScheduler` puts each request on one rank, where it stays (`Request.dp_rank`), and
schedules the D ranks into one step, which all of them run together: the MoE layers exchange
their tokens (shared/models/layers/moe_ep.py). As SGLang's DP attention and vLLM's data-parallel
engines do, a request goes to the rank with the fewest requests: the ranks step together, so a
step lasts as long as its busiest rank's part. Among those, to the one that has most of its
prompt cached (a prefix shared by every request is then computed once a rank, not piled onto
one), then in turn. Pure policy, like the Scheduler it fans out to; page ids are each rank's."""

import dataclasses
from collections import ChainMap

from shared.engine.config import EngineConfig
from shared.engine.request import FinishReason, Request
from shared.engine.scheduler import Scheduler, SchedulerOutput
from shared.kv.allocator import PageAllocator
from shared.kv.prefix_cache import PrefixCache, PrefixStats


class DataParallelPages:
    """The ranks' allocators (prefix caches, if on) as one, for the engine's counters, events
    and the launch/collect quarantine (each rank's pages are freed in its own)."""

    def __init__(self, pools: list[PageAllocator | PrefixCache]):
        self.pools = pools

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.pools)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self.pools)

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.pools)

    def mark_launched(self) -> None:
        for pool in self.pools:
            pool.mark_launched()

    def mark_collected(self) -> None:
        for pool in self.pools:
            pool.mark_collected()

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(names cached, names evicted) on any rank since the previous call."""
        stored, evicted = [], []
        for pool in self.pools:
            s, e = pool.drain_events()
            stored += s
            evicted += e
        return stored, evicted

    @property
    def stats(self) -> PrefixStats:
        fields = [f.name for f in dataclasses.fields(PrefixStats)]
        return PrefixStats(**{f: sum(getattr(p.stats, f) for p in self.pools) for f in fields})


class DataParallelScheduler:
    """The Scheduler interface the engine uses, over one Scheduler a rank."""

    def __init__(self, schedulers: list[Scheduler]):
        self.schedulers = schedulers
        self._next = 0  # the rank that wins the next tie: ties rotate

    @property
    def reserved(self) -> ChainMap:
        return ChainMap(*(s.reserved for s in self.schedulers))

    @property
    def running(self) -> list[Request]:
        return [req for s in self.schedulers for req in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [req for s in self.schedulers for req in s.waiting]

    def ranks_for(self, req: Request) -> list[int]:
        """The ranks in the order req would go to them: fewest requests (running, waiting,
        reserved) first, then most of its prompt's pages cached, then most free pages, then in
        turn (each placement moves the turn past its rank)."""
        size = len(self.schedulers)

        def key(rank: int):
            s = self.schedulers[rank]
            load = len(s.running) + len(s.waiting) + len(s.reserved)
            return (load, -s.cached_pages(req), -s.allocator.num_free, (rank - self._next) % size)

        return sorted(range(size), key=key)

    def add(self, req: Request) -> None:
        self._place(req, self.ranks_for(req)[0])
        self.schedulers[req.dp_rank].add(req)

    def reserve(self, req: Request) -> bool:
        """Holds req's pages on the first rank (ranks_for) whose pool has room."""
        for rank in self.ranks_for(req):
            if self.schedulers[rank].reserve(req):
                self._place(req, rank)
                return True
        return False

    def _place(self, req: Request, rank: int) -> None:
        req.dp_rank = rank
        self._next = (rank + 1) % len(self.schedulers)

    def activate(self, req: Request, computed: bool) -> None:
        self.schedulers[req.dp_rank].activate(req, computed)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def abort(self, request_id: str) -> Request | None:
        for s in self.schedulers:
            req = s.abort(request_id)
            if req is not None:
                return req
        return None

    def schedule(
        self, exclude: frozenset | set = frozenset(), max_requests: int | None = None
    ) -> SchedulerOutput:
        """Every rank's batch, rank 0's requests first, then rank 1's, ...: the order in which
        the ranks' hidden states are gathered for sampling (runner.py). Each rank has the
        token budget and sequence limit of one engine."""
        out = SchedulerOutput()
        for s in self.schedulers:
            part = s.schedule(exclude, max_requests)
            out.scheduled += part.scheduled
            out.preempted += part.preempted
        return out

    def update(self, out: SchedulerOutput, sampled: dict[Request, int]) -> list[Request]:
        finished = []
        for rank, s in enumerate(self.schedulers):
            part = SchedulerOutput(
                [x for x in out.scheduled if x.request.dp_rank == rank],
                [req for req in out.preempted if req.dp_rank == rank],
            )
            finished += s.update(part, sampled)
        return finished

    def finish(self, req: Request, reason: FinishReason) -> None:
        self.schedulers[req.dp_rank].finish(req, reason)


def make_schedulers(
    config: EngineConfig, num_pages: int, chunk_groups: int, chunk: int | None
) -> tuple[Scheduler | DataParallelScheduler, PageAllocator | PrefixCache | DataParallelPages]:
    """An engine's (scheduler, pages): one Scheduler over one pool (a PrefixCache over the
    allocator where prefix caching is on), or with --dp one a rank, as one."""
    schedulers, pools = [], []
    for _ in range(config.dp):
        pool = PageAllocator(num_pages)
        if config.enable_prefix_caching:
            pool = PrefixCache(pool, config.page_size)
        pools.append(pool)
        schedulers.append(
            Scheduler(
                pool,
                config.page_size,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                chunk_groups,
                chunk,
                config.max_background_tokens,
            )
        )
    if config.dp == 1:
        return schedulers[0], pools[0]
    return DataParallelScheduler(schedulers), DataParallelPages(pools)
