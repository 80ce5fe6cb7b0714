"""Decode role: reserves pages for a prompt that a prefill worker computes, then decodes it with
the rest of the batch, publishing one TokensMsg per step per gateway. It publishes every token
of its requests: the prefill worker's first token too, on receipt of the KV, so the gateway gets
each request's tokens from one publisher, in order."""

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.worker.loop import EngineLoop
from services.worker.messages import token_item
from shared import protocol, subjects
from shared.engine.engine import Reservation, StepOutput
from shared.engine.request import FinishReason
from shared.errors import TisonError
from shared.protocol import (
    CancelMsg,
    DecodeAssignMsg,
    DecodeAssignReplyMsg,
    GatewayBeatMsg,
    KVPool,
    KvReadyMsg,
    TokenItem,
    TokensMsg,
)

log = logging.getLogger(__name__)
ORPHAN_BEATS = 3  # a gateway silent this many beat intervals is gone
ORPHAN_CHECK_S = 0.5
ORPHAN_DEFAULT_BEAT_S = 1.0  # a gateway not heard beating yet: its assignment counts as a beat


class DecodeRole:
    role = "decode"

    def __init__(
        self,
        nc: Client,
        loop: EngineLoop,
        worker_id: str,
        pools: tuple[KVPool, ...],  # where prefill workers write our pages: one a --dp rank
        kv_servers: tuple = (),  # its network KV servers (TcpKVServer, DistKVServer)
        lease_s: float = 120.0,  # a reservation whose KV has not come by then is dropped
    ):
        self.nc, self.loop, self.worker_id = nc, loop, worker_id
        self.engine = loop.engine
        self.pools = pools
        self.kv_servers = kv_servers
        self.lease_s = lease_s
        self.gateways: dict[str, str] = {}  # request id -> gateway that streams it
        # gateway -> (when last heard of, its beat interval): its own beat, or an assignment
        self.gateway_seen: dict[str, tuple[float, float]] = {}

    async def subscribe(self) -> None:
        await self.nc.subscribe(
            subjects.assign("decode", self.worker_id), cb=self.loop.in_tasks(self._on_assign)
        )
        await self.nc.subscribe(
            subjects.decode_kv(self.worker_id), cb=self.loop.in_tasks(self._on_kv)
        )
        await self.nc.subscribe(subjects.gateway_cancel(), cb=self.loop.in_tasks(self._on_cancel))
        await self.nc.subscribe(subjects.all_gateway_heartbeats(), cb=self._on_gateway_beat)
        self.loop.handlers.spawn(self._cancel_orphans())

    @protocol.on_message(DecodeAssignMsg)
    async def _on_assign(self, assign: DecodeAssignMsg, msg: Msg) -> None:
        rid = assign.request_id
        # The prefill worker starts once this is answered: it is on the request's time to first
        # token, so it runs while the step computes rather than after it, in one command.
        reserved, new, reason = await self.loop.call_now(self._reserve, assign)
        if new:
            self.loop.handlers.spawn(self._expire(rid))
        if reserved is None:
            reply = DecodeAssignReplyMsg(rid, False, reason=reason)
        else:
            self.gateways[rid] = assign.gateway_id
            interval = self.gateway_seen.get(assign.gateway_id, (0.0, ORPHAN_DEFAULT_BEAT_S))[1]
            self.gateway_seen[assign.gateway_id] = (time.monotonic(), interval)
            reply = DecodeAssignReplyMsg(
                rid, True, reserved.page_ids, self.pools[reserved.dp_rank],
                cached_tokens=reserved.cached_tokens,
                chunk_page_ids=reserved.chunk_page_ids,
                chunk_first_page=reserved.chunk_first_page,
            )  # fmt: skip
        if msg.reply:
            await self.nc.publish(msg.reply, protocol.encode(reply))
        if reserved is not None and assign.prefill_here:  # its first token leaves with our steps
            await self.loop.call(self.engine.start_local, rid)

    def _reserve(self, assign: DecodeAssignMsg) -> tuple[Reservation | None, bool, str]:
        """(the reservation or None, whether it is new, why not). It adds
        a request and takes free pages only, as EngineLoop.call_now requires. A retry from the
        same gateway gets the pages it was given before."""
        rid = assign.request_id
        reserved = self.engine.reservation(rid)
        if reserved is not None and self.gateways.get(rid) == assign.gateway_id:
            log.info("request %s: reserved already, the same pages again", rid)
            return reserved, False, ""
        try:
            reserved = self.engine.reserve(
                rid, list(assign.prompt_token_ids), assign.sampling, assign.background
            )
        except TisonError as e:
            return None, False, str(e)
        return reserved, reserved is not None, "" if reserved is not None else "KV pool full"

    @protocol.on_message(GatewayBeatMsg)
    async def _on_gateway_beat(self, beat: GatewayBeatMsg, msg: Msg) -> None:
        self.gateway_seen[beat.gateway_id] = (time.monotonic(), beat.interval_s)

    async def _cancel_orphans(self) -> None:
        """Cancels the requests of gateways silent for ORPHAN_BEATS beats (crashed: no client
        reads their tokens, which would otherwise run to max_tokens holding their pages)."""
        while True:
            await asyncio.sleep(ORPHAN_CHECK_S)
            now = time.monotonic()
            gone = {
                gid for gid, (seen, interval) in self.gateway_seen.items()
                if now - seen > ORPHAN_BEATS * interval
            }  # fmt: skip
            for rid in [r for r, gid in self.gateways.items() if gid in gone]:
                log.warning("request %s: gateway %s is gone; cancelled", rid, self.gateways[rid])
                del self.gateways[rid]
                await self.loop.call(self.engine.abort, rid)
            for gid in gone - set(self.gateways.values()):
                del self.gateway_seen[gid]

    async def _expire(self, request_id: str) -> None:
        """Drops the reservation if its KV has not come within the lease (its prefill worker
        died, the scheduler gave up on it): no page stays held for nothing."""
        await asyncio.sleep(self.lease_s)
        if await self.loop.call(self.engine.reservation, request_id) is not None:
            log.warning("request %s: no KV within %.0f s; reservation dropped", request_id,
                        self.lease_s)  # fmt: skip
            self.gateways.pop(request_id, None)
            await self.loop.call(self.engine.abort, request_id)

    @protocol.on_message(KvReadyMsg)
    async def _on_kv(self, ready: KvReadyMsg, msg: Msg) -> None:
        rid = ready.request_id
        if rid not in self.gateways:
            return  # cancelled meanwhile
        error = (ready.error or "prefill failed") if not ready.ok else self._missing_kv(rid)
        if error:
            failed = await self.loop.call(self._fail, rid, error)
            if failed is not None:
                await self._publish_items([(rid, failed)])
            return
        # The first token leaves now, not after the step running meanwhile (time to first token).
        token, logprob = ready.first_token_id, ready.first_logprob
        logprobs = () if logprob is None else (logprob,)
        first = TokenItem(rid, 0, (token,), logprobs, prompt_logprobs=ready.prompt_logprobs)
        await self._publish_items([(rid, first)])
        ended = await self.loop.call(self._start, rid, token, logprob, ready.prompt_logprobs)
        if ended is not None:
            await self._publish_items([(rid, ended)])

    # The two below run on the engine between steps: the item they return is the request's state
    # then. Read after the await, a step running meanwhile may have decoded (and ended) it: its
    # own item would then come with an index the gateway has not reached.

    def _fail(self, request_id: str, error: str) -> TokenItem | None:
        """Ends the request with an error; its last item, None if it is gone."""
        req = self.engine.requests.get(request_id)
        self.engine.finish(request_id, FinishReason.ERROR)
        return None if req is None else token_item(req, [], [], error)

    def _start(self, request_id: str, token: int, logprob, prompt_logprobs) -> TokenItem | None:
        """Decodes the request from its first token on; its last item if that token ended it."""
        req = self.engine.start_remote(request_id, token, logprob, prompt_logprobs)
        return token_item(req, [], []) if req is not None and req.finished else None

    def _missing_kv(self, request_id: str) -> str:
        """Over a network transport each prefill rank streams its own part: all of the prompt's
        KV must have come (a rank whose connection broke cannot tell rank 0), whichever server
        took it. "" when complete, or by shm."""
        got = self._take_received(request_id)
        want = self.engine.handoff_bytes(request_id)
        return f"KV incomplete: {got} of {want} bytes arrived" if got and got != want else ""

    def _take_received(self, request_id: str) -> int:
        """Payload bytes the KV servers wrote for the request; they forget it."""
        return sum(server.take_received(request_id) for server in self.kv_servers)

    @protocol.on_message(CancelMsg)
    async def _on_cancel(self, cancel: CancelMsg, msg: Msg) -> None:
        self._take_received(cancel.request_id)
        if self.gateways.pop(cancel.request_id, None) is not None:
            await self.loop.call(self.engine.abort, cancel.request_id)

    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        """Publishes this step's tokens: one message per gateway."""
        items = []
        for out in outputs:
            rid = out.request.request_id
            if not out.new_token_ids and not out.finished:
                continue  # a prompt chunk's logprobs (local prefill): they go with token 0
            if rid in self.gateways:
                error = (
                    "engine step failed" if out.request.finish_reason == FinishReason.ERROR else ""
                )
                items.append(
                    (rid, token_item(out.request, out.new_token_ids, out.new_logprobs, error))
                )
        await self._publish_items(items, from_step=True)

    async def _publish_items(
        self, items: list[tuple[str, TokenItem]], from_step: bool = False
    ) -> None:
        """One TokensMsg per gateway; stamped with the step's times if a step made the items."""
        by_gateway: dict[str, list[TokenItem]] = {}
        for rid, item in items:
            ends = item.finish_reason is not None
            gateway = self.gateways.pop(rid, None) if ends else self.gateways.get(rid)
            if gateway is not None:  # else cancelled meanwhile
                by_gateway.setdefault(gateway, []).append(item)
        step_s, cycle_s = (self.loop.step_s, self.loop.cycle_s) if from_step else (0.0, 0.0)
        for gateway, batch in by_gateway.items():
            tokens = TokensMsg(self.worker_id, tuple(batch), step_s, cycle_s, time.time())
            await self.nc.publish(subjects.gateway_tokens(gateway), protocol.encode(tokens))
