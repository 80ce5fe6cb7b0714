"""Page allocator: which KV pages are free. Pure bookkeeping, single owner (the scheduler); how
many pages a request needs is shared/kv/pages.py's rule."""

from collections import OrderedDict, deque


class PageAllocator:
    """Hands out page ids from a fixed pool of `num_pages`; frees return them.

    With a pipeline, micro-batches launched earlier may still write into pages freed now (an
    abort, a preemption). Such pages wait in quarantine until every micro-batch launched before
    the free has been collected; only then can another request get them."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._used: set[int] = set()
        self._launched = 0  # micro-batches launched so far
        self._collected = 0  # ... and collected (in launch order)
        self._quarantine: deque[tuple[int, list[int]]] = deque()  # (launched at free, pages)

    def mark_launched(self) -> None:
        self._launched += 1

    def mark_collected(self) -> None:
        self._collected += 1
        while self._quarantine and self._quarantine[0][0] <= self._collected:
            self._release(self._quarantine.popleft()[1])

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        self._used.update(pages)
        return pages

    def take(self, page: int) -> bool:
        """Allocates this free page (a cached one found again); False if it is not free (in
        use, or in quarantine)."""
        if page not in self._free:
            return False
        del self._free[page]
        self._used.add(page)
        return True

    def is_free(self, page: int) -> bool:
        return page in self._free

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"KV page {page} freed twice or never allocated")
        if self._launched > self._collected:
            self._quarantine.append((self._launched, list(pages)))
        else:
            self._release(pages)

    def _release(self, pages: list[int]) -> None:
        for page in pages:
            self._used.remove(page)
            self._free[page] = None
