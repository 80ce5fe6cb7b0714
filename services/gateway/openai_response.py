"""OpenAI response bodies and SSE chunks, exactly in OpenAI's shapes. Pure."""

import json
import time
from dataclasses import dataclass

from services.gateway.openai_request import CHAT
from shared.protocol import TokenLogprob, Usage
from shared.tokenizer.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"


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

    def full(self, text: str, logprobs, finish_reason: str, usage: Usage) -> dict:
        """A non-streamed response."""
        choice = {"index": 0, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope(self._object, [choice]), "usage": usage_body(usage)}

    def chunk(
        self,
        text: str,
        logprobs,
        finish_reason: str | None,
        first: bool,
        usage_field: bool,
        usage: Usage | None = None,
    ) -> dict:
        """One streamed chunk; `usage_field` adds `"usage"`: the usage so far when given
        (continuous_usage_stats), else null (include_usage was asked)."""
        choice = {"index": 0, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        if self.kind == CHAT:
            choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if usage_field:
            body["usage"] = None if usage is None else usage_body(usage)
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk when include_usage was asked: no choices, the usage."""
        obj = "chat.completion.chunk" if self.kind == CHAT else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_body(usage)}

    def logprobs(self, entries) -> dict | None:
        """OpenAI's logprobs object for these tokens, None when logprobs were not asked."""
        if entries is None:
            return None
        if self.kind == CHAT:
            return {"content": [self._chat_entry(e) for e in entries]}
        return {
            "tokens": [self._token(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                {self._token(t): lp for t, lp in zip(e.top_ids, e.top_logprobs, strict=True)}
                for e in entries
            ],
        }

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
