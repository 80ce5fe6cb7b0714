"""Batches end to end with real model workers: NATS (JetStream), scheduler, a prefill and a
decode worker running the tiny model, and a gateway whose batch runners run the lines. Driven
by the official `openai` client's files and batches calls, by `tison batch` over NATS alone,
and by the Python client; each greedy result must equal the same request sent interactively."""

import asyncio
import json
import subprocess
import sys
import time

import nats
import openai
import pytest

from services.batch.store import Batches

from services_harness import REPO_ROOT, cluster_for, metric, wait_pages_free

CHAT = "/v1/chat/completions"
PROMPTS = [f"Count to {i}:" for i in range(20)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    s = cluster_for(tmp_path_factory, tiny_llama, "auto")
    yield s
    s.stop_all()


def body(model: str, prompt: str, **kw) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 6,
        "temperature": 0,
        **kw,
    }


def request_line(custom_id: str, payload, url: str = CHAT) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": payload})


async def wait_done(client, batch_id: str, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "cancelled", "failed", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        await asyncio.sleep(0.5)


def read_lines(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines() if x.strip()]


async def test_200_requests_through_the_openai_client_equal_interactive(client, cluster):
    model = cluster.model_dir.name
    interactive = {}
    for prompt in PROMPTS:
        reply = await client.chat.completions.create(**body(model, prompt))
        interactive[prompt] = (reply.choices[0].message.content, reply.choices[0].finish_reason)
    text = "\n".join(
        request_line(f"req-{i}", body(model, PROMPTS[i % len(PROMPTS)])) for i in range(200)
    )
    upload = await client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    assert upload.bytes == len(text.encode()) and upload.purpose == "batch"
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h", metadata={"k": "v"}
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 200
    batch = await wait_done(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (200, 0)
    assert batch.error_file_id is None and batch.metadata == {"k": "v"}
    out = read_lines((await client.files.content(batch.output_file_id)).content)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(200))
    for o in out:
        prompt = PROMPTS[int(o["custom_id"].split("-")[1]) % len(PROMPTS)]
        assert o["error"] is None and o["response"]["status_code"] == 200
        choice = o["response"]["body"]["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == interactive[prompt]
        assert o["response"]["request_id"] == o["response"]["body"]["id"]
    assert len({o["id"] for o in out}) == 200
    assert await metric(cluster, "tison_batch_lines_total") >= 200  # what the runners did
    await wait_pages_free(cluster)


async def test_bad_lines_each_get_an_error_line_and_the_rest_run(client, cluster):
    model = cluster.model_dir.name
    lines = [
        request_line("good-1", body(model, "hello")),
        "{not json",
        request_line("good-1", body(model, "again")),  # duplicate custom_id
        request_line("embed", {"model": model, "input": "x"}, url="/v1/embeddings"),
        request_line("invalid", body(model, "x", max_tokens=-3)),  # the gateway's 400
        request_line("wrong-model", body("no-such-model", "x")),  # the gateway's 404
        request_line("good-2", body(model, "bye")),
    ]
    upload = await client.files.create(
        file=("in.jsonl", "\n".join(lines).encode()), purpose="batch"
    )
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h"
    )
    batch = await wait_done(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed) == (7, 2)
    assert batch.request_counts.failed == 5
    good = read_lines((await client.files.content(batch.output_file_id)).content)
    assert [o["custom_id"] for o in good] == ["good-1", "good-2"]
    errors = read_lines((await client.files.content(batch.error_file_id)).content)
    by_line = {(e["custom_id"], (e["error"] or {}).get("code")): e for e in errors}
    assert set(by_line) == {
        (None, "invalid_json"),
        ("good-1", "duplicate_custom_id"),
        ("embed", "invalid_url"),
        ("invalid", None),
        ("wrong-model", None),
    }
    invalid = by_line[("invalid", None)]["response"]
    assert invalid["status_code"] == 400 and invalid["body"]["error"]["param"] == "max_tokens"
    assert by_line[("wrong-model", None)]["response"]["status_code"] == 404


async def test_bad_calls_get_openai_errors(client):
    with pytest.raises(openai.NotFoundError):
        await client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        upload = await client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        await client.files.content("file-nope")


async def test_files_are_listed_and_deleted(client):
    upload = await client.files.create(file=("gone.jsonl", b"{}\n"), purpose="batch")
    assert upload.id in [f.id for f in (await client.files.list()).data]
    deleted = await client.files.delete(upload.id)
    assert deleted.deleted and deleted.id == upload.id
    assert upload.id not in [f.id for f in (await client.files.list()).data]
    with pytest.raises(openai.NotFoundError):
        await client.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        await client.files.delete(upload.id)
    with pytest.raises(openai.BadRequestError, match="cannot be deleted"):
        await client.files.delete("file-batch_x-output")


def tison_batch(cluster, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "services.cli", "batch", *args, "--nats-url", cluster.nats.url]
    return subprocess.run(cmd, capture_output=True, cwd=REPO_ROOT, timeout=240)


async def test_tison_batch_over_nats_alone(cluster, tmp_path, client):
    model = cluster.model_dir.name
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(request_line(f"c{i}", body(model, PROMPTS[i])) for i in range(8)))
    submitted = tison_batch(cluster, "submit", str(path), "--wait")
    assert submitted.returncode == 0, submitted.stderr.decode()
    batch_id = submitted.stdout.decode().strip()
    assert b"8/8" in submitted.stderr and b"completed" in submitted.stderr  # the progress bar
    out = tmp_path / "out.jsonl"
    got = tison_batch(cluster, "results", batch_id, "-o", str(out))
    assert got.returncode == 0, got.stderr.decode()
    lines = read_lines(out.read_bytes())
    assert [o["custom_id"] for o in lines] == [f"c{i}" for i in range(8)]
    first = await client.chat.completions.create(**body(model, PROMPTS[0]))
    assert lines[0]["response"]["body"]["choices"][0]["message"]["content"] == (
        first.choices[0].message.content
    )
    status = tison_batch(cluster, "status", batch_id)
    assert json.loads(status.stdout)["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    missing = tison_batch(cluster, "status", "batch_nope")
    assert missing.returncode == 2 and b"no such batch" in missing.stderr


async def test_the_python_client_follows_results_as_they_land(cluster):
    model = cluster.model_dir.name
    nc = await nats.connect(cluster.nats.url)
    try:
        batches = Batches(nc)
        await batches.ensure()
        text = "\n".join(request_line(f"f{i}", body(model, PROMPTS[i])) for i in range(6))
        batch = await batches.submit(text.encode(), CHAT)
        seen = [r.custom_id async for r in batches.follow(batch.id)]
        assert sorted(seen) == [f"f{i}" for i in range(6)]
        batch, counts = await batches.refresh(batch.id)
        assert batch.status == "completed" and counts.completed == 6
    finally:
        await nc.close()


async def test_cancel_stops_the_lines_not_started(client, cluster):
    model = cluster.model_dir.name
    text = "\n".join(
        request_line(f"x{i}", body(model, PROMPTS[i % 20], max_tokens=24)) for i in range(300)
    )
    upload = await client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint=CHAT, completion_window="24h"
    )
    cancelled = await client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled"
    await asyncio.sleep(2.0)  # the lines that were running end
    first = await client.batches.retrieve(batch.id)
    await asyncio.sleep(1.0)
    later = await client.batches.retrieve(batch.id)
    assert later.request_counts.completed == first.request_counts.completed < 300
    with pytest.raises(openai.ConflictError):
        await client.batches.cancel(batch.id)
    await wait_pages_free(cluster)
