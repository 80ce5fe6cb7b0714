"""The fake decode worker: reserves pages on assignment, then decodes its batch step by step."""

import asyncio
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.fake_worker.batch import DecodeBatch
from services.fake_worker.config import FakeWorkerConfig
from services.fake_worker.prefix import FakePrefixCache
from services.fake_worker.tokens import FakeModelInfo
from shared import protocol, subjects
from shared.kv.allocator import PageAllocator
from shared.protocol import (
    CancelMsg,
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    KvReadyMsg,
    TokenItem,
    TokensMsg,
)

log = logging.getLogger(__name__)


class FakeDecode:
    """Decode role: owns a DecodeBatch; publishes one TokensMsg per step per gateway."""

    role = "decode"

    def __init__(self, nc: Client, config: FakeWorkerConfig, info: FakeModelInfo, worker_id: str):
        self.nc, self.config, self.worker_id = nc, config, worker_id
        pages = PageAllocator(config.num_pages)
        self.batch = DecodeBatch(info, pages, config.page_size, config.eos_after)
        self.cache = FakePrefixCache(config.page_size, config.num_pages, config.prefix_caching)
        self._work = asyncio.Event()

    async def subscribe(self) -> None:
        await self.nc.subscribe(subjects.assign("decode", self.worker_id), cb=self._on_assign)
        await self.nc.subscribe(subjects.decode_kv(self.worker_id), cb=self._on_kv)
        await self.nc.subscribe(subjects.gateway_cancel(), cb=self._on_cancel)

    def load(self) -> dict:
        """Heartbeat load fields."""
        pages = self.batch.pages
        return dict(
            running_seqs=len(self.batch.seqs),
            free_pages=pages.num_free,
            total_pages=pages.num_pages,
        )

    @protocol.on_message(DecodeAssignMsg)
    async def _on_assign(self, assign: DecodeAssignMsg, msg: Msg) -> None:
        page_ids = self.batch.reserve(assign)
        if page_ids is None:
            reply = DecodeAssignReplyMsg(assign.request_id, False, reason="KV pool full")
        else:
            self.cache.admit(assign.prompt_token_ids, assign.sampling.cache_salt)
            reply = DecodeAssignReplyMsg(assign.request_id, True, page_ids)
        if msg.reply:
            await self.nc.publish(msg.reply, protocol.encode(reply))

    @protocol.on_message(KvReadyMsg)
    async def _on_kv(self, ready: KvReadyMsg, msg: Msg) -> None:
        published = self.batch.kv_ready(ready)  # the first token, at once: not with a step
        if published is not None:
            await self._publish(*published)
        self._work.set()

    @protocol.on_message(CancelMsg)
    async def _on_cancel(self, cancel: CancelMsg, msg: Msg) -> None:
        self.batch.cancel(cancel.request_id)

    async def _publish(self, gateway_id: str, *items: TokenItem) -> None:
        body = protocol.encode(TokensMsg(self.worker_id, items))
        await self.nc.publish(subjects.gateway_tokens(gateway_id), body)

    async def run(self) -> None:
        """The step loop: one token per ready request per step, until cancelled."""
        while True:
            if not self.batch.num_ready:
                self._work.clear()
                await self._work.wait()
                continue
            for gateway_id, items in self.batch.step().items():
                await self._publish(gateway_id, *items)
            await asyncio.sleep(self.config.step_s)  # also lets assignments and cancels in
