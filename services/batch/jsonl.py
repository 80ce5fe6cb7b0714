"""OpenAI batch JSONL: the input file's lines as work items (or as their error results), and
results as output lines. Pure.

Input, one request a line: {"custom_id": str, "method": "POST", "url": endpoint, "body": {...}}.
A line that cannot run (not JSON, not an object, no custom_id, a custom_id seen before, another
method or url than the batch's endpoint, streaming asked for) becomes its own error result at
once; every other line runs, and what its body is worth is the gateway's to say (its 4xx is
that line's response). Output, one line a result (OpenAI's shape): {"id", "custom_id",
"response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}.
"""

import hashlib
import json
from dataclasses import dataclass

from shared.batch_messages import BatchItemMsg, BatchResultMsg

MAX_CUSTOM_ID = 512  # characters, as OpenAI's limit


@dataclass(frozen=True)
class Parsed:
    items: list[BatchItemMsg]  # the lines that run
    rejected: list[BatchResultMsg]  # the lines that cannot, each its error result

    @property
    def total(self) -> int:
        return len(self.items) + len(self.rejected)


def result_key(custom_id: str) -> str:
    """The result subject's last token for a line: a hash of its custom_id, which may hold
    characters no subject can."""
    return hashlib.sha256(custom_id.encode()).hexdigest()[:32]


def line_key(line: int) -> str:
    """The key of a line with no usable custom_id (missing, or one seen before)."""
    return f"line-{line}"


def parse(data: bytes, batch_id: str, endpoint: str) -> Parsed:
    """The input file's lines (blank ones skipped) for a batch on `endpoint`."""
    items: list[BatchItemMsg] = []
    rejected: list[BatchResultMsg] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.splitlines(), start=1):
        if not raw.strip():
            continue
        entry, error = _entry(raw, number, seen, endpoint)
        if error is not None:
            code, message, custom_id, key = error
            key = key or (result_key(custom_id) if custom_id else line_key(number))
            rejected.append(BatchResultMsg(batch_id, key, custom_id, number, 0, "", code, message))
            continue
        custom_id = entry["custom_id"]
        body = json.dumps(entry["body"], ensure_ascii=False)
        items.append(
            BatchItemMsg(batch_id, result_key(custom_id), custom_id, number, entry["url"], body)
        )
    return Parsed(items, rejected)


def _entry(raw: bytes, number: int, seen: set[str], endpoint: str):
    """(the line's object, None), or (None, (code, message, custom_id, key)) when it cannot
    run. Adds a usable custom_id to `seen`."""
    try:
        entry = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return None, ("invalid_json", f"line {number}: not JSON ({e})", "", "")
    if not isinstance(entry, dict):
        return None, ("invalid_json", f"line {number}: not a JSON object", "", "")
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        message = f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters"
        return None, ("missing_custom_id", message, "", "")
    if custom_id in seen:
        message = f"line {number}: custom_id {custom_id!r} is used by an earlier line"
        return None, ("duplicate_custom_id", message, custom_id, line_key(number))
    seen.add(custom_id)
    problem = _problem(entry, endpoint)
    if problem is not None:
        return None, (problem[0], f"line {number}: {problem[1]}", custom_id, "")
    return entry, None


def _problem(entry: dict, endpoint: str) -> tuple[str, str] | None:
    if entry.get("method") != "POST":
        return "invalid_method", f"method must be POST, got {entry.get('method')!r}"
    if entry.get("url") != endpoint:
        return (
            "invalid_url",
            f"url must be the batch's endpoint {endpoint}, got {entry.get('url')!r}",
        )
    body = entry.get("body")
    if not isinstance(body, dict):
        return "invalid_body", "body must be a JSON object"
    if body.get("stream"):
        return "invalid_body", "stream is not supported in a batch"
    return None


def output_line(result: BatchResultMsg) -> dict:
    """The output (or error) file's line for a result."""
    line_id = (
        "batch_req_" + hashlib.sha256(f"{result.batch_id}:{result.key}".encode()).hexdigest()[:24]
    )
    if result.status_code == 0:
        response = None
        error = {"code": result.error_code, "message": result.error_message}
    else:
        try:
            body = json.loads(result.body) if result.body else None
        except ValueError:
            body = result.body
        request_id = body.get("id", "") if isinstance(body, dict) else ""
        response = {"status_code": result.status_code, "request_id": request_id, "body": body}
        error = None
    return {
        "id": line_id,
        "custom_id": result.custom_id or None,
        "response": response,
        "error": error,
    }


def dumps_lines(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False).encode() + b"\n" for line in lines)
