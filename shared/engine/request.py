"""A request inside the engine, described by counters (no phases): chunked prefill, decode and
recompute after preemption are all "compute the tokens not yet computed"."""

from dataclasses import dataclass, field
from enum import Enum

from shared.sampling.logprobs import TokenLogprob
from shared.sampling.params import SamplingParams


@dataclass(frozen=True)
class PromptTargets:
    """The prompt logprobs one step computes for a request: the rows of its positions
    first, first + 1, ... score the prompt tokens after them, target_ids."""

    first: int  # the prompt position of the first row (it scores prompt token first + 1)
    target_ids: list[int]  # prompt tokens first + 1, first + 2, ...: one per row
    num_top: int  # params.prompt_logprobs: the top-n alternatives kept at each position


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the model's / pool's length cap
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed while running; the others go on


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or drawn at admission: seeded draws survive preemption
    stop_token_ids: frozenset[int]  # EOS ids (unless ignore_eos) + params.stop_token_ids
    max_total_tokens: int  # prompt + output cap: min(max model length, whole KV pool)
    arrival: int  # admission order; the newest running request is preempted first
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # if params.logprobs
    # if params.prompt_logprobs: one per prompt token from the second on, as computed (kept
    # through preemption: a recompute adds none twice)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the pages
    page_ids: list[int] = field(default_factory=list)
    # capped chunked layers (shared/kv/chunk_cache.py): their pages, one list a page group
    # (all as long, [] when none is held), logical pages chunk_first_page on (those before
    # the window of the newest step are freed)
    chunk_page_ids: list[list[int]] = field(default_factory=list)
    chunk_first_page: int = 0
    dp_rank: int = 0  # --dp: the data-parallel rank whose pool holds its pages
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    # prefix cache: hashes of the full pages of its tokens so far (shared/kv/block_hash.py),
    # and how many of its pages, from the first, are named in the cache
    page_hashes: list[int] = field(default_factory=list)
    num_cached_pages: int = 0
    prefill_only: bool = False  # a prefill worker's request: done after its first token
    # a batch request: admitted after every other waiting one, its prompt in small steps
    # (EngineConfig.max_background_tokens)
    background: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and lacks some: it computes its whole prompt (a cached
        prefix would skip the positions that score the tokens after them)."""
        wanted = self.params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def prompt_targets(self, start: int, end: int) -> PromptTargets | None:
        """What computing tokens [start, end) adds to prompt_logprobs (those it has are not
        computed again); None if nothing."""
        first, last = max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1)
        if self.params.prompt_logprobs is None or first >= last:
            return None
        targets = self.prompt_token_ids[first + 1 : last + 1]
        return PromptTargets(first, targets, self.params.prompt_logprobs)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n) : end - n]


def check_stop(req: Request) -> FinishReason | None:
    """Why the request must finish after its newest token, if it must."""
    if req.prefill_only:
        return FinishReason.LENGTH  # the decode worker decides the real reason
    token = req.output_token_ids[-1]
    num_out = len(req.output_token_ids)
    if num_out >= req.params.min_tokens and token in req.stop_token_ids:
        req.stop_reason = token
        return FinishReason.STOP
    if num_out >= req.params.max_tokens or req.num_tokens >= req.max_total_tokens:
        return FinishReason.LENGTH
    return None
