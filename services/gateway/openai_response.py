"""OpenAI response bodies and SSE chunks, exactly in OpenAI's shapes. Pure."""

import json
import time
from dataclasses import dataclass

from services.gateway.openai_request import CHAT
from shared.protocol import TokenLogprob, Usage
from shared.tokenizer.tokenizer import Tokenizer
from shared.tool_calls import StreamDelta, ToolCall, ToolCallDelta

DONE_EVENT = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice: its message (or text) and how it ended."""

    content: str | None
    finish_reason: str
    logprobs: tuple | None = None  # TokenLogprobs when logprobs were asked
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_logprobs: tuple | None = None  # TokenLogprobs of prompt tokens 1.. when asked
    echoed_token: int | None = None  # echo with logprobs: the first prompt token (no logprob)


def _tool_call(call: ToolCall) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _tool_call_delta(delta: ToolCallDelta) -> dict:
    out: dict = {"index": delta.index}
    function: dict = {"arguments": delta.arguments}
    if delta.id is not None:
        out.update(id=delta.id, type="function")
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None):
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def usage_body(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(frozen=True)
class ResponseFormat:
    """Shapes the responses of one request (chat or completion)."""

    kind: str  # CHAT or COMPLETION
    request_id: str
    model: str
    tokenizer: Tokenizer
    created: int = 0

    @classmethod
    def for_request(cls, kind: str, request_id: str, model: str, tokenizer: Tokenizer):
        return cls(kind, request_id, model, tokenizer, int(time.time()))

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == CHAT else "text_completion"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(self, index: int, output: ChoiceResult) -> dict:
        """One choice of a non-streamed response."""
        body = {
            "index": index,
            "logprobs": self.logprobs(output.logprobs, output.echoed_token),
            "finish_reason": output.finish_reason,
        }
        if self.kind == CHAT:
            message = {"role": "assistant", "content": output.content}
            if output.tool_calls:
                message["tool_calls"] = [_tool_call(c) for c in output.tool_calls]
            body["message"] = message
        else:
            body["text"] = output.content or ""
            if output.prompt_logprobs is not None:
                body["prompt_logprobs"] = self.prompt_logprobs(output.prompt_logprobs)
        return body

    def full(self, outputs: list[ChoiceResult], usage: Usage) -> dict:
        """A non-streamed response of these choices."""
        choices = [self.choice(i, out) for i, out in enumerate(outputs)]
        body = {**self._envelope(self._object, choices), "usage": usage_body(usage)}
        if self.kind == CHAT and outputs and outputs[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(outputs[0].prompt_logprobs)
        return body

    def chunk(
        self,
        index: int,
        delta: StreamDelta,
        logprobs,
        finish_reason: str | None,
        first: bool,
        usage_field: bool,
        usage: Usage | None = None,
        echoed_token: int | None = None,
    ) -> dict:
        """One streamed chunk of choice `index`; `usage_field` adds `"usage"`: the usage so far
        when given (continuous_usage_stats), else null (include_usage was asked)."""
        choice = {
            "index": index,
            "logprobs": self.logprobs(logprobs, echoed_token),
            "finish_reason": finish_reason,
        }
        if self.kind == CHAT:
            out: dict = {"role": "assistant"} if first else {}
            if not delta.tool_calls:
                out["content"] = delta.content
            elif delta.content or first:
                out["content"] = delta.content or None
            if delta.tool_calls:
                out["tool_calls"] = [_tool_call_delta(d) for d in delta.tool_calls]
            choice["delta"] = out
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = delta.content
            body = self._envelope("text_completion", [choice])
        if usage_field:
            body["usage"] = None if usage is None else usage_body(usage)
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk when include_usage was asked: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_body(usage)}

    def logprobs(self, entries, echoed_token: int | None = None) -> dict | None:
        """OpenAI's logprobs object for these tokens, None when logprobs were not asked.
        echoed_token: a completion's echoed first prompt token, which leads with null
        logprobs (nothing precedes it)."""
        if entries is None:
            return None
        if self.kind == CHAT:
            return {"content": [self._chat_entry(e) for e in entries]}
        lead = [] if echoed_token is None else [echoed_token]
        return {
            "tokens": [self._token(t) for t in lead] + [self._token(e.token_id) for e in entries],
            "token_logprobs": [None] * len(lead) + [e.logprob for e in entries],
            "top_logprobs": [None] * len(lead)
            + [
                {self._token(t): lp for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
                for e in entries
            ],
        }

    def prompt_logprobs(self, entries) -> list:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token a map of
        token id → {logprob, rank, decoded_token}: the token's own and its position's top-n."""
        out: list = [None]
        for e in entries:
            top = {
                str(t): {"logprob": lp, "rank": r, "decoded_token": self._token(t)}
                for r, (t, lp) in enumerate(zip(e.top_ids, e.top_logprobs, strict=True), 1)
            }
            top.setdefault(
                str(e.token_id),
                {"logprob": e.logprob, "rank": None, "decoded_token": self._token(e.token_id)},
            )
            out.append(top)
        return out

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        token = self._token(entry.token_id)
        top = [
            {"token": (t := self._token(i)), "logprob": lp, "bytes": list(t.encode())}
            for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ]
        return {
            "token": token,
            "logprob": entry.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": top,
        }

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
