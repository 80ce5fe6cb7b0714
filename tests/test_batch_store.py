"""Batches over a real nats-server's JetStream (services/batch/store.py): what a batch puts on
the work stream, results stored at most once a line, counts and completion from the results,
output and error files made from them, cancel, and all of it kept across a server restart."""

import json

import nats
import pytest

from services.batch import jsonl
from services.batch.store import RESULTS_STREAM, WORK_STREAM, BatchError, Batches, batch_object
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
