"""Serving `POST /v1/responses`: a chat turn run like a chat completion (one choice), shaped as
OpenAI's Responses API (responses_format.py); its conversation is stored for a later
`previous_response_id` unless `store` is false."""

import json

from aiohttp import web

from services.gateway.choice_output import merge
from services.gateway.choices import Choices
from services.gateway.completions import CompletionService, json_error, refusal
from services.gateway.generation import Refused
from services.gateway.responses_format import (
    ResponseEvents,
    ResponseObject,
    output_items,
    status_of,
)
from services.gateway.responses_request import (
    ResponsesRequest,
    ResponseStore,
    output_messages,
    parse_responses,
)
from shared import protocol

_FAILED = (protocol.FINISH_ERROR, protocol.FINISH_ABORT)


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


class ResponsesService:
    def __init__(self, completions: CompletionService, store: ResponseStore | None = None):
        self.completions = completions
        self.store = store or ResponseStore()

    async def serve(self, request: web.Request, body) -> web.StreamResponse:
        req = parse_responses(body, self.store)
        chat, svc = req.chat, self.completions
        if (error := svc.model_error(chat.model)) is not None:
            return error
        timing = svc.timing(request.headers)
        prompt_ids = await svc.tokenize_soon(chat)
        sampling = svc.sampling(chat, prompt_ids)
        choices = Choices(svc.generations(request, chat, prompt_ids, sampling, timing, "resp"))
        response = ResponseObject(chat.model, req.echo, req.previous_response_id, chat.max_tokens)
        metrics = svc.metrics
        try:
            try:
                with metrics.waiting.track_inprogress():
                    await choices.start()
            except Refused as e:
                return refusal(e.reply)
            with metrics.running.track_inprogress():
                if chat.stream:
                    return await self._stream(request, req, response, choices)
                return await self._collect(req, response, choices)
        finally:
            await choices.close()

    async def _collect(self, req: ResponsesRequest, response, choices: Choices):
        texts = []
        async for _, delta in choices.merged():
            texts.append(delta.text)
        stream = choices.generations[0].stream
        if stream.finish_reason in _FAILED or stream.finish_reason is None:
            return json_error(503, stream.error, "server_error", None, "worker_error")
        message = self.completions.output(req.chat).parse("".join(texts))
        self._keep(req, response.id, message.content, message.tool_calls)
        items = output_items(message.content, message.tool_calls)
        return web.json_response(
            response.body(status_of(stream.finish_reason), items, stream.usage)
        )

    async def _stream(self, request, req: ResponsesRequest, response, choices: Choices):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        events, output = ResponseEvents(response), self.completions.output(req.chat)
        for event in events.start():
            await resp.write(_sse(event))
        stream = choices.generations[0].stream
        async for _, delta in choices.merged():
            if delta.finish_reason in _FAILED:
                for event in events.failed(delta.error):
                    await resp.write(_sse(event))
                break
            out = output.feed(delta.text)
            if delta.finish_reason is not None:
                out = merge(out, output.finish())
            for event in events.feed(out):
                await resp.write(_sse(event))
            if delta.finish_reason is not None:
                for event in events.finish(delta.finish_reason, stream.usage):
                    await resp.write(_sse(event))
                self._keep(req, response.id, events.text or None, events.calls())
        await resp.write_eof()
        return resp

    def _keep(self, req: ResponsesRequest, response_id: str, text, calls) -> None:
        if req.store:
            self.store.put(response_id, req.history + tuple(output_messages(text, calls)))
