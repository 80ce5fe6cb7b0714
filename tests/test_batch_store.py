"""Batches over a real nats-server's JetStream (services/batch/store.py): what a batch puts on
the work stream, results stored at most once a line, counts and completion from the results,
output and error files made from them, cancel, expiry at the end of the completion window, a
creation cut short by a kill -9 finished by a sweep, and all of it kept across a server
restart."""

import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import replace

import nats
import pytest

from services.batch import jsonl
from services.batch.objects import batch_object
from services.batch.store import (
    RESULTS_STREAM,
    STALE_CREATE_S,
    WINDOWS,
    WORK_STREAM,
    BatchError,
    Batches,
)
from shared import protocol
from shared.batch_messages import BatchItemMsg, BatchResultMsg
from shared.nats_server import NatsServer

CHAT = "/v1/chat/completions"


def lines(ids, bad: int = 0) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    good = [json.dumps({"custom_id": i, "method": "POST", "url": CHAT, "body": body}) for i in ids]
    return ("\n".join(good + ["{oops"] * bad) + "\n").encode()


@pytest.fixture
def server(tmp_path):
    with NatsServer(tmp_path / "nats") as s:
        yield s


@pytest.fixture
async def batches(server):
    nc = await nats.connect(server.url)
    store = Batches(nc)
    await store.ensure()
    await store.ensure()  # idempotent: every gateway and client calls it
    yield store
    await nc.close()


async def work_items(store: Batches) -> list[BatchItemMsg]:
    sub = await store.js.pull_subscribe("tison.v1.batch.work.*", durable="t", stream=WORK_STREAM)
    msgs = await sub.fetch(100, timeout=1)
    return [protocol.decode(m.data, BatchItemMsg) for m in msgs]


def ok(item: BatchItemMsg) -> BatchResultMsg:
    body = json.dumps({"id": f"chatcmpl-{item.custom_id}"})
    return BatchResultMsg(item.batch_id, item.key, item.custom_id, item.line, 200, body)


async def test_a_batch_queues_its_good_lines_and_answers_its_bad_ones(batches):
    batch = await batches.submit(lines(["a", "b", "c"], bad=2), CHAT)
    assert batch.status == "in_progress" and batch.total == 5
    items = await work_items(batches)
    assert sorted(i.custom_id for i in items) == ["a", "b", "c"]
    counts = await batches.counts(batch)
    assert (counts.completed, counts.failed, counts.done) == (0, 2, 2)
    obj = batch_object(batch, counts)
    assert obj["request_counts"] == {"total": 5, "completed": 0, "failed": 2}
    assert obj["output_file_id"] is None  # not done yet


async def test_a_line_has_one_result_however_often_it_is_stored(batches):
    batch = await batches.submit(lines(["a", "b"]), CHAT)
    a, b = sorted(await work_items(batches), key=lambda i: i.line)
    assert await batches.put_result(ok(a)) is True
    assert await batches.put_result(ok(a)) is False  # a second run of the line: refused
    other = BatchResultMsg(a.batch_id, a.key, a.custom_id, a.line, 500, "{}")
    assert await batches.put_result(other) is False  # nor a different result
    assert (await batches.result(a.batch_id, a.key)).status_code == 200
    info = await batches.js.stream_info(RESULTS_STREAM)
    assert info.state.messages == 1
    batch, counts = await batches.refresh(batch.id)
    assert batch.status == "in_progress" and counts.done == 1
    await batches.put_result(ok(b))
    batch, counts = await batches.refresh(batch.id)
    assert batch.status == "completed" and batch.completed_at > 0
    assert (counts.completed, counts.failed) == (2, 0)


async def test_output_and_error_files_are_made_from_the_results(batches):
    batch = await batches.submit(lines(["a", "b"], bad=1), CHAT)
    for item in await work_items(batches):
        await batches.put_result(ok(item))
    batch, counts = await batches.refresh(batch.id)
    obj = batch_object(batch, counts)
    output = await batches.file_content(obj["output_file_id"])
    errors = await batches.file_content(obj["error_file_id"])
    out = [json.loads(x) for x in output.splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b"]  # in input order
    assert out[0]["response"]["request_id"] == "chatcmpl-a"
    (err,) = [json.loads(x) for x in errors.splitlines()]
    assert err["error"]["code"] == "invalid_json" and err["custom_id"] is None
    assert (await batches.file(obj["output_file_id"])).purpose == "batch_output"
    assert await batches.file_content(batch.input_file_id) == lines(["a", "b"], bad=1)


async def test_cancel_drops_the_lines_not_taken(batches):
    batch = await batches.submit(lines([str(i) for i in range(20)]), CHAT)
    cancelled = await batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at > 0
    info = await batches.js.stream_info(WORK_STREAM)
    assert info.state.messages == 0
    with pytest.raises(BatchError, match="already cancelled"):
        await batches.cancel(batch.id)


async def test_unknown_ids_and_bad_arguments_name_the_field(batches):
    for call, field in [
        (batches.batch("batch_nope"), "batch_id"),
        (batches.file("file-nope"), "file_id"),
        (batches.create("file-nope", CHAT), "file_id"),
    ]:
        with pytest.raises(BatchError) as e:
            await call
        assert e.value.param == field and e.value.status == 404
    record = await batches.upload(lines(["a"]), "in.jsonl")
    with pytest.raises(BatchError, match="endpoint"):
        await batches.create(record.id, "/v1/embeddings")
    with pytest.raises(BatchError, match="completion_window"):
        await batches.create(record.id, CHAT, completion_window="1h")
    with pytest.raises(BatchError, match="purpose"):
        await batches.upload(b"x", "in.jsonl", purpose="fine-tune")
    empty = await batches.upload(b"\n\n", "empty.jsonl")
    with pytest.raises(BatchError, match="no request lines"):
        await batches.create(empty.id, CHAT)


async def test_batches_and_results_outlive_a_server_restart(server, batches):
    batch = await batches.submit(lines(["a", "b"]), CHAT)
    first = sorted(await work_items(batches), key=lambda i: i.line)[0]
    await batches.put_result(ok(first))
    server.stop()
    server.start()
    nc = await nats.connect(server.url)
    try:
        again = Batches(nc)
        await again.ensure()
        assert (await again.batch(batch.id)).total == 2
        assert [r.custom_id for r in await again.results(batch.id)] == ["a"]
        assert await again.put_result(ok(first)) is False
        info = await again.js.stream_info(WORK_STREAM)
        assert info.state.messages == 2  # fetched, never acked: both wait to run again
    finally:
        await nc.close()


def test_result_keys_fit_a_subject_whatever_the_custom_id():
    for custom_id in ["a.b", "x y", "*", ">", "ünï", "a" * 512]:
        key = jsonl.result_key(custom_id)
        assert len(key) == 32 and key.isalnum()


async def queued(store: Batches, batch_id: str) -> int:
    """The batch's lines on the work stream."""
    info = await store.js.stream_info(
        WORK_STREAM, subjects_filter=f"tison.v1.batch.work.{batch_id}"
    )
    return sum((info.state.subjects or {}).values())


def later(seconds: float):
    return lambda: time.time() + seconds


async def test_a_batch_past_its_window_expires_and_its_unrun_lines_say_so(batches):
    batch = await batches.submit(lines(["a", "b", "c", "d"], bad=1), CHAT)
    items = sorted(await work_items(batches), key=lambda i: i.line)  # held, as by a runner
    await batches.put_result(ok(items[0]))
    assert (await batches.refresh(batch.id))[0].status == "in_progress"  # window still open

    batches.clock = later(WINDOWS["24h"] + 1)
    expired, counts = await batches.refresh(batch.id)
    assert expired.status == "expired" and expired.expired_at > batch.expires_at
    assert (counts.total, counts.completed, counts.failed) == (5, 1, 4)
    assert await queued(batches, batch.id) == 0
    assert await batches.put_result(ok(items[1])) is False  # its runner finishing late: refused
    obj = batch_object(expired, counts)
    assert obj["status"] == "expired" and obj["expired_at"] == expired.expired_at
    output = await batches.file_content(obj["output_file_id"])
    assert [json.loads(x)["custom_id"] for x in output.splitlines()] == ["a"]
    errors = [
        json.loads(x) for x in (await batches.file_content(obj["error_file_id"])).splitlines()
    ]
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        ("b", "batch_expired"), ("c", "batch_expired"), ("d", "batch_expired"),
        (None, "invalid_json"),
    ]  # fmt: skip
    assert (await batches.refresh(batch.id))[0].expired_at == expired.expired_at  # recorded once
    with pytest.raises(BatchError, match="already expired") as e:
        await batches.cancel(batch.id)
    assert e.value.status == 409


async def test_the_sweep_expires_batches_nobody_asks_about(batches):
    batch = await batches.submit(lines(["a", "b"]), CHAT)
    await batches.sweep()
    assert (await batches.batch(batch.id)).status == "in_progress"
    batches.clock = later(WINDOWS["24h"] + 1)
    await batches.sweep()
    assert (await batches.batch(batch.id)).status == "expired"
    assert (await batches.counts(await batches.batch(batch.id))).failed == 2
    # An expirer that died between recording the expiry and answering the lines: the next
    # sweep answers them.
    other = await batches.submit(lines(["x", "y", "z"]), CHAT)
    record = await batches.batch(other.id)
    await batches._kv.put(
        f"batch.{other.id}", protocol.encode(replace(record, status="expired", expired_at=1))
    )
    await batches.sweep()
    assert (await batches.counts(record)).failed == 3 and await queued(batches, other.id) == 0


CREATOR = """
import asyncio, sys
import nats
from services.batch.store import Batches

async def main(url, count):
    nc = await nats.connect(url)
    store = Batches(nc)
    await store.ensure()
    published = 0
    publish = store.js.publish_async

    async def publish_then_die(*args, **kwargs):  # the creator's host dies half-way
        nonlocal published
        published += 1
        if published > count:
            await nc.flush()
            print("half-way", flush=True)
            await asyncio.sleep(3600)
        return await publish(*args, **kwargs)

    store.js.publish_async = publish_then_die
    data = sys.stdin.buffer.read()
    record = await store.upload(data, "in.jsonl")
    await store.create(record.id, "/v1/chat/completions")

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def create_and_die(server, data: bytes, count: int) -> None:
    """A process that creates a batch of `data` is killed -9 after queueing `count` lines."""
    child = subprocess.Popen(
        [sys.executable, "-c", CREATOR, server.url, str(count)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    child.stdin.write(data)
    child.stdin.close()
    line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert line == b"half-way\n"


async def test_a_creation_cut_short_by_kill_9_is_finished_by_a_sweep(server, batches):
    ids = [str(i) for i in range(30)]
    await create_and_die(server, lines(ids, bad=2), count=10)
    (batch,) = await batches.recent()
    assert batch.status == "validating" and batch.total == 32
    assert await queued(batches, batch.id) == 10
    await batches.sweep()  # its creator might still be at work: left alone
    assert (await batches.batch(batch.id)).status == "validating"

    batches.clock = later(STALE_CREATE_S + 1)
    await batches.sweep()
    resumed, counts = await batches.refresh(batch.id)
    assert resumed.status == "in_progress" and resumed.in_progress_at > 0
    assert await queued(batches, batch.id) == 30  # the first 10 once, not twice
    assert sorted(i.custom_id for i in await work_items(batches)) == sorted(ids)
    assert (counts.completed, counts.failed) == (0, 2)  # the bad lines' results, once each


async def test_a_cut_short_creation_whose_file_is_gone_fails_saying_so(server, batches):
    await create_and_die(server, lines([str(i) for i in range(20)]), count=5)
    (batch,) = await batches.recent()
    await batches.delete_file(batch.input_file_id)
    batches.clock = later(STALE_CREATE_S + 1)
    await batches.sweep()
    failed, counts = await batches.refresh(batch.id)
    assert failed.status == "failed" and failed.failed_at > 0
    assert await queued(batches, batch.id) == 0  # what it had queued does not run
    obj = batch_object(failed, counts)
    (error,) = obj["errors"]["data"]
    assert batch.input_file_id in error["message"] and obj["failed_at"] == failed.failed_at
    assert [b async for b in batches.follow(batch.id, poll_s=0.2)] == []  # ends at once
