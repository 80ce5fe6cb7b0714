"""Prefix cache: full pages of computed KV kept after their requests end, found again by the hash
of everything up to their end (block_hash.py), so a request computes only its uncached suffix.
Pure bookkeeping over the page allocator, single owner (the scheduler), as vLLM v1's block
pool: the allocator holds the pages, this the names and the holders.

- A page is cached once all its tokens' KV is computed (`register`, after each step); it is
  never written again: requests write only past their computed tokens.
- Holders count: a page held by several requests (a shared system prompt) returns to the
  allocator when its last holder frees it, still named: a later request finds it there and
  takes it back (`acquire`) while no one else got it. The allocator hands such kept pages
  out only when no blank one is left, oldest-freed first, so the least recently used cached
  pages are the first reused; reuse drops the name (an eviction). Free pages in the
  allocator's quarantine (a pipeline's micro-batches in flight) are not found until released.
- A request matches at most all but its last token's pages: one token at least is computed,
  so the step samples; a prompt of whole pages recomputes its last page into a new one (never
  writing into a shared page).
- Events (names cached and evicted since the last `drain_events`) feed the router's index;
  counters feed the hit-rate metrics."""

from dataclasses import dataclass

from shared.kv.allocator import PageAllocator


@dataclass
class PrefixStats:
    """Cumulative counters of admissions that looked the cache up (every admission, also a
    preempted request's resumption) and the pages it names now."""

    queried_requests: int = 0
    hit_requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    cached_pages: int = 0


class PrefixCache:
    """Names of full pages and their holders, over `allocator` (whose pages it hands out)."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self._page_of: dict[int, int] = {}  # page hash -> page
        self._hash_of: dict[int, int] = {}  # page -> page hash
        self._holders: dict[int, int] = {}  # page -> requests holding it (absent: free)
        self._stored: list[int] = []  # names since the last drain_events
        self._evicted: list[int] = []
        self._quiet: set[int] = set()  # names registered with announce=False
        self.stats = PrefixStats()

    # --- the allocator's interface, shared pages counted once ---------------------------------

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        pages = self.allocator.allocate(n)
        for page in pages:
            self._forget(page)
            self._holders[page] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """A holder lets `pages` go; each returns to the allocator (still named, if cached)
        with its last holder."""
        released = []
        for page in pages:
            left = self._holders[page] - 1
            if left:
                self._holders[page] = left
            else:
                del self._holders[page]
                released.append(page)
        if released:
            self.allocator.free(released, keep=self._hash_of)  # the named ones

    def mark_launched(self) -> None:
        self.allocator.mark_launched()

    def mark_collected(self) -> None:
        self.allocator.mark_collected()

    # --- the cache ----------------------------------------------------------------------------

    def match(self, hashes: list[int], num_tokens: int) -> list[int]:
        """The cached pages of the longest prefix of `hashes` (a request's full pages) that
        leaves at least one of its `num_tokens` tokens to compute. Holds nothing yet."""
        pages = []
        for h in hashes[: (num_tokens - 1) // self.page_size]:
            page = self.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def lookup(self, page_hash: int) -> int | None:
        """The page `page_hash` names, held or free (not in quarantine); None if none is."""
        page = self._page_of.get(page_hash)
        if page is None or not (page in self._holders or self.allocator.is_free(page)):
            return None
        return page

    def num_free_among(self, pages: list[int]) -> int:
        """How many of these cached pages are free: acquiring them takes that many free pages."""
        return sum(1 for page in pages if page not in self._holders)

    def acquire(self, pages: list[int]) -> None:
        """Holds `match`'s pages for one more request (free ones are taken back)."""
        for page in pages:
            if page in self._holders:
                self._holders[page] += 1
            elif self.allocator.take(page):
                self._holders[page] = 1
            else:
                raise ValueError(f"cached KV page {page} is neither held nor free")

    def count(self, num_tokens: int, hit_pages: int) -> None:
        """One admission's lookup: `hit_pages` of its `num_tokens` tokens' pages were cached."""
        s = self.stats
        s.queried_requests += 1
        s.hit_requests += hit_pages > 0
        s.queried_tokens += num_tokens
        s.hit_tokens += hit_pages * self.page_size

    def register(self, page: int, page_hash: int, announce: bool = True) -> None:
        """`page` (held) holds the computed KV that `page_hash` names; a name already given to
        another page that a request holds stays there (this one stays unnamed: its content is
        a duplicate); one given to a free page moves to this one, which lives on at least
        while its request does (the free one may be evicted any moment: a request that could
        not start on it, a capped window gone, computes the same page again). announce=False:
        not in the events (a capped chunked layer group's page, which the router's index of
        prompts' page names never asks for)."""
        if page in self._hash_of:
            return
        named = self._page_of.get(page_hash)
        if named is not None:
            if named in self._holders:
                return
            del self._hash_of[named]
            self.allocator.unkeep(named)  # free (or in quarantine): now a blank page
            self._page_of[page_hash], self._hash_of[page] = page, page_hash
            return
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        if announce:
            self._stored.append(page_hash)
        else:
            self._quiet.add(page_hash)
        self.stats.cached_pages += 1

    def drain_events(self) -> tuple[list[int], list[int]]:
        """(names cached, names evicted) since the previous call."""
        events = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return events

    def _forget(self, page: int) -> None:
        """The allocator handed `page` out again: its content will be overwritten."""
        page_hash = self._hash_of.pop(page, None)
        if page_hash is not None:
            del self._page_of[page_hash]
            if page_hash in self._quiet:
                self._quiet.discard(page_hash)
            else:
                self._evicted.append(page_hash)
            self.stats.evicted_pages += 1
            self.stats.cached_pages -= 1
