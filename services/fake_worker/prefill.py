"""The fake prefill worker: "computes" prompts, then tells the decode worker it is done, with the
first token (which the decode worker publishes: a request's tokens all come from there)."""

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.prefix import FakePrefixCache
from services.fake_worker.tokens import (
    FakeModelInfo,
    fake_logprob,
    fake_prompt_logprobs,
    next_token,
    prompt_digest,
)
from shared import protocol, subjects
from shared.kv.allocator import PageAllocator
from shared.kv.pages import pages_for
from shared.protocol import CancelMsg, KvReadyMsg, PrefillAssignMsg

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    assign: PrefillAssignMsg
    page_ids: list[int]  # its own pages while computing


class FakePrefill:
    """Prefill role: batches every waiting prompt, sleeps prefill_token_s per token, answers."""

    role = "prefill"

    def __init__(self, nc: Client, config: FakeWorkerConfig, info: FakeModelInfo, worker_id: str):
        self.nc, self.config, self.info, self.worker_id = nc, config, info, worker_id
        self.pages = PageAllocator(config.num_pages)
        self.cache = FakePrefixCache(config.page_size, config.num_pages, config.prefix_caching)
        self._jobs: dict[str, _Job] = {}  # request id → job, in arrival order
        self._work = asyncio.Event()

    async def subscribe(self) -> None:
        await self.nc.subscribe(subjects.assign("prefill", self.worker_id), cb=self._on_assign)
        await self.nc.subscribe(subjects.gateway_cancel(), cb=self._on_cancel)

    def load(self) -> dict:
        """Heartbeat load fields."""
        queued = sum(len(job.assign.prompt_token_ids) for job in self._jobs.values())
        return dict(
            queued_tokens=queued,
            running_seqs=len(self._jobs),
            free_pages=self.pages.num_free,
            total_pages=self.pages.num_pages,
        )

    @protocol.on_message(PrefillAssignMsg)
    async def _on_assign(self, assign: PrefillAssignMsg, msg: Msg) -> None:
        # The prompt's pages only: a prefill never writes the KV of the token it samples.
        num_pages = pages_for(len(assign.prompt_token_ids), self.config.page_size)
        if not self.pages.can_allocate(num_pages):
            await self._kv_ready(
                assign,
                KvReadyMsg(assign.request_id, self.worker_id, False, error="prefill KV pool full"),
            )
            return
        self.cache.admit(assign.prompt_token_ids, assign.sampling.cache_salt)
        self._jobs[assign.request_id] = _Job(assign, self.pages.allocate(num_pages))
        self._work.set()

    @protocol.on_message(CancelMsg)
    async def _on_cancel(self, cancel: CancelMsg, msg: Msg) -> None:
        job = self._jobs.pop(cancel.request_id, None)
        if job is not None:
            self.pages.free(job.page_ids)

    async def _kv_ready(self, assign: PrefillAssignMsg, ready: KvReadyMsg) -> None:
        await self.nc.publish(subjects.decode_kv(assign.decode_worker), protocol.encode(ready))

    async def run(self) -> None:
        """Compute all waiting prompts as one batch, repeatedly, until cancelled."""
        while True:
            if not self._jobs:
                self._work.clear()
                await self._work.wait()
                continue
            batch = list(self._jobs)
            num_tokens = sum(len(self._jobs[r].assign.prompt_token_ids) for r in batch)
            await asyncio.sleep(num_tokens * self.config.prefill_token_s)
            done = [self._jobs.pop(r) for r in batch if r in self._jobs]  # skip cancelled
            await self._finish(done)

    async def _finish(self, jobs: list[_Job]) -> None:
        for job in jobs:
            self.pages.free(job.page_ids)
            await self._kv_ready(job.assign, self._ready(job.assign))

    def _ready(self, assign: PrefillAssignMsg) -> KvReadyMsg:
        """The "pages written" message, with the first token (output index 0), its logprobs
        and the prompt's, as the real prefill worker sends them."""
        sampling = assign.sampling
        digest = prompt_digest(assign.prompt_token_ids)
        token = next_token(self.info, digest, 0, sampling, self.config.eos_after)
        top_n = sampling.logprobs
        logprob = None if top_n is None else fake_logprob(self.info, token, 0, top_n)
        prompt = fake_prompt_logprobs(self.info, assign.prompt_token_ids, sampling.prompt_logprobs)
        return KvReadyMsg(
            assign.request_id,
            self.worker_id,
            True,
            first_token_id=token,
            first_logprob=logprob,
            prompt_logprobs=prompt,
        )
