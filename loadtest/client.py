"""Sending one request and timing its response (SSE or plain JSON) as vLLM's bench does, with
inter-token latency per token: a server may send several tokens in one event (Tison's gateway
sends what is queued at once), so each event's tokens are counted, from the usage in every
chunk where the server sends one (vLLM's `continuous_usage_stats`, which Tison's gateway
honours), else one an event."""

import json
import time

import aiohttp

from loadtest.metrics import RequestResult
from loadtest.target import Target
from loadtest.workloads import RequestSpec

MAX_DETAIL = 200  # characters of an error message kept per request


class _StreamError(Exception):
    """The server sent an error object inside the stream."""


async def send(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, run_start: float
) -> RequestResult:
    """Send `spec`, read the whole response; never raises except on cancellation."""
    return (await exchange(session, target, spec, run_start))[0]


async def exchange(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, run_start: float
) -> tuple[RequestResult, str]:
    """Send `spec`, read the whole response -> its timings and the output text (the first
    choice's; "" on failure). Never raises except on cancellation."""
    sent = time.perf_counter()

    def failed(kind: str, detail: str) -> tuple[RequestResult, str]:
        latency = time.perf_counter() - sent
        result = RequestResult(
            False,
            spec.prompt_len,
            0,
            start_s=sent - run_start,
            latency_s=latency,
            error=kind,
            detail=detail[:MAX_DETAIL],
        )
        return result, ""

    try:
        async with session.post(
            target.url,
            json=target.body(spec),
            headers=target.headers,
            timeout=aiohttp.ClientTimeout(total=target.timeout_s),
        ) as resp:
            if resp.status != 200:
                return failed(f"http_{resp.status}", await resp.text())
            if target.stream:
                events, usage, text = await _read_sse(resp)
            else:
                answer = await resp.json()
                events, usage, text = [], answer.get("usage") or {}, _answer_text(answer)
    except TimeoutError:
        return failed("timeout", f"no complete response within {target.timeout_s} s")
    except _StreamError as e:
        return failed("stream_error", str(e))
    except aiohttp.ClientConnectorError as e:
        return failed("connect", str(e))
    except (aiohttp.ClientError, ValueError) as e:
        return failed("bad_response", f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    counted = sum(tokens for _, tokens in events)
    num_output = usage.get("completion_tokens") or counted
    if target.stream and not events:
        return failed("no_output", "the stream ended without a choice")
    exact = counted == num_output
    result = RequestResult(
        True,
        usage.get("prompt_tokens") or spec.prompt_len,
        num_output,
        start_s=sent - run_start,
        ttft_s=(events[0][0] if events else end) - sent,
        latency_s=end - sent,
        itl_s=token_gaps(events if exact else [(t, 1) for t, _ in events]),
        itl_per_token=exact or not events,
    )
    return result, text


def token_gaps(events: list[tuple[float, int]]) -> tuple[float, ...]:
    """Inter-token latencies from each output event's (arrival time, tokens it carried). An
    event of k tokens that came g after the one before gives k gaps of g / k (SGLang's bench
    rule: its tokens were made over that gap); the first event's tokens after its first came
    with it (gaps of 0)."""
    gaps = [0.0] * (events[0][1] - 1) if events else []
    for (before, _), (at, tokens) in zip(events, events[1:]):
        gaps += [(at - before) / tokens] * tokens
    return tuple(gaps)


def _choice_text(chunk: dict) -> str:
    """The output text a streamed chunk's first choice carries (completions or chat)."""
    choices = chunk.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def _answer_text(answer: dict) -> str:
    """The first choice's text of a whole (not streamed) response."""
    choices = answer.get("choices") or [{}]
    return choices[0].get("text") or (choices[0].get("message") or {}).get("content") or ""


def _carries_output(chunk: dict) -> bool:
    """A chunk whose first choice has text: a role-only first chunk or an empty closing one is
    not a token (vLLM's bench counts any chunk with a choice, so a server that sends the role
    first would get the time of that chunk as its TTFT)."""
    return bool(_choice_text(chunk))


async def _read_sse(resp: aiohttp.ClientResponse) -> tuple[list[tuple[float, int]], dict, str]:
    """(arrival time, output tokens) of the events that carry output, the usage if one came,
    and the output text (the first choice's chunks joined).
    Events that arrive in one read share its time: that is when the client could first see them.
    Where the chunks carry a running usage, each carries the tokens it adds to it (one with no
    text may carry a token whose character is not complete yet); else each with text carries
    one, and a usage on the closing chunk (transformers serve puts it there) is the final one.

    The stream ends at `[DONE]`, or when the server closes it after a choice with a finish
    reason (some servers send no `[DONE]`). Raises _StreamError on an error event, ValueError
    on a stream cut before either."""
    events: list[tuple[float, int]] = []
    usage: dict = {}
    texts: list[str] = []
    running = None  # whether the chunks carry a running usage
    counted = 0  # tokens it has reported
    finished = False
    partial = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        *lines, partial = (partial + data).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return events, usage, "".join(texts)
            chunk = json.loads(payload)
            if "error" in chunk:
                raise _StreamError(str(chunk["error"].get("message", chunk["error"])))
            usage_now = chunk.get("usage") if chunk.get("choices") else None
            if running is None and (usage_now or _carries_output(chunk)):
                running = bool(usage_now)  # the first chunk with output says which
            if running and usage_now:
                tokens = usage_now["completion_tokens"] - counted
                counted = usage_now["completion_tokens"]
            else:  # a usage on a closing chunk with choices is the final one, not a token
                tokens = 1 if _carries_output(chunk) else 0
            if tokens > 0:
                events.append((now, tokens))
            texts.append(_choice_text(chunk))
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not finished:
        raise ValueError("the stream ended before [DONE] or a finish reason")
    return events, usage, "".join(texts)
