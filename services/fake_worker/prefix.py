"""The fake worker's prefix cache: names only, no KV, with the engine's interface (kv_events,
prefix_stats), so routing on KV events is tested end to end without a model. Pure.

Each admitted prompt is looked up (the leading pages already named count as hits), then its
full pages are named (block_hash.page_hashes, as the engine names them), the least recently
used names dropped beyond `capacity` pages. Unlike the engine it caches at admission and
apart from its page allocator: a fake keeps what tests need, deterministic events.
"""

from collections import OrderedDict
from dataclasses import asdict

from shared.kv.block_hash import page_hashes
from shared.protocol import PrefixStats


class FakePrefixCache:
    """LRU set of page hashes plus the events and counters the engine reports."""

    def __init__(self, page_size: int, capacity: int, enabled: bool = True):
        self.page_size, self.capacity, self.enabled = page_size, capacity, enabled
        self._named: OrderedDict[int, None] = OrderedDict()
        self._stored: list[int] = []
        self._evicted: list[int] = []
        self._stats = asdict(PrefixStats())

    def admit(self, prompt_token_ids: tuple[int, ...], salt: str) -> int:
        """Look the prompt up and name its pages; the prompt tokens found cached."""
        if not self.enabled:
            return 0
        hashes = page_hashes(list(prompt_token_ids), self.page_size, salt)
        hits = next((i for i, h in enumerate(hashes) if h not in self._named), len(hashes))
        s = self._stats
        s["queried_requests"] += 1
        s["hit_requests"] += hits > 0
        s["queried_tokens"] += len(prompt_token_ids)
        s["hit_tokens"] += hits * self.page_size
        for page_hash in hashes:
            if page_hash in self._named:
                self._named.move_to_end(page_hash)
            else:
                self._named[page_hash] = None
                self._stored.append(page_hash)
        while len(self._named) > self.capacity:
            self._evicted.append(self._named.popitem(last=False)[0])
            s["evicted_pages"] += 1
        s["cached_pages"] = len(self._named)
        return hits * self.page_size

    def kv_events(self) -> tuple[list[int], list[int]]:
        """(hashes named, hashes dropped) since the previous call, as LLMEngine.kv_events()."""
        events = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return events

    def prefix_stats(self) -> dict[str, int]:
        """The counters of LLMEngine.prefix_stats() (PrefixStats' fields)."""
        return dict(self._stats)
