"""Sending one request and timing its response (SSE or plain JSON) as vLLM's bench does."""

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
    sent = time.perf_counter()

    def failed(kind: str, detail: str) -> RequestResult:
        latency = time.perf_counter() - sent
        return RequestResult(
            False,
            spec.prompt_len,
            0,
            start_s=sent - run_start,
            latency_s=latency,
            error=kind,
            detail=detail[:MAX_DETAIL],
        )

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
                stamps, usage = await _read_sse(resp)
            else:
                stamps, usage = [], (await resp.json()).get("usage") or {}
    except TimeoutError:
        return failed("timeout", f"no complete response within {target.timeout_s} s")
    except _StreamError as e:
        return failed("stream_error", str(e))
    except aiohttp.ClientConnectorError as e:
        return failed("connect", str(e))
    except (aiohttp.ClientError, ValueError) as e:
        return failed("bad_response", f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    num_output = usage.get("completion_tokens") or len(stamps)
    if target.stream and not stamps:
        return failed("no_output", "the stream ended without a choice")
    return RequestResult(
        True,
        usage.get("prompt_tokens") or spec.prompt_len,
        num_output,
        start_s=sent - run_start,
        ttft_s=(stamps[0] if stamps else end) - sent,
        latency_s=end - sent,
        itl_s=tuple(b - a for a, b in zip(stamps, stamps[1:])),
    )


def _carries_output(chunk: dict) -> bool:
    """A chunk whose first choice has text: a role-only first chunk or an empty closing one is
    not a token (vLLM's bench counts any chunk with a choice, so a server that sends the role
    first would get the time of that chunk as its TTFT)."""
    choices = chunk.get("choices")
    if not choices:
        return False
    choice = choices[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


async def _read_sse(resp: aiohttp.ClientResponse) -> tuple[list[float], dict]:
    """Arrival times of the events that carry output text, and the usage if one came. Events
    that arrive in one read share its time: that is when the client could first see them.

    The stream ends at `[DONE]`, or when the server closes it after a choice with a finish
    reason (some servers send no `[DONE]`). Raises _StreamError on an error event, ValueError
    on a stream cut before either."""
    stamps: list[float] = []
    usage: dict = {}
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
                return stamps, usage
            chunk = json.loads(payload)
            if "error" in chunk:
                raise _StreamError(str(chunk["error"].get("message", chunk["error"])))
            if _carries_output(chunk):
                stamps.append(now)
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or ())
            if chunk.get("usage"):
                usage = chunk["usage"]
    if not finished:
        raise ValueError("the stream ended before [DONE] or a finish reason")
    return stamps, usage
