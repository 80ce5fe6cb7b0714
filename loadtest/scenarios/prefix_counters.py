"""Prefix-cache use from Prometheus counters read before and after a load. Pure but `scrape`.

The counters' exact names belong to the engine: every sample whose name starts with
`tison_prefix_cache` (and any `tison_*` counter of computed tokens) is summed over its label
sets (one per worker), and read by what its name says: "hit" tokens, "quer"(ied)/"lookup"
tokens, "miss" tokens, "computed" tokens. What is missing comes out None (reported "n/a").
"""

import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "tison_prefix_cache"
METRICS_URL = re.compile(r"https?://[\w.\-\[\]:]+:\d+/metrics")


def wanted(name: str) -> bool:
    """A sample this module reads: the prefix cache's, or a count of computed tokens."""
    if name.endswith("_created"):  # prometheus_client's creation timestamps, not counts
        return False
    computed = name.startswith("tison_") and "computed" in name and "token" in name
    return name.startswith(PREFIX) or computed


def prefix_counters(text: str) -> dict[str, float]:
    """Sample name -> its value summed over label sets, for the wanted samples of a
    Prometheus text exposition."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if wanted(sample.name):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape(urls: list[str], timeout_s: float = 5.0) -> dict[str, float]:
    """prefix_counters summed over `urls`; one that does not answer adds nothing."""
    totals: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for name, value in prefix_counters(text).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def metrics_urls(base_url: str, log: Path | None = None) -> list[str]:
    """The gateway's /metrics (worker figures mirrored from heartbeats) and every other
    .../metrics URL the service printed in `log` (workers that serve their own)."""
    urls = [base_url.rstrip("/") + "/metrics"]
    if log is not None and log.is_file():
        for url in METRICS_URL.findall(log.read_text(errors="replace")):
            if url not in urls:
                urls.append(url)
    return urls


@dataclass(frozen=True)
class PrefixUse:
    """Tokens over one load, summed over workers; None where no counter said."""

    hit_tokens: float | None = None  # prompt tokens whose KV came from the cache
    queried_tokens: float | None = None  # prompt tokens looked up in the cache
    computed_tokens: float | None = None  # prompt tokens prefilled (computed)

    @property
    def hit_rate(self) -> float | None:
        if self.hit_tokens is None or not self.queried_tokens:
            return None
        return self.hit_tokens / self.queried_tokens

    def to_json(self) -> dict:
        return {
            "hit_tokens": self.hit_tokens,
            "queried_tokens": self.queried_tokens,
            "computed_tokens": self.computed_tokens,
            "hit_rate": self.hit_rate,
        }


def _sum(delta: dict[str, float], words: tuple[str, ...]) -> float | None:
    names = [n for n in delta if "token" in n and any(w in n for w in words)]
    return sum(delta[n] for n in names) if names else None


def prefix_use(before: dict[str, float], after: dict[str, float]) -> PrefixUse:
    """What the counters moved by between two scrapes."""
    delta = {name: value - before.get(name, 0.0) for name, value in after.items()}
    hit = _sum({n: v for n, v in delta.items() if n.startswith(PREFIX)}, ("hit",))
    queried = _sum(delta, ("quer", "lookup"))
    miss = _sum(delta, ("miss",))
    computed = _sum(delta, ("computed",))
    if queried is None and hit is not None and miss is not None:
        queried = hit + miss
    if computed is None:
        computed = miss if miss is not None else None
    if computed is None and queried is not None and hit is not None:
        computed = queried - hit
    return PrefixUse(hit, queried, computed)
