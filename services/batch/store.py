"""Batches over NATS JetStream: the client library that `tison batch`, the gateway's
/v1/files and /v1/batches and the batch runners share (usable from any program with a NATS
connection, no HTTP needed).

What JetStream holds (created on first use, kept across restarts of every process, NATS's
own included, in the server's store):
- WORK_STREAM: the lines to run (subjects.batch_work), a work queue: a line leaves it when a
  runner acks it, which it does only after the line's result is stored; one whose runner
  died is delivered again after ACK_WAIT_S.
- RESULTS_STREAM: one result a line (subjects.batch_result, keyed by a hash of its custom_id)
  and a marker for each failed one (subjects.batch_failed). At most one message a subject,
  and the server refuses a second: a line run twice (its runner died between storing and
  acking) still has exactly one result, and counts are the number of subjects.
- BUCKET (KV): each batch's record (BatchMsg) and each uploaded file's (FileMsg).
- FILES (object store): the uploaded files' bytes. Output and error files are not stored:
  their content is made from the results when asked for.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import nats.js.errors
from nats.js import api

from services.batch import jsonl
from shared import protocol, subjects
from shared.batch_messages import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    ENDPOINTS,
    IN_PROGRESS,
    BatchMsg,
    BatchResultMsg,
    FileMsg,
)
from shared.errors import TisonError

WORK_STREAM = "TISON_BATCH_WORK"
RESULTS_STREAM = "TISON_BATCH_RESULTS"
BUCKET = "TISON_BATCHES"
FILES = "TISON_FILES"
ACK_WAIT_S = 10.0  # a runner that neither acks nor reports progress this long has died
DEDUP_WINDOW_S = 3600.0  # a line published twice within this is stored once (Nats-Msg-Id)
WINDOWS = {"24h": 24 * 3600}  # completion_window values, as OpenAI's
PER_SUBJECT_LIMIT = 10077  # JetStream's error code: a second message on a one-message subject
OUTPUT, ERRORS = "output", "errors"  # the two files a batch's results make


def output_file_id(batch_id: str, which: str) -> str:
    return f"file-{batch_id}-{which}"


def _made_from(file_id: str) -> tuple[str, str] | None:
    """(batch id, OUTPUT or ERRORS) of a results file's id, else None."""
    for which in (OUTPUT, ERRORS):
        if file_id.startswith("file-batch_") and file_id.endswith(f"-{which}"):
            return file_id[len("file-") : -len(which) - 1], which
    return None


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int  # lines with a result of HTTP 200
    failed: int  # lines with any other result

    @property
    def done(self) -> int:
        return self.completed + self.failed


class BatchError(TisonError):
    """A batch call that cannot be done: `param` names the field, `status` is the HTTP status
    the gateway answers with."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.message, self.status = param, message, status


class Batches:
    def __init__(self, nc):
        self.js = nc.jetstream()
        self._kv = None
        self._files = None

    async def ensure(self) -> None:
        """Create the streams, the bucket and the object store where they are missing."""
        await _stream(
            self.js,
            api.StreamConfig(
                name=WORK_STREAM,
                subjects=[subjects.all_batch_work()],
                retention=api.RetentionPolicy.WORK_QUEUE,
                storage=api.StorageType.FILE,
                duplicate_window=DEDUP_WINDOW_S,
            ),
        )
        await _stream(
            self.js,
            api.StreamConfig(
                name=RESULTS_STREAM,
                subjects=subjects.all_batch_results(),
                storage=api.StorageType.FILE,
                max_msgs_per_subject=1,
                discard=api.DiscardPolicy.NEW,
                discard_new_per_subject=True,
                duplicate_window=DEDUP_WINDOW_S,
            ),
        )
        try:
            self._kv = await self.js.key_value(BUCKET)
        except nats.js.errors.BucketNotFoundError:
            self._kv = await self.js.create_key_value(
                api.KeyValueConfig(bucket=BUCKET, history=1, storage=api.StorageType.FILE)
            )
        try:
            self._files = await self.js.object_store(FILES)
        except nats.js.errors.BucketNotFoundError:
            self._files = await self.js.create_object_store(
                FILES, config=api.ObjectStoreConfig(storage=api.StorageType.FILE)
            )

    # files

    async def upload(self, data: bytes, filename: str, purpose: str = "batch") -> FileMsg:
        if purpose != "batch":
            raise BatchError("purpose", f"purpose must be 'batch', got {purpose!r}")
        record = FileMsg(f"file-{uuid.uuid4().hex}", filename, purpose, len(data), int(time.time()))
        await self._files.put(record.id, data)
        await self._kv.put(f"file.{record.id}", protocol.encode(record))
        return record

    async def file(self, file_id: str) -> FileMsg:
        if (made := _made_from(file_id)) is not None:
            batch = await self.batch(made[0])
            return FileMsg(
                file_id, f"{batch.id}_{made[1]}.jsonl", "batch_output", 0, batch.created_at
            )
        entry = await self._get(f"file.{file_id}", "file_id", file_id)
        return protocol.decode(entry.value, FileMsg)

    async def files(self) -> list[FileMsg]:
        """The uploaded files, newest first (a batch's output and error files are not listed:
        they are made from its results)."""
        try:
            keys = [k for k in await self._kv.keys() if k.startswith("file.")]
        except nats.js.errors.NoKeysError:
            return []
        records = [await self.file(k.removeprefix("file.")) for k in keys]
        return sorted(records, key=lambda r: r.created_at, reverse=True)

    async def delete_file(self, file_id: str) -> FileMsg:
        """Deletes an uploaded file (a batch made from it runs on: its lines are queued). A
        batch's output and error files go with the batch's results and cannot be deleted."""
        if _made_from(file_id) is not None:
            raise BatchError("file_id", f"{file_id} is a batch's results: it cannot be deleted")
        record = await self.file(file_id)
        await self._files.delete(file_id)
        await self._kv.delete(f"file.{file_id}")
        return record

    async def file_content(self, file_id: str) -> bytes:
        if (made := _made_from(file_id)) is not None:
            batch_id, which = made
            results = await self.results(batch_id)
            chosen = [r for r in results if r.failed == (which == ERRORS)]
            return jsonl.dumps_lines([jsonl.output_line(r) for r in chosen])
        await self.file(file_id)
        return (await self._files.get(file_id)).data

    # batches

    async def create(
        self,
        input_file_id: str,
        endpoint: str,
        completion_window: str = "24h",
        metadata: dict[str, str] | None = None,
    ) -> BatchMsg:
        """A batch of the file's lines: each line that can run goes to the work stream, each
        that cannot gets its error result at once."""
        if endpoint not in ENDPOINTS:
            raise BatchError("endpoint", f"endpoint must be one of {', '.join(ENDPOINTS)}")
        if completion_window not in WINDOWS:
            raise BatchError("completion_window", "completion_window must be '24h'")
        metadata = metadata or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise BatchError("metadata", "metadata must map strings to strings")
        data = await self.file_content(input_file_id)
        now = int(time.time())
        batch_id = f"batch_{uuid.uuid4().hex}"
        parsed = jsonl.parse(data, batch_id, endpoint)
        if parsed.total == 0:
            raise BatchError("input_file_id", f"file {input_file_id} has no request lines")
        batch = BatchMsg(
            batch_id, input_file_id, endpoint, completion_window, now,
            now + WINDOWS[completion_window], parsed.total, metadata=metadata,
        )  # fmt: skip
        await self._kv.put(f"batch.{batch_id}", protocol.encode(batch))
        for result in parsed.rejected:
            await self.put_result(result)
        acks = [
            await self.js.publish_async(
                subjects.batch_work(batch_id),
                protocol.encode(item),
                headers={"Nats-Msg-Id": f"{batch_id}:{item.key}"},
            )
            for item in parsed.items
        ]
        await asyncio.gather(*acks)
        batch = replace(batch, status=IN_PROGRESS, in_progress_at=int(time.time()))
        await self._kv.put(f"batch.{batch_id}", protocol.encode(batch))
        return (await self.refresh(batch_id))[0]

    async def submit(self, data: bytes, endpoint: str, filename: str = "batch.jsonl", **kw):
        """Upload and create in one call: the BatchMsg."""
        record = await self.upload(data, filename)
        return await self.create(record.id, endpoint, **kw)

    async def batch(self, batch_id: str) -> BatchMsg:
        entry = await self._get(f"batch.{batch_id}", "batch_id", batch_id)
        return protocol.decode(entry.value, BatchMsg)

    async def recent(self) -> list[BatchMsg]:
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        batches = [await self.batch(k[len("batch.") :]) for k in keys if k.startswith("batch.")]
        return sorted(batches, key=lambda b: b.created_at, reverse=True)

    async def counts(self, batch: BatchMsg) -> Counts:
        done = await self._subjects(subjects.batch_results(batch.id))
        failed = await self._subjects(subjects.batch_failures(batch.id))
        return Counts(batch.total, done - failed, failed)

    async def refresh(self, batch_id: str) -> tuple[BatchMsg, Counts]:
        """The batch and its counts; a batch whose every line has its result is completed
        (recorded once, by whoever sees it first)."""
        entry = await self._get(f"batch.{batch_id}", "batch_id", batch_id)
        batch = protocol.decode(entry.value, BatchMsg)
        counts = await self.counts(batch)
        if batch.status == IN_PROGRESS and counts.done >= batch.total:
            done = replace(batch, status=COMPLETED, completed_at=int(time.time()))
            try:
                await self._kv.update(f"batch.{batch_id}", protocol.encode(done), entry.revision)
                batch = done
            except nats.js.errors.KeyWrongLastSequenceError:
                batch = await self.batch(batch_id)
        return batch, counts

    async def cancel(self, batch_id: str) -> BatchMsg:
        """Lines not yet taken by a runner are dropped; lines running finish and count."""
        batch = await self.batch(batch_id)
        if batch.status in (COMPLETED, CANCELLED):
            raise BatchError("batch_id", f"batch {batch_id} is already {batch.status}", 409)
        now = int(time.time())
        await self._kv.put(
            f"batch.{batch_id}",
            protocol.encode(replace(batch, status=CANCELLING, cancelling_at=now)),
        )
        await self.js.purge_stream(WORK_STREAM, subject=subjects.batch_work(batch_id))
        batch = replace(batch, status=CANCELLED, cancelling_at=now, cancelled_at=int(time.time()))
        await self._kv.put(f"batch.{batch_id}", protocol.encode(batch))
        return batch

    # results

    async def put_result(self, result: BatchResultMsg) -> bool:
        """Store a line's result; False when it already has one (that one stays)."""
        stored = await self._put_once(
            subjects.batch_result(result.batch_id, result.key), protocol.encode(result)
        )
        # The failure marker follows the result it marks: one stored earlier by a runner that
        # died before marking it gets its marker now.
        kept = result if stored else await self.result(result.batch_id, result.key)
        if kept is not None and kept.failed:
            await self._put_once(subjects.batch_failed(result.batch_id, result.key), b"")
        return stored

    async def result(self, batch_id: str, key: str) -> BatchResultMsg | None:
        try:
            msg = await self.js.get_last_msg(RESULTS_STREAM, subjects.batch_result(batch_id, key))
        except nats.js.errors.NotFoundError:
            return None
        return protocol.decode(msg.data, BatchResultMsg)

    async def results(self, batch_id: str) -> list[BatchResultMsg]:
        """Every result stored so far, in input line order."""
        await self.batch(batch_id)
        count = await self._subjects(subjects.batch_results(batch_id))
        results = []
        if count:
            async for result in self._read(batch_id):
                results.append(result)
                if len(results) == count:
                    break
        return sorted(results, key=lambda r: r.line)

    async def follow(self, batch_id: str, poll_s: float = 1.0) -> AsyncIterator[BatchResultMsg]:
        """The batch's results as they land (those stored already first), until every line
        has one or the batch is cancelled and nothing more comes."""
        batch = await self.batch(batch_id)
        seen = 0
        async for result in self._read(batch_id, poll_s):
            if result is None:
                batch, counts = await self.refresh(batch_id)
                if batch.status == CANCELLED and counts.done <= seen:
                    return
                continue
            seen += 1
            yield result
            if seen >= batch.total:
                return

    async def _read(self, batch_id: str, poll_s: float | None = None):
        """The results stream's messages of a batch, oldest first (None every poll_s without
        one, when poll_s is given)."""
        sub = await self.js.subscribe(
            subjects.batch_results(batch_id),
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=poll_s or 10.0)
                except nats.errors.TimeoutError:
                    if poll_s is None:
                        raise TimeoutError(f"results of {batch_id}: none came in 10 s") from None
                    yield None
                    continue
                yield protocol.decode(msg.data, BatchResultMsg)
        finally:
            await sub.unsubscribe()

    async def _put_once(self, subject: str, payload: bytes) -> bool:
        try:
            ack = await self.js.publish(subject, payload, headers={"Nats-Msg-Id": subject})
        except nats.js.errors.APIError as e:
            if e.err_code == PER_SUBJECT_LIMIT:
                return False
            raise
        return not ack.duplicate

    async def _subjects(self, subject_filter: str) -> int:
        info = await self.js.stream_info(RESULTS_STREAM, subjects_filter=subject_filter)
        return len(info.state.subjects or {})

    async def _get(self, key: str, param: str, value: str):
        try:
            return await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            raise BatchError(param, f"no such {param.removesuffix('_id')}: {value}", 404) from None


async def _stream(js, config: api.StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(config)


def batch_object(batch: BatchMsg, counts: Counts) -> dict:
    """The batch as OpenAI's Batch object."""
    done = batch.status in (COMPLETED, CANCELLED)

    def at(value: int) -> int | None:
        return value or None

    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": output_file_id(batch.id, OUTPUT) if done and counts.completed else None,
        "error_file_id": output_file_id(batch.id, ERRORS) if done and counts.failed else None,
        "created_at": batch.created_at,
        "in_progress_at": at(batch.in_progress_at),
        "expires_at": batch.expires_at,
        "finalizing_at": at(batch.completed_at),
        "completed_at": at(batch.completed_at),
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": at(batch.cancelling_at),
        "cancelled_at": at(batch.cancelled_at),
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "metadata": batch.metadata or None,
    }


def file_object(record: FileMsg) -> dict:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
    }
