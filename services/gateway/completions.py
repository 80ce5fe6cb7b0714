"""Serving one completion request: tokenize, submit, then stream (SSE) or collect the output.

Whatever way the request ends here (finished, stop string, client gone, worker dead, timeout),
the `finally` of `serve` publishes a cancel unless the decode worker finished it itself, so
both workers free its pages.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from services.gateway.config import GatewayConfig
from services.gateway.control import ControlPlane, OpenRequest
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_request import CHAT, ParsedRequest, build_sampling, session_of
from services.gateway.openai_response import (
    DONE_EVENT,
    ResponseFormat,
    error_body,
    sse_event,
)
from services.gateway.request_state import Delta, RequestStream, coalesce
from shared import protocol
from shared.errors import InvalidRequestError
from shared.protocol import SubmitMsg, SubmitReplyMsg, Usage
from shared.tokenizer.tokenizer import Tokenizer

_REFUSALS = {  # submit reply status → (HTTP status, OpenAI error type)
    protocol.QUEUE_FULL: (429, "rate_limit_exceeded"),
    protocol.NO_WORKERS: (503, "service_unavailable"),
    protocol.EXPIRED: (503, "service_unavailable"),
    protocol.TOO_LONG: (400, "invalid_request_error"),
}
_ENDED_BY_WORKER = (protocol.FINISH_STOP, protocol.FINISH_LENGTH)


def json_error(status: int, message: str, err_type: str, param=None, code=None, headers=None):
    return web.json_response(
        error_body(message, err_type, param, code), status=status, headers=headers
    )


class CompletionService:
    """Runs chat and text completions for the HTTP routes."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Tokenizer,
        control: ControlPlane,
        metrics: GatewayMetrics,
    ):
        self.config, self.tokenizer, self.control, self.metrics = (
            config,
            tokenizer,
            control,
            metrics,
        )

    def max_model_len(self) -> int:
        """The smallest context of the live workers, else the configured / tokenizer limit."""
        lengths = [
            b.max_model_len for role in ("prefill", "decode") for b in self.control.alive(role)
        ]
        return min(
            lengths, default=self.config.max_model_len or self.tokenizer.model_max_length or 2048
        )

    def tokenize(self, parsed: ParsedRequest) -> list[int]:
        if parsed.kind == CHAT:
            tools = None if parsed.tools is None else list(parsed.tools)
            return self.tokenizer.encode_chat(list(parsed.messages), tools=tools)
        if isinstance(parsed.prompt, str):
            return self.tokenizer.encode(parsed.prompt)
        if max(parsed.prompt) >= self.tokenizer.vocab_size:
            raise InvalidRequestError("prompt", f"token ids must be < {self.tokenizer.vocab_size}")
        return list(parsed.prompt)

    async def serve(self, request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
        if parsed.model != self.config.served_model_name:
            message = f"The model `{parsed.model}` does not exist."
            return json_error(404, message, "invalid_request_error", "model", "model_not_found")
        arrived = time.monotonic()
        # chat templates and tokenizers take their time on long inputs: not on the event loop
        prompt_ids = await asyncio.to_thread(self.tokenize, parsed)
        sampling = build_sampling(parsed, len(prompt_ids), self.max_model_len())
        request_id = f"{'chatcmpl' if parsed.kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        stream = RequestStream(self.tokenizer, prompt_ids, sampling)
        fmt = ResponseFormat.for_request(parsed.kind, request_id, parsed.model, self.tokenizer)
        submit = SubmitMsg(
            request_id,
            self.control.gateway_id,
            tuple(prompt_ids),
            sampling,
            deadline=time.time() + self.config.queue_timeout_s,
            session_id=session_of(request.headers, parsed),
        )
        opened = self.control.open(request_id)
        try:
            with self.metrics.waiting.track_inprogress():
                reply = await self.control.submit(submit, self.config.queue_timeout_s + 5)
            if reply.status != protocol.ACCEPTED:
                return _refusal(reply)
            with self.metrics.running.track_inprogress():
                deltas = self._deltas(opened, stream, arrived)
                if parsed.stream:
                    return await self._stream(request, parsed, fmt, stream, deltas)
                return await self._collect(fmt, stream, deltas, parsed)
        finally:
            self.control.forget(request_id)
            if stream.finish_reason not in _ENDED_BY_WORKER or stream.stopped_by_string:
                await self.control.cancel(request_id, stream.error or "ended by the gateway")

    async def _deltas(
        self, opened: OpenRequest, stream: RequestStream, arrived: float
    ) -> AsyncIterator[Delta]:
        """Deltas until the request ends; records TTFT, ITL and E2E. Items that queued up while
        the previous delta was being written leave as one delta (one SSE event)."""
        deadline = arrived + self.config.request_timeout_s
        last_token_at, seen = None, 0
        while not stream.done:
            try:
                items = await _get_queued(opened, deadline - time.monotonic())
            except asyncio.TimeoutError:
                yield stream.fail(f"no output within {self.config.request_timeout_s} s")
                return
            deltas = [d for d in map(stream.accept, items) if d is not None]
            now = time.monotonic()
            if stream.num_output > seen:
                new, seen = stream.num_output - seen, stream.num_output
                if last_token_at is None:
                    self.metrics.ttft.observe(now - arrived)
                else:
                    for _ in range(new):
                        self.metrics.itl.observe((now - last_token_at) / new)
                last_token_at = now
            for delta in coalesce(deltas):
                yield delta
        self.metrics.e2e.observe(time.monotonic() - arrived)

    async def _stream(self, request, parsed, fmt, stream, deltas) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        want_logprobs = stream.sampling.logprobs is not None
        first, sent = True, 0  # tokens behind the chunks sent
        async for delta in deltas:
            if delta.finish_reason in (protocol.FINISH_ERROR, protocol.FINISH_ABORT):
                await resp.write(
                    sse_event(error_body(delta.error, "server_error", None, "worker_error"))
                )
                break
            logprobs = delta.logprobs if want_logprobs else None
            sent += delta.tokens
            so_far = Usage(stream.num_prompt_tokens, sent) if parsed.continuous_usage else None
            chunk = fmt.chunk(
                delta.text, logprobs, delta.finish_reason, first, parsed.include_usage, so_far
            )
            await resp.write(sse_event(chunk))
            first = False
        else:
            if parsed.include_usage:
                await resp.write(sse_event(fmt.usage_chunk(stream.usage)))
        await resp.write(DONE_EVENT)
        await resp.write_eof()
        return resp

    async def _collect(self, fmt, stream, deltas, parsed) -> web.Response:
        texts, logprobs = [], []
        async for delta in deltas:
            texts.append(delta.text)
            logprobs.extend(delta.logprobs)
        if stream.finish_reason not in _ENDED_BY_WORKER:
            return json_error(503, stream.error, "server_error", None, "worker_error")
        entries = logprobs if stream.sampling.logprobs is not None else None
        return web.json_response(
            fmt.full("".join(texts), entries, stream.finish_reason, stream.usage)
        )


async def _get_queued(opened: OpenRequest, timeout_s: float) -> list:
    """Every item queued now, waiting up to `timeout_s` for one when there is none."""
    queue = opened.items
    items = [] if queue.qsize() else [await asyncio.wait_for(queue.get(), max(timeout_s, 0.0))]
    while queue.qsize():
        items.append(queue.get_nowait())
    return items


def _refusal(reply: SubmitReplyMsg) -> web.Response:
    status, err_type = _REFUSALS.get(reply.status, (503, "service_unavailable"))
    headers = None
    if reply.status == protocol.QUEUE_FULL:
        headers = {"Retry-After": str(max(1, round(reply.retry_after_s)))}
    param = "prompt" if reply.status == protocol.TOO_LONG else None
    return json_error(status, reply.reason or reply.status, err_type, param, reply.status, headers)
