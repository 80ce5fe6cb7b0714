"""Page accounting and the continuous batch of the fake decode worker. Pure (no NATS, no clock)."""

from dataclasses import dataclass, field

from services.fake_worker.tokens import FakeModelInfo, fake_logprob, next_token, prompt_digest
from shared import protocol
from shared.protocol import DecodeAssignMsg, KvReadyMsg, TokenItem, Usage
from shared.sampling.params import SamplingParams


class PageAllocator:
    """A pool of `num_pages` page ids; reserve all-or-nothing, release on finish or cancel."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def reserve(self, num: int) -> tuple[int, ...] | None:
        """`num` page ids, or None (and nothing reserved) when fewer are free."""
        if num > len(self._free):
            return None
        return tuple(self._free.pop() for _ in range(num))

    def release(self, page_ids: tuple[int, ...]) -> None:
        self._free.extend(reversed(page_ids))


@dataclass
class FakeSeq:
    """One request held by the decode worker, described by counters."""

    request_id: str
    gateway_id: str
    num_prompt_tokens: int
    digest: int  # prompt_digest of the prompt: the fake tokens depend on it
    sampling: SamplingParams
    page_ids: tuple[int, ...]
    num_output: int = 0  # tokens produced so far (the prefill's first token included)
    kv_ready: bool = False  # the prefill worker has written the pages


@dataclass
class DecodeBatch:
    """Requests with reserved pages; those whose KV is ready advance one token per step."""

    info: FakeModelInfo
    pages: PageAllocator
    page_size: int
    eos_after: int | None = None
    seqs: dict[str, FakeSeq] = field(default_factory=dict)

    def reserve(self, assign: DecodeAssignMsg) -> tuple[int, ...] | None:
        """Reserve pages for prompt + max_tokens; None when the pool cannot hold it now."""
        num_tokens = len(assign.prompt_token_ids) + assign.sampling.max_tokens
        page_ids = self.pages.reserve(-(-num_tokens // self.page_size))
        if page_ids is not None:
            self.seqs[assign.request_id] = FakeSeq(
                request_id=assign.request_id,
                gateway_id=assign.gateway_id,
                num_prompt_tokens=len(assign.prompt_token_ids),
                digest=prompt_digest(assign.prompt_token_ids),
                sampling=assign.sampling,
                page_ids=page_ids,
            )
        return page_ids

    def kv_ready(self, msg: KvReadyMsg) -> tuple[str, TokenItem] | None:
        """Start decoding; (gateway, item) when the request already ends (error, EOS, length)."""
        seq = self.seqs.get(msg.request_id)
        if seq is None:
            return None  # cancelled meanwhile
        if not msg.ok:
            return self._finish(seq, [], [], protocol.FINISH_ERROR, msg.error or "prefill failed")
        seq.kv_ready, seq.num_output = True, 1
        reason = self._finish_reason(seq, msg.first_token_id)
        return self._finish(seq, [], [], reason) if reason else None

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its pages; True if it was held."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pages.release(seq.page_ids)
        return seq is not None

    @property
    def num_ready(self) -> int:
        return sum(seq.kv_ready for seq in self.seqs.values())

    def step(self) -> dict[str, list[TokenItem]]:
        """One token for every ready request, grouped by gateway."""
        out: dict[str, list[TokenItem]] = {}
        for seq in [s for s in self.seqs.values() if s.kv_ready]:
            index = seq.num_output
            token = next_token(self.info, seq.digest, index, seq.sampling, self.eos_after)
            top_n = seq.sampling.logprobs
            logprobs = [] if top_n is None else [fake_logprob(self.info, token, index, top_n)]
            seq.num_output += 1
            reason = self._finish_reason(seq, token)
            if reason:
                gateway, item = self._finish(seq, [token], logprobs, reason, index=index)
            else:
                gateway = seq.gateway_id
                item = TokenItem(seq.request_id, index, (token,), tuple(logprobs))
            out.setdefault(gateway, []).append(item)
        return out

    def _finish_reason(self, seq: FakeSeq, token: int) -> str | None:
        sampling = seq.sampling
        is_stop = token in sampling.stop_token_ids or (
            token == self.info.eos_token_id and not sampling.ignore_eos
        )
        # Stop tokens count only once min_tokens were generated (this token included).
        if is_stop and seq.num_output > sampling.min_tokens:
            return protocol.FINISH_STOP
        if seq.num_output >= sampling.max_tokens:
            return protocol.FINISH_LENGTH
        return None

    def _finish(self, seq, token_ids, logprobs, reason, error="", index=None):
        self.cancel(seq.request_id)
        item = TokenItem(
            request_id=seq.request_id,
            index=seq.num_output if index is None else index,
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            finish_reason=reason,
            error=error,
            usage=Usage(seq.num_prompt_tokens, seq.num_output),
        )
        return seq.gateway_id, item
