"""OpenAI request bodies → what the gateway runs. Pure: raises InvalidRequestError(field, problem).

Covers `/v1/chat/completions` and `/v1/completions` with OpenAI's sampling fields (`n`,
`best_of`, `echo`, `logit_bias`, `logprobs` included) plus vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens` and
`prompt_logprobs`; tools (tool_choice.py) and structured outputs (structured_request.py) have
modules of their own. `suffix` is refused with a 400.
A session for the scheduler's affinity is the x-session-affinity header, else the body's
`session_id` (an extension) or OpenAI's `user`. The x-tison-priority header (`interactive`, the
default, or `batch`, any case) picks the scheduler's admission lane.
"""

from dataclasses import dataclass
from typing import Any

from services.gateway.structured_request import forced_json, parse_structured
from services.gateway.tool_choice import ToolChoice, forced_schema, parse_tools
from shared import protocol
from shared.errors import InvalidRequestError, PromptTooLongError
from shared.sampling.params import MAX_LOGPROBS, SamplingParams
from shared.sampling.structured import StructuredOutput

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_N = 128  # choices (or best_of candidates) a request may ask for, as vLLM bounds them
CHAT, COMPLETION = "chat", "completion"
SESSION_HEADER = "x-session-affinity"
PRIORITY_HEADER = "x-tison-priority"

# Optional numeric sampling fields copied to SamplingParams as they are (it range-checks them).
_FLOAT_FIELDS = ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("top_k", "min_tokens", "seed")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, before tokenization (which fixes the default max_tokens)."""

    kind: str  # CHAT or COMPLETION
    model: str
    messages: tuple[dict, ...] = ()  # chat: role/content maps, content flattened to text
    tools: tuple[dict, ...] | None = None  # chat: passed to the chat template
    tool_choice: ToolChoice = ToolChoice()  # chat: what to do with the tools
    prompt: str | tuple[int, ...] = ""  # completion: text or token ids
    max_tokens: int | None = None  # None: chat → the rest of the context; completion → 16
    sampling: tuple[tuple[str, Any], ...] = ()  # other SamplingParams fields, as (name, value)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a final usage chunk
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): in every chunk
    num_logprobs: int | None = None  # None: no logprobs; n: chosen token + top n
    session_id: str = ""  # the body's session_id, else user; "" → none (see session_of)
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated, the n of highest mean logprob returned (>= n)
    echo: bool = False  # completion: the prompt leads each choice's text (and logprobs)
    structured: StructuredOutput | None = None  # the constraint on the output, if any


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and value == value


def _field(body: dict, name: str, check, what: str) -> Any:
    """body[name] when present and not null, after a type check; None otherwise."""
    value = body.get(name)
    if value is not None and not check(value):
        raise InvalidRequestError(name, f"must be {what}")
    return value


def _common(body: Any) -> dict:
    """Fields shared by both endpoints."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model", "is required and must be a string")
    sampling: dict[str, Any] = {}
    temperature = _field(body, "temperature", _is_num, "a number")
    if temperature is not None:
        if not 0 <= temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError("temperature", f"must be in [0, {MAX_TEMPERATURE}]")
        sampling["temperature"] = float(temperature)
    for name in _FLOAT_FIELDS:
        if (value := _field(body, name, _is_num, "a number")) is not None:
            sampling[name] = value
    for name in _INT_FIELDS:
        if (value := _field(body, name, _is_int, "an integer")) is not None:
            sampling[name] = value
    for name in ("ignore_eos", "skip_special_tokens"):
        if (value := _field(body, name, lambda v: isinstance(v, bool), "a boolean")) is not None:
            sampling[name] = value
    stop = _field(body, "stop", lambda v: isinstance(v, (str, list)), "a string or a list")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
    if (ids := _field(body, "stop_token_ids", lambda v: isinstance(v, list), "a list")) is not None:
        sampling["stop_token_ids"] = ids
    if (salt := _field(body, "cache_salt", lambda v: isinstance(v, str), "a string")) is not None:
        sampling["cache_salt"] = salt
    session = ""
    for name in ("session_id", "user"):
        value = _field(body, name, lambda v: isinstance(v, str), "a string")
        session = session or value or ""
    if (bias := _logit_bias(body)) is not None:
        sampling["logit_bias"] = bias
    prompt_logprobs = _field(body, "prompt_logprobs", _is_int, "an integer")
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        sampling["prompt_logprobs"] = prompt_logprobs
    n = _field(body, "n", _is_int, "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError("n", f"must be in [1, {MAX_N}]")
    stream = bool(_field(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequestError("stream_options.include_usage", "must be a boolean")
    continuous = options.get("continuous_usage_stats", False)
    if not isinstance(continuous, bool):
        raise InvalidRequestError("stream_options.continuous_usage_stats", "must be a boolean")
    structured, _ = parse_structured(body)
    return dict(
        model=model,
        n=n,
        structured=structured,
        sampling=tuple(sampling.items()),
        stream=stream,
        include_usage=stream and include_usage,
        continuous_usage=stream and include_usage and continuous,
        session_id=session,
    )


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} as sorted (id, bias) pairs (SamplingParams checks ranges)."""
    bias = _field(body, "logit_bias", lambda v: isinstance(v, dict), "an object")
    if bias is None:
        return None
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or not _is_num(value):
            raise InvalidRequestError("logit_bias", "maps token ids (as strings) to numbers")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        if (value := _field(body, name, _is_int, "an integer")) is not None:
            if value < 1:
                raise InvalidRequestError(name, "must be an integer >= 1")
            return value
    return None


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise InvalidRequestError(where, "only text content parts are supported")
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(where, "must be a string or a list of text parts")


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "is required and must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a string role")
        content = message.get("content")
        if content is None and message.get("tool_calls"):
            out.append(message)  # a turn of tool calls alone: its content stays null
            continue
        out.append({**message, "content": _text_content(content, f"messages[{i}].content")})
    return tuple(out)


def parse_chat(body: Any) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body."""
    common = _common(body)
    tools, choice = parse_tools(body)
    if choice.forced:
        if common["structured"] is not None:
            raise InvalidRequestError(
                "tool_choice", "cannot force a tool call with response_format"
            )
        common["structured"] = forced_json(forced_schema(tools, choice), "tool_choice")
    top = _field(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    wants = _field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean")
    if top is not None and not wants:
        raise InvalidRequestError("top_logprobs", "requires logprobs=true")
    return ParsedRequest(
        kind=CHAT,
        messages=_messages(body),
        tools=tools,
        tool_choice=choice,
        max_tokens=_max_tokens(body, "max_completion_tokens", "max_tokens"),
        num_logprobs=(top or 0) if wants else None,
        best_of=common["n"],
        **common,
    )


def _prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return tuple(prompt)
    raise InvalidRequestError("prompt", "must be a non-empty string or list of token ids")


def parse_completion(body: Any) -> ParsedRequest:
    """Validate a `/v1/completions` body."""
    common = _common(body)
    if body.get("suffix"):
        raise InvalidRequestError("suffix", "is not supported")
    echo = bool(_field(body, "echo", lambda v: isinstance(v, bool), "a boolean"))
    best_of = _field(body, "best_of", _is_int, "an integer")
    best_of = common["n"] if best_of is None else best_of
    if not common["n"] <= best_of <= MAX_N:
        raise InvalidRequestError("best_of", f"must be in [n, {MAX_N}]")
    if best_of > common["n"] and common["stream"]:
        raise InvalidRequestError("best_of", "cannot be streamed when larger than n")
    logprobs = _field(body, "logprobs", _is_int, "an integer")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
    return ParsedRequest(
        kind=COMPLETION,
        prompt=_prompt(body),
        max_tokens=_max_tokens(body, "max_tokens"),
        num_logprobs=logprobs,
        best_of=best_of,
        echo=echo,
        **common,
    )


def session_of(headers, parsed: ParsedRequest) -> str:
    """The request's session for affinity: the x-session-affinity header, else the body's."""
    return headers.get(SESSION_HEADER, "").strip() or parsed.session_id


def priority_of(headers) -> str:
    """The request's SubmitMsg.priority: the x-tison-priority header, interactive without it."""
    value = headers.get(PRIORITY_HEADER, "").strip().lower() or protocol.INTERACTIVE
    if value not in protocol.PRIORITIES:
        raise InvalidRequestError(PRIORITY_HEADER, f"must be one of {list(protocol.PRIORITIES)}")
    return value


def build_sampling(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int):
    """SamplingParams once the prompt length is known; checks the context limit."""
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(num_prompt_tokens, max_model_len - 1, "model's context length")
    room = max_model_len - num_prompt_tokens
    max_tokens = parsed.max_tokens or (room if parsed.kind == CHAT else min(16, room))
    if max_tokens > room:
        raise InvalidRequestError(
            "max_tokens",
            f"{num_prompt_tokens} prompt + {max_tokens} new tokens exceed the model's "
            f"context length of {max_model_len} tokens",
        )
    logprobs, fields = parsed.num_logprobs, dict(parsed.sampling)
    if parsed.best_of > parsed.n and logprobs is None:
        logprobs = 0  # the candidates are ranked by their tokens' logprobs
    if parsed.echo and logprobs is not None:  # the echoed prompt comes with its logprobs
        fields["prompt_logprobs"] = max(fields.get("prompt_logprobs") or 0, logprobs)
    return SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs, structured=parsed.structured, **fields
    )
