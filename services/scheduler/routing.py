"""How the router ranks workers: its settings, a request's page hashes, and the KV cost. Pure.

Modes (`tison scheduler --routing`):
- `kv` (default): among the workers with room, the lowest
  `cost = kv_overlap_weight * (prompt pages - pages cached there) + load pages` (Dynamo's
  rule): a decode worker's load is its pages in use, a prefill worker's the pages of the prompt
  tokens it has queued. Ties, and every request no candidate holds a prefix of, go by the load
  rule. The cached prefix is what the worker's KV events say (kv_index.py).
- `load`: the load rule alone (decode: fewest running sequences, then most free pages; prefill:
  fewest queued prompt tokens); the index is not used.
- `round-robin`: the next worker with room after the last one chosen, in worker id order (a
  baseline for benchmarks).
A session's pin (affinity.py) comes first in every mode.
"""

from dataclasses import dataclass

from services.scheduler.affinity import DEFAULT_MAX_SESSIONS
from shared.kv.block_hash import page_hashes
from shared.kv.pages import pages_for
from shared.protocol import HeartbeatMsg, SubmitMsg

KV, LOAD, ROUND_ROBIN = "kv", "load", "round-robin"
MODES = (KV, LOAD, ROUND_ROBIN)
LOCAL_PREFILL_TOKENS = 256
BATCH_MAX_SHARE = 0.5
BATCH_PREFILL_TOKENS = 1024

# Why a worker was chosen (Choice.*_reason; the scheduler's metrics label).
BY_KV_OVERLAP = "kv_overlap"  # kv mode, and the worker holds a prefix of the prompt
BY_AFFINITY = "affinity"  # the session's pin
BY_LOAD = "load"  # the load rule (load mode; kv mode when no cached prefix decided)
BY_ROUND_ROBIN = "round_robin"
BY_LOCAL_PREFILL = "local_prefill"  # prefill only: the decode worker computes the prompt


@dataclass(frozen=True)
class RoutingConfig:
    """The router's settings (tison scheduler flags)."""

    mode: str = KV  # --routing
    kv_overlap_weight: float = 1.0  # --kv-overlap-weight: a page to compute vs a page of load
    local_prefill_tokens: int = LOCAL_PREFILL_TOKENS  # --local-prefill-tokens (policy.py)
    max_sessions: int = DEFAULT_MAX_SESSIONS  # --max-sessions: the affinity table's bound
    # --batch-max-share: of a decode worker's pool, what batch requests may fill (policy.py);
    # 1.0: all of it
    batch_max_share: float = BATCH_MAX_SHARE
    # --batch-prefill-tokens: a computing worker with this many prompt tokens queued takes no
    # batch request (policy.py)
    batch_prefill_tokens: int = BATCH_PREFILL_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"routing must be one of {MODES}, got {self.mode!r}")
        if self.kv_overlap_weight < 0 or self.local_prefill_tokens < 0:
            raise ValueError("kv_overlap_weight and local_prefill_tokens must be >= 0")
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if not 0 < self.batch_max_share <= 1:
            raise ValueError(f"batch_max_share must be in (0, 1], got {self.batch_max_share}")
        if self.batch_prefill_tokens < 1:
            raise ValueError(f"batch_prefill_tokens must be >= 1, got {self.batch_prefill_tokens}")


class PromptPages:
    """A request's page hashes, computed once per page size (workers may differ in it)."""

    def __init__(self, submit: SubmitMsg):
        self.token_ids = list(submit.prompt_token_ids)
        self.salt = submit.sampling.cache_salt
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, page_size: int) -> list[int]:
        if page_size not in self._hashes:
            self._hashes[page_size] = page_hashes(self.token_ids, page_size, self.salt)
        return self._hashes[page_size]

    def cached_tokens(self, overlap_pages: int, page_size: int) -> int:
        """Prompt tokens a worker with `overlap_pages` cached need not compute: the engine
        computes the last token at least (it samples from it), so all but its page."""
        usable = min(overlap_pages, (len(self.token_ids) - 1) // page_size)
        return usable * page_size

    def kv_cost(self, weight: float, overlap_pages: int, page_size: int, load_pages: int):
        """The kv mode's cost of one worker."""
        to_compute = pages_for(len(self.token_ids), page_size) - overlap_pages
        return weight * to_compute + load_pages


def next_in_cycle(beats: list[HeartbeatMsg], last: str | None) -> HeartbeatMsg:
    """The first worker after `last` in id order, wrapping around (`beats` in id order)."""
    return next((b for b in beats if last is not None and b.worker_id > last), beats[0])
