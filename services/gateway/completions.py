"""Serving one chat or text completion: tokenize, run its sequences, stream (SSE) or collect.

A request runs max(n, best_of) sequences of its prompt (choices.py); a seeded one gives
sequence i the seed + i, as vLLM does, so each choice is reproducible on its own. best_of
returns the n candidates of highest mean token logprob. Tool calls are parsed out of each
choice's text (choice_output.py).
"""

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from services.gateway.choice_output import ChoiceOutput, merge
from services.gateway.choices import Choices
from services.gateway.config import GatewayConfig
from services.gateway.control import ControlPlane
from services.gateway.generation import Generation, Refused, Timing
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_request import (
    CHAT,
    ParsedRequest,
    build_sampling,
    priority_of,
    session_of,
)
from services.gateway.openai_response import (
    DONE_EVENT,
    ChoiceResult,
    ResponseFormat,
    error_body,
    sse_event,
)
from services.gateway.tool_choice import AUTO, NAMED, ForcedCalls
from shared import protocol
from shared.errors import InvalidRequestError
from shared.protocol import SubmitReplyMsg, Usage
from shared.sampling.params import SamplingParams
from shared.tokenizer.tokenizer import Tokenizer
from shared.tool_calls import ToolParser

_REFUSALS = {  # submit reply status → (HTTP status, OpenAI error type)
    protocol.QUEUE_FULL: (429, "rate_limit_exceeded"),
    protocol.NO_WORKERS: (503, "service_unavailable"),
    protocol.EXPIRED: (503, "service_unavailable"),
    protocol.TOO_LONG: (400, "invalid_request_error"),
}
_FAILED = (protocol.FINISH_ERROR, protocol.FINISH_ABORT)
_INT64 = 2**63


def json_error(status: int, message: str, err_type: str, param=None, code=None, headers=None):
    return web.json_response(
        error_body(message, err_type, param, code), status=status, headers=headers
    )


# Texts up to this many characters are tokenized on the event loop (~0.12 ms of the bundled
# model's tokenizer here); longer ones, and chats with tools, in a thread, whose hop took
# 0.4-0.6 ms of a ~10 ms first token on this 2-core VM (waking an idle CPU).
INLINE_CHARS = 512


def _text_chars(parsed: ParsedRequest) -> int:
    """The characters a request's tokenization reads (token ids: none; tools: too many)."""
    if parsed.kind == CHAT:
        if parsed.tools:
            return INLINE_CHARS + 1
        return sum(len(str(m.get("content") or "")) for m in parsed.messages)
    return len(parsed.prompt) if isinstance(parsed.prompt, str) else 0


class CompletionService:
    """Runs chat and text completions for the HTTP routes."""

    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Tokenizer,
        control: ControlPlane,
        metrics: GatewayMetrics,
        tool_parser: type[ToolParser] | None = None,  # the model family's, None: no format
    ):
        self.config, self.tokenizer, self.control, self.metrics = (
            config,
            tokenizer,
            control,
            metrics,
        )
        self.tool_parser = tool_parser

    def max_model_len(self) -> int:
        """The smallest context of the live workers, else the configured / tokenizer limit."""
        lengths = [
            b.max_model_len for role in ("prefill", "decode") for b in self.control.alive(role)
        ]
        return min(
            lengths, default=self.config.max_model_len or self.tokenizer.model_max_length or 2048
        )

    async def tokenize_soon(self, parsed: ParsedRequest) -> list[int]:
        """tokenize(parsed): on the event loop for a short text, in a thread otherwise (chat
        templates and tokenizers take their time on long inputs)."""
        if _text_chars(parsed) <= INLINE_CHARS:
            return self.tokenize(parsed)
        return await asyncio.to_thread(self.tokenize, parsed)

    def tokenize(self, parsed: ParsedRequest) -> list[int]:
        if parsed.kind == CHAT:
            tools = None if parsed.tools is None else list(parsed.tools)
            return self.tokenizer.encode_chat(list(parsed.messages), tools=tools)
        if isinstance(parsed.prompt, str):
            return self.tokenizer.encode(parsed.prompt)
        if max(parsed.prompt) >= self.tokenizer.vocab_size:
            raise InvalidRequestError("prompt", f"token ids must be < {self.tokenizer.vocab_size}")
        return list(parsed.prompt)

    def sampling(self, parsed: ParsedRequest, prompt_ids: list[int]) -> SamplingParams:
        """The request's SamplingParams, checked against the context and the vocabulary; special
        tokens kept in the text when its tool-call parser reads them."""
        sampling = build_sampling(parsed, len(prompt_ids), self.max_model_len())
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise InvalidRequestError("logit_bias", f"token ids must be < {vocab}")
        if getattr(self.output(parsed).parser, "skip_special_tokens", True) is False:
            sampling = dataclasses.replace(sampling, skip_special_tokens=False)
        return sampling

    def model_error(self, model: str) -> web.Response | None:
        if model == self.config.served_model_name:
            return None
        message = f"The model `{model}` does not exist."
        return json_error(404, message, "invalid_request_error", "model", "model_not_found")

    def output(self, parsed: ParsedRequest) -> ChoiceOutput:
        """A fresh output reader for one choice: tool calls parsed when tools may be called."""
        choice = parsed.tool_choice
        if choice.forced:
            return ChoiceOutput(ForcedCalls(choice), calls_end_with_stop=choice.mode == NAMED)
        if choice.mode == AUTO and self.tool_parser is not None:
            return ChoiceOutput(self.tool_parser(list(parsed.tools)))
        return ChoiceOutput()

    def timing(self, headers) -> Timing:
        """The limits of a request arriving now. A batch one (x-tison-priority) may queue
        batch_queue_timeout_s, but no longer than request_timeout_s: placed later, it could
        only time out."""
        config, priority = self.config, priority_of(headers)
        queue_s = config.queue_timeout_s
        if priority == protocol.BATCH:
            queue_s = min(config.batch_queue_timeout_s, config.request_timeout_s)
        return Timing(time.monotonic(), queue_s, config.request_timeout_s, priority)

    def generations(
        self, request, parsed: ParsedRequest, prompt_ids, sampling, timing: Timing, prefix: str
    ) -> list[Generation]:
        """max(n, best_of) sequences of the prompt; their request ids end in -i when several."""
        count = parsed.best_of
        base = f"{prefix}-{uuid.uuid4().hex}"
        session = session_of(request.headers, parsed)
        return [
            Generation(
                self.control,
                self.metrics,
                self.tokenizer,
                base if count == 1 else f"{base}-{i}",
                prompt_ids,
                _seeded(sampling, i),
                session,
                timing,
            )
            for i in range(count)
        ]

    async def serve(self, request: web.Request, parsed: ParsedRequest) -> web.StreamResponse:
        if (error := self.model_error(parsed.model)) is not None:
            return error
        timing = self.timing(request.headers)
        prompt_ids = await self.tokenize_soon(parsed)
        sampling = self.sampling(parsed, prompt_ids)
        prefix = "chatcmpl" if parsed.kind == CHAT else "cmpl"
        gens = self.generations(request, parsed, prompt_ids, sampling, timing, prefix)
        fmt = ResponseFormat.for_request(
            parsed.kind, gens[0].request_id, parsed.model, self.tokenizer
        )
        choices = Choices(gens)
        try:
            try:
                with self.metrics.waiting.track_inprogress():
                    await choices.start()
            except Refused as e:
                return refusal(e.reply)
            echo = self._echo(parsed, prompt_ids)
            with self.metrics.running.track_inprogress():
                if parsed.stream:
                    return await self._stream(request, parsed, fmt, choices, echo)
                return await self._collect(parsed, fmt, choices, echo)
        finally:
            await choices.close()

    def _echo(self, parsed: ParsedRequest, prompt_ids: list[int]) -> str:
        if not parsed.echo:
            return ""
        if isinstance(parsed.prompt, str):
            return parsed.prompt
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    async def _stream(self, request, parsed, fmt, choices: Choices, echo: str):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        n = parsed.n
        want_logprobs = parsed.num_logprobs is not None
        outputs = [self.output(parsed) for _ in range(n)]
        first, sent = [True] * n, [0] * n  # tokens behind the chunks sent, per choice
        num_prompt = choices.generations[0].stream.num_prompt_tokens
        failed = False
        async for i, delta in choices.merged():
            if delta.finish_reason in _FAILED:
                await resp.write(
                    sse_event(error_body(delta.error, "server_error", None, "worker_error"))
                )
                failed = True
                break
            out = outputs[i].feed((echo if first[i] else "") + delta.text)
            finish = delta.finish_reason
            if finish is not None:
                out = merge(out, outputs[i].finish())
                finish = outputs[i].finish_reason(finish)
            sent[i] += delta.tokens
            if not (out.content or out.tool_calls or finish or delta.logprobs or first[i]):
                continue  # the parser holds back what may start a tool call
            so_far = Usage(num_prompt, sum(sent)) if parsed.continuous_usage else None
            logprobs, echoed = delta.logprobs if want_logprobs else None, None
            if want_logprobs and echo and first[i]:
                stream = choices.generations[i].stream
                logprobs = (stream.prompt_logprobs or ()) + delta.logprobs
                echoed = stream.first_prompt_token
            chunk = fmt.chunk(
                i, out, logprobs, finish, first[i], parsed.include_usage, so_far, echoed
            )
            await resp.write(sse_event(chunk))
            first[i] = False
        if not failed and parsed.include_usage:
            await resp.write(sse_event(fmt.usage_chunk(_usage(choices))))
        await resp.write(DONE_EVENT)
        await resp.write_eof()
        return resp

    async def _collect(self, parsed, fmt, choices: Choices, echo: str):
        count = len(choices.generations)
        texts: list[list[str]] = [[] for _ in range(count)]
        logprobs: list[list] = [[] for _ in range(count)]
        async for i, delta in choices.merged():
            texts[i].append(delta.text)
            logprobs[i].extend(delta.logprobs)
        streams = [g.stream for g in choices.generations]
        for stream in streams:
            if stream.finish_reason in _FAILED or stream.finish_reason is None:
                return json_error(503, stream.error, "server_error", None, "worker_error")
        order = _best(logprobs, parsed.n) if count > parsed.n else range(count)
        results = []
        for i in order:
            output, stream = self.output(parsed), streams[i]
            message = output.parse(echo + "".join(texts[i]))
            entries = tuple(logprobs[i]) if parsed.num_logprobs is not None else None
            echoed = None
            if entries is not None and parsed.echo:
                entries, echoed = (
                    (stream.prompt_logprobs or ()) + entries,
                    stream.first_prompt_token,
                )
            results.append(
                ChoiceResult(
                    content=message.content,
                    finish_reason=output.finish_reason(stream.finish_reason),
                    logprobs=entries,
                    tool_calls=message.tool_calls,
                    prompt_logprobs=stream.prompt_logprobs,
                    echoed_token=echoed,
                )
            )
        return web.json_response(fmt.full(results, _usage(choices)))


def _seeded(sampling: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index`'s sampling: seed + index when seeded (wrapped into 64 bits)."""
    if index == 0 or sampling.seed is None:
        return sampling
    seed = (sampling.seed + index + _INT64) % (2 * _INT64) - _INT64
    return dataclasses.replace(sampling, seed=seed)


def _best(logprobs: list[list], n: int) -> list[int]:
    """The n candidates of highest mean token logprob (OpenAI's "log probability per token")."""

    def mean(i: int) -> float:
        entries = logprobs[i]
        return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")

    return sorted(range(len(logprobs)), key=mean, reverse=True)[:n]


def _usage(choices: Choices) -> Usage:
    """The prompt once, every sequence's tokens (best_of candidates count, as OpenAI bills)."""
    streams = [g.stream for g in choices.generations]
    return Usage(streams[0].num_prompt_tokens, sum(s.usage.completion_tokens for s in streams))


def refusal(reply: SubmitReplyMsg) -> web.Response:
    status, err_type = _REFUSALS.get(reply.status, (503, "service_unavailable"))
    headers = None
    if reply.status == protocol.QUEUE_FULL:
        headers = {"Retry-After": str(max(1, round(reply.retry_after_s)))}
    param = "prompt" if reply.status == protocol.TOO_LONG else None
    return json_error(status, reply.reason or reply.status, err_type, param, reply.status, headers)
