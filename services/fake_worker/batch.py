"""The continuous batch of the fake decode worker. Pure (no NATS, no clock).

Pages follow the engine's rule (shared/kv/pages.py) on the engine's allocator: a request
reserves room for its prompt and one token, grows a page at a time as it decodes, and when the
pool is full the newest decoding request is preempted. A preempted request resumes, oldest
first, once its pages fit again; its tokens depend on the output index only, so a resumed
request gives the tokens it would have given (the fake recomputes nothing)."""

import itertools
from dataclasses import dataclass, field

from services.fake_worker.tokens import FakeModelInfo, fake_logprob, next_token, prompt_digest
from shared import protocol
from shared.kv.allocator import PageAllocator
from shared.kv.pages import fits, pages_to_admit, pages_to_grow
from shared.protocol import DecodeAssignMsg, KvReadyMsg, TokenItem, Usage
from shared.sampling.params import SamplingParams


@dataclass
class FakeSeq:
    """One request held by the decode worker, described by counters."""

    request_id: str
    gateway_id: str
    num_prompt_tokens: int
    digest: int  # prompt_digest of the prompt: the fake tokens depend on it
    sampling: SamplingParams
    arrival: int  # the newest decoding request is preempted first
    page_ids: list[int]
    num_output: int = 0  # tokens produced so far (the first token included)
    kv_ready: bool = False  # the prompt's KV is in place: the request decodes
    preempted: bool = False  # waits for its pages back

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output


@dataclass
class DecodeBatch:
    """Requests with reserved pages; those whose KV is ready advance one token per step."""

    info: FakeModelInfo
    pages: PageAllocator
    page_size: int
    eos_after: int | None = None
    seqs: dict[str, FakeSeq] = field(default_factory=dict)
    _arrivals: itertools.count = field(default_factory=itertools.count)

    @property
    def max_total_tokens(self) -> int:
        """Prompt + output cap: the whole pool, as the engine caps it."""
        return self.pages.num_pages * self.page_size

    def reserve(self, assign: DecodeAssignMsg) -> tuple[int, ...] | None:
        """Reserve the prompt's admission pages; None when the pool cannot hold them now."""
        num_prompt = len(assign.prompt_token_ids)
        if not fits(self.pages.num_free, num_prompt, self.page_size):
            return None
        page_ids = self.pages.allocate(pages_to_admit(num_prompt, self.page_size))
        self.seqs[assign.request_id] = FakeSeq(
            request_id=assign.request_id,
            gateway_id=assign.gateway_id,
            num_prompt_tokens=num_prompt,
            digest=prompt_digest(assign.prompt_token_ids),
            sampling=assign.sampling,
            arrival=next(self._arrivals),
            page_ids=page_ids,
        )
        return tuple(page_ids)

    def kv_ready(self, msg: KvReadyMsg) -> tuple[str, TokenItem] | None:
        """Start decoding from the prefill's first token; (gateway, item) to publish at once:
        that token (output index 0) or, on a prefill error, the failure. None if cancelled."""
        seq = self.seqs.get(msg.request_id)
        if seq is None:
            return None  # cancelled meanwhile
        if not msg.ok:
            return self._finish(seq, [], [], protocol.FINISH_ERROR, msg.error or "prefill failed")
        seq.kv_ready, seq.num_output = True, 1
        logprobs = [] if msg.first_logprob is None else [msg.first_logprob]
        token = msg.first_token_id
        reason = self._finish_reason(seq, token)
        prompt = msg.prompt_logprobs
        if reason:
            return self._finish(seq, [token], logprobs, reason, index=0, prompt=prompt)
        item = TokenItem(seq.request_id, 0, (token,), tuple(logprobs), prompt_logprobs=prompt)
        return seq.gateway_id, item

    def cancel(self, request_id: str) -> bool:
        """Drop a request and free its pages; True if it was held."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None and seq.page_ids:
            self.pages.free(seq.page_ids)
        return seq is not None

    @property
    def num_ready(self) -> int:
        return sum(seq.kv_ready for seq in self.seqs.values())

    def step(self) -> dict[str, list[TokenItem]]:
        """One token for every decoding request, oldest first, grouped by gateway."""
        self._resume()
        out: dict[str, list[TokenItem]] = {}
        for seq in sorted(self._decoding(), key=lambda s: s.arrival):
            if seq.preempted or not self._grow(seq):
                continue
            gateway, item = self._advance(seq)
            out.setdefault(gateway, []).append(item)
        return out

    def _decoding(self) -> list[FakeSeq]:
        return [s for s in self.seqs.values() if s.kv_ready and not s.preempted]

    def _resume(self) -> None:
        for seq in sorted(self.seqs.values(), key=lambda s: s.arrival):
            if seq.preempted:
                if not fits(self.pages.num_free, seq.num_tokens, self.page_size):
                    return  # oldest first: the others wait behind it
                seq.page_ids = self.pages.allocate(pages_to_admit(seq.num_tokens, self.page_size))
                seq.preempted = False

    def _grow(self, seq: FakeSeq) -> bool:
        """Pages for the token this step writes, preempting the newest decoding requests if
        needed; False when seq itself was preempted."""
        extra = pages_to_grow(len(seq.page_ids), seq.num_tokens, self.page_size)
        while not self.pages.can_allocate(extra):
            victim = max(self._decoding(), key=lambda s: s.arrival)
            self.pages.free(victim.page_ids)
            victim.page_ids, victim.preempted = [], True
            if victim is seq:
                return False
        seq.page_ids += self.pages.allocate(extra)
        return True

    def _advance(self, seq: FakeSeq) -> tuple[str, TokenItem]:
        index = seq.num_output
        token = next_token(self.info, seq.digest, index, seq.sampling, self.eos_after)
        top_n = seq.sampling.logprobs
        logprobs = [] if top_n is None else [fake_logprob(self.info, token, index, top_n)]
        seq.num_output += 1
        reason = self._finish_reason(seq, token)
        if reason:
            return self._finish(seq, [token], logprobs, reason, index=index)
        return seq.gateway_id, TokenItem(seq.request_id, index, (token,), tuple(logprobs))

    def _finish_reason(self, seq: FakeSeq, token: int) -> str | None:
        sampling = seq.sampling
        is_stop = token in sampling.stop_token_ids or (
            token == self.info.eos_token_id and not sampling.ignore_eos
        )
        # Stop tokens count only once min_tokens were generated (this token included).
        if is_stop and seq.num_output > sampling.min_tokens:
            return protocol.FINISH_STOP
        if seq.num_output >= sampling.max_tokens or seq.num_tokens >= self.max_total_tokens:
            return protocol.FINISH_LENGTH
        return None

    def _finish(self, seq, token_ids, logprobs, reason, error="", index=None, prompt=()):
        self.cancel(seq.request_id)
        item = TokenItem(
            request_id=seq.request_id,
            index=seq.num_output if index is None else index,
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            prompt_logprobs=prompt,
            finish_reason=reason,
            error=error,
            usage=Usage(seq.num_prompt_tokens, seq.num_output),
        )
        return seq.gateway_id, item
