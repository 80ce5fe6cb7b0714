"""Page allocator: which KV pages are free. Pure bookkeeping, single owner (the scheduler); how
many pages a request needs is shared/kv/pages.py's rule."""

from collections import OrderedDict, deque
from collections.abc import Container


class PageAllocator:
    """Hands out page ids from a fixed pool of `num_pages`; frees return them.

    Free pages are blank or kept. Kept ones hold KV that a prefix cache names (`free`'s
    `keep`): they go out only when no blank page is left, the least recently freed first (an
    eviction, as SGLang's radix cache evicts only for want of free pages). Blank ones go out
    first, the most recently freed first: its memory is the likeliest to be in the CPU's caches
    and mapped already (a pool is mapped lazily: the first write to a never used page is a page
    fault, ~100 us for a 2 MiB huge page, in the middle of a step's KV writes).

    With a pipeline, micro-batches launched earlier may still write into pages freed now (an
    abort, a preemption). Such pages wait in quarantine until every micro-batch launched before
    the free has been collected; only then can another request get them."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # blank: the last out first (page 0 at the end); kept: the first in first
        self._blank: OrderedDict[int, None] = OrderedDict.fromkeys(reversed(range(num_pages)))
        self._kept: OrderedDict[int, None] = OrderedDict()
        self._used: set[int] = set()
        self._launched = 0  # micro-batches launched so far
        self._collected = 0  # ... and collected (in launch order)
        # (launched at free, pages, which of them to keep)
        self._quarantine: deque[tuple[int, list[int], Container[int]]] = deque()

    def mark_launched(self) -> None:
        self._launched += 1

    def mark_collected(self) -> None:
        self._collected += 1
        while self._quarantine and self._quarantine[0][0] <= self._collected:
            self._release(*self._quarantine.popleft()[1:])

    @property
    def num_free(self) -> int:
        return len(self._blank) + len(self._kept)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV pages, {self.num_free} free")
        pages = [
            self._blank.popitem()[0] if self._blank else self._kept.popitem(last=False)[0]
            for _ in range(n)
        ]
        self._used.update(pages)
        return pages

    def take(self, page: int) -> bool:
        """Allocates this free page (a cached one found again); False if it is not free (in
        use, or in quarantine)."""
        if not self.is_free(page):
            return False
        del (self._kept if page in self._kept else self._blank)[page]
        self._used.add(page)
        return True

    def is_free(self, page: int) -> bool:
        return page in self._kept or page in self._blank

    def unkeep(self, page: int) -> None:
        """A kept free page no longer holds anything named: it goes out with the blank ones."""
        if page in self._kept:
            del self._kept[page]
            self._blank[page] = None

    def free(self, pages: list[int], keep: Container[int] = ()) -> None:
        """`pages` are free again; those in `keep` hold KV a prefix cache names (a container
        read when they are released: after the quarantine, if they wait in it)."""
        for page in pages:
            if page not in self._used:
                raise ValueError(f"KV page {page} freed twice or never allocated")
        if self._launched > self._collected:
            self._quarantine.append((self._launched, list(pages), keep))
        else:
            self._release(pages, keep)

    def _release(self, pages: list[int], keep: Container[int]) -> None:
        for page in pages:
            self._used.remove(page)
            (self._kept if page in keep else self._blank)[page] = None
