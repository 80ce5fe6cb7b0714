"""Prefill role: computes prompts (chunked, batched), streams each layer's KV into the decode
worker's reserved pages as it is computed, then sends "pages written" with the first token to
the decode worker, which publishes it to the gateway. A colocated worker hands its own requests
to its engine."""

import logging

from nats.aio.client import Client
from nats.aio.msg import Msg

from services.worker.loop import EngineLoop
from shared import protocol, subjects
from shared.engine.engine import StepOutput
from shared.engine.request import FinishReason
from shared.protocol import CancelMsg, KvReadyMsg, PrefillAssignMsg
from shared.transfer.handoff import KVHandoff

log = logging.getLogger(__name__)


class PrefillRole:
    role = "prefill"

    def __init__(
        self,
        nc: Client,
        loop: EngineLoop,
        worker_id: str,
        handoff: KVHandoff,
        local_decode_id: str | None = None,
    ):
        self.nc, self.loop, self.worker_id = nc, loop, worker_id
        self.engine = loop.engine
        self.handoff = handoff
        self.local_decode_id = local_decode_id  # colocated: our own decode role's id
        self.jobs: dict[str, PrefillAssignMsg] = {}

    async def subscribe(self) -> None:
        await self.nc.subscribe(
            subjects.assign("prefill", self.worker_id), cb=self.loop.in_tasks(self._on_assign)
        )
        await self.nc.subscribe(subjects.gateway_cancel(), cb=self.loop.in_tasks(self._on_cancel))

    @protocol.on_message(PrefillAssignMsg)
    async def _on_assign(self, assign: PrefillAssignMsg, msg: Msg) -> None:
        rid = assign.request_id
        if assign.decode_worker == self.local_decode_id:
            await self.loop.call(self.engine.start_local, rid)  # pages are ours already
            return
        try:
            self.handoff.add(
                rid, assign.page_ids, assign.decode_kv, assign.decode_cached_tokens,
                assign.decode_chunk_page_ids, assign.decode_chunk_first_page,
            )  # fmt: skip
            prompt = list(assign.prompt_token_ids)
            await self.loop.call(
                self.engine.add_request, rid, prompt, assign.sampling, True, assign.background
            )
        except Exception as e:  # bad layout, unreachable peer, invalid prompt: fail it alone
            self.handoff.drop(rid)
            await self._kv_ready(assign, KvReadyMsg(rid, self.worker_id, False, error=str(e)))
            return
        self.jobs[rid] = assign

    @protocol.on_message(CancelMsg)
    async def _on_cancel(self, cancel: CancelMsg, msg: Msg) -> None:
        if self.jobs.pop(cancel.request_id, None) is not None:
            self.handoff.drop(cancel.request_id)
            await self.loop.call(self.engine.abort, cancel.request_id)

    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if not out.finished:  # a chunk's prompt logprobs: they leave with the first token
                continue
            assign = self.jobs.pop(out.request.request_id, None)
            if assign is None:
                continue
            if out.request.finish_reason == FinishReason.ERROR:
                self.handoff.drop(assign.request_id)
                error = "prefill step failed"
            else:
                error = self.handoff.finish(assign.request_id)
            await self._kv_ready(assign, self._ready(out, error))

    def _ready(self, out: StepOutput, error: str | None) -> KvReadyMsg:
        """The "pages written" message with the first token, its logprobs and the prompt's
        (computed at every position: the engine skips cache hits for them, and the handoff
        only leaves out the pages the decode worker has cached), or the failure."""
        rid = out.request.request_id
        if error:
            return KvReadyMsg(rid, self.worker_id, False, error=error)
        return KvReadyMsg(
            rid,
            self.worker_id,
            True,
            first_token_id=out.new_token_ids[0],
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            prompt_logprobs=tuple(out.request.prompt_logprobs),
        )

    async def _kv_ready(self, assign: PrefillAssignMsg, ready: KvReadyMsg) -> None:
        await self.nc.publish(subjects.decode_kv(assign.decode_worker), protocol.encode(ready))
