"""Page allocator: which KV pages are free. Pure bookkeeping, single owner (the scheduler)."""

from collections import deque


class PageAllocator:
    """Hands out page ids from a fixed pool of `num_pages`; frees return them."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used: set[int] = set()

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
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"KV page {page} freed twice or never allocated")
            self._used.remove(page)
            self._free.append(page)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
