"""OpenAI batch JSONL in and out (services/batch/jsonl.py): which lines run, which become
their own error line and why, and the output line's shape."""

import json

from services.batch import jsonl
from shared.batch_messages import BatchResultMsg

CHAT = "/v1/chat/completions"


def line(custom_id, url=CHAT, method="POST", **body) -> bytes:
    body = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    entry = {"custom_id": custom_id, "method": method, "url": url, "body": body}
    return json.dumps(entry).encode()


def test_good_lines_run_in_order_with_their_body_as_json_text():
    data = b"\n".join([line("a"), b"", line("b", max_tokens=3, model="m")]) + b"\n"
    parsed = jsonl.parse(data, "batch_1", CHAT)
    assert [i.custom_id for i in parsed.items] == ["a", "b"]
    assert [i.line for i in parsed.items] == [1, 3]  # blank lines skipped, numbers kept
    assert parsed.rejected == [] and parsed.total == 2
    assert json.loads(parsed.items[1].body) == {"max_tokens": 3, "model": "m"}
    assert parsed.items[0].key == jsonl.result_key("a") != parsed.items[1].key


def test_each_bad_line_gets_its_own_error_and_the_rest_run():
    data = b"\n".join(
        [
            line("ok-1"),
            b"{not json",
            b"[1, 2]",
            json.dumps({"method": "POST", "url": CHAT, "body": {}}).encode(),  # no custom_id
            line("ok-1"),  # duplicate
            line("u", url="/v1/embeddings"),
            line("m", method="GET"),
            line("s", stream=True, model="m"),
            json.dumps({"custom_id": "b", "method": "POST", "url": CHAT, "body": [1]}).encode(),
            line("ok-2"),
        ]
    )
    parsed = jsonl.parse(data, "batch_1", CHAT)
    assert [i.custom_id for i in parsed.items] == ["ok-1", "ok-2"]
    codes = [(r.line, r.error_code) for r in parsed.rejected]
    assert codes == [
        (2, "invalid_json"),
        (3, "invalid_json"),
        (4, "missing_custom_id"),
        (5, "duplicate_custom_id"),
        (6, "invalid_url"),
        (7, "invalid_method"),
        (8, "invalid_body"),
        (9, "invalid_body"),
    ]
    assert parsed.total == 10
    keys = [r.key for r in parsed.rejected] + [i.key for i in parsed.items]
    assert len(set(keys)) == len(keys)  # one result subject per line, the duplicate's too
    assert all(r.error_message.startswith(f"line {r.line}: ") for r in parsed.rejected)
    assert parsed.rejected[3].custom_id == "ok-1" and parsed.rejected[3].key == "line-5"


def test_output_lines_have_openais_shape():
    ok = BatchResultMsg("batch_1", "k", "a", 1, 200, json.dumps({"id": "chatcmpl-1", "x": 1}))
    assert jsonl.output_line(ok) == {
        "id": jsonl.output_line(ok)["id"],
        "custom_id": "a",
        "response": {
            "status_code": 200,
            "request_id": "chatcmpl-1",
            "body": {"id": "chatcmpl-1", "x": 1},
        },
        "error": None,
    }
    assert jsonl.output_line(ok)["id"].startswith("batch_req_")
    bad = BatchResultMsg("batch_1", "line-2", "", 2, 0, "", "invalid_json", "line 2: not JSON")
    out = jsonl.output_line(bad)
    assert out["custom_id"] is None and out["response"] is None
    assert out["error"] == {"code": "invalid_json", "message": "line 2: not JSON"}
    # the same result, written twice, is the same line (its id comes from the batch and key)
    assert jsonl.output_line(bad) == out
    assert jsonl.dumps_lines([out, out]).count(b"\n") == 2
