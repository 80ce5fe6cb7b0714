"""The client side of the chaos scenario (chaos.py): a streaming completion read until it
ends, how it ended (pure: `classify`), a small completion polled until the service answers,
and the workers' KV page gauges from the gateway's /metrics."""

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass

import aiohttp

MAX_DETAIL = 160  # characters of an error text kept per stream

# How a stream ended (StreamEnd.kind):
FINISHED = "finished"  # a finish reason other than "error": the kill did not touch it
ERROR = "error"  # the server said why: an error event, or finish_reason "error" with a text
DROPPED = "dropped"  # the connection broke (what a client sees when the gateway dies)
CUT = "cut"  # the server closed the stream cleanly but said neither why nor that it finished
HTTP = "http"  # refused before streaming (a status other than 200)
HUNG = "hung"  # still open when the scenario gave up on it


@dataclass
class StreamEnd:
    kind: str  # one of the kinds above
    detail: str = ""  # the error text, the finish reason, or the exception
    first_token_at: float = 0.0  # time.monotonic() of the first chunk with text (0: none)
    ended_at: float = 0.0  # time.monotonic() when the client saw the end
    num_tokens: int = 0  # chunks with text


def classify(
    finish_reason: str | None, error: str | None, exc: BaseException | None, status: int = 200
) -> tuple[str, str]:
    """(kind, detail) of a stream's end, from what the client saw: its HTTP status, an error
    text (an error event's message or an error item's), the last finish reason, or the
    exception that broke the read."""
    if status != 200:
        return HTTP, f"http {status}: {error or ''}"[:MAX_DETAIL]
    if error:
        return ERROR, error[:MAX_DETAIL]
    if finish_reason == "error":
        return ERROR, "finish_reason error without a text"
    if finish_reason:
        return FINISHED, finish_reason
    if isinstance(exc, asyncio.TimeoutError | TimeoutError):
        return HUNG, "no end within the scenario's limit"
    if exc is not None:
        return DROPPED, f"{type(exc).__name__}: {exc}"[:MAX_DETAIL]
    return CUT, "stream closed without a finish reason or an error"


def names_victim(end: StreamEnd, victim: str) -> bool:
    """Whether the end tells the truth about the kill: the error names the role that died
    (the gateway's death is the dropped connection itself), in the stream or in a refusal
    before it; a stream the victim did not serve may also finish normally."""
    if end.kind == FINISHED:
        return True
    if victim == "gateway":
        return end.kind == DROPPED
    return end.kind in (ERROR, HTTP) and victim in end.detail.lower()


async def stream(
    session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float, state: StreamEnd
) -> StreamEnd:
    """POST a `stream: true` completion and read it to its end, filling `state` as it goes
    (its first_token_at is visible to the caller while the stream runs)."""
    finish, error, exc, status = None, None, None, 200
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body) as resp:
                status = resp.status
                if status != 200:
                    error = await resp.text()
                else:
                    finish, error = await _read_events(resp, state)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        exc = e
    state.kind, state.detail = classify(finish, error, exc, status)
    state.ended_at = time.monotonic()
    return state


async def _read_events(resp: aiohttp.ClientResponse, state: StreamEnd) -> tuple:
    """(last finish reason, error text) of an SSE stream read to [DONE] or to its close."""
    finish, error, partial = None, None, b""
    async for data in resp.content.iter_any():
        *lines, partial = (partial + data).split(b"\n")
        for line in lines:
            payload = line[5:].strip() if line.startswith(b"data:") else b""
            if not payload:
                continue
            if payload == b"[DONE]":
                return finish, error
            chunk = json.loads(payload)
            if "error" in chunk:
                err = chunk["error"]
                return finish, str(err.get("message", err) if isinstance(err, dict) else err)
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    state.num_tokens += 1
                    state.first_token_at = state.first_token_at or time.monotonic()
                finish = choice.get("finish_reason") or finish
    return finish, error


def probe_prompt(tag: int) -> str:
    """~270 tokens of the bundled tokenizer: over the scheduler's local-prefill bound (256), so
    a prefill worker must compute it, and new from its first page on (`tag`), so no prefix
    cache holds it."""
    return f"probe {tag}: " + " ".join(str(n) for n in range(150))


async def poll_until_served(
    session: aiohttp.ClientSession, url: str, model: str, limit_s: float
) -> float | None:
    """time.monotonic() of the first completion of a new prompt that needs a prefill worker
    (`probe_prompt`) to succeed (None: none in `limit_s`). Each try waits at most 5 s; a
    refusal or a broken connection is retried."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        body = {"model": model, "prompt": probe_prompt(time.monotonic_ns()), "max_tokens": 2}
        try:
            async with asyncio.timeout(5.0):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    if resp.status == 200 and (await resp.json()).get("choices"):
                        return time.monotonic()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.2)
    return None


def pages_used(url: str) -> dict[str, float] | None:
    """role/worker -> tison_kv_pages_used from the gateway's /metrics (None: no answer)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    used = {}
    for line in text.splitlines():
        if line.startswith("tison_kv_pages_used{"):
            labels, value = line[len("tison_kv_pages_used{") :].rsplit("} ", 1)
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            used[f"{fields['role'].strip(chr(34))}/{fields['worker'].strip(chr(34))}"] = float(
                value
            )
    return used
