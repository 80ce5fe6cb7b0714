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
import logging
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
    ENDED,
    ENDPOINTS,
    EXPIRED,
    FAILED,
    IN_PROGRESS,
    VALIDATING,
    BatchItemMsg,
    BatchMsg,
    BatchResultMsg,
    FileMsg,
    unrun,
)
from shared.errors import ProtocolError, TisonError

log = logging.getLogger("tison.batch")

WORK_STREAM = "TISON_BATCH_WORK"
RESULTS_STREAM = "TISON_BATCH_RESULTS"
BUCKET = "TISON_BATCHES"
FILES = "TISON_FILES"
ACK_WAIT_S = 10.0  # a runner that neither acks nor reports progress this long has died
DEDUP_WINDOW_S = 3600.0  # a line published twice within this is stored once (Nats-Msg-Id)
WINDOWS = {"24h": 24 * 3600}  # completion_window values, as OpenAI's
STALE_CREATE_S = 60.0  # a batch validating this long lost its creator (sweep finishes it)
EXPIRED_MESSAGE = "the batch's completion window ended before this line ran"
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
    def __init__(self, nc, clock=time.time):
        self.js = nc.jetstream()
        self.clock = clock  # unix seconds: completion windows and stale creations are read on it
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
        record = FileMsg(
            f"file-{uuid.uuid4().hex}", filename, purpose, len(data), int(self.clock())
        )
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
        records = await self._records("file.", FileMsg)
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
        that cannot gets its error result at once. The batch is recorded (validating) before
        its lines are queued, so one whose creator died half-way is found and finished by
        `sweep` (queueing is idempotent)."""
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
        now = int(self.clock())
        batch_id = f"batch_{uuid.uuid4().hex}"
        parsed = jsonl.parse(data, batch_id, endpoint)
        if parsed.total == 0:
            raise BatchError("input_file_id", f"file {input_file_id} has no request lines")
        batch = BatchMsg(
            batch_id, input_file_id, endpoint, completion_window, now,
            now + WINDOWS[completion_window], parsed.total, metadata=metadata,
        )  # fmt: skip
        revision = await self._kv.create(f"batch.{batch_id}", protocol.encode(batch))
        await self._queue(parsed)
        await self._start(batch, revision)
        return (await self.refresh(batch_id))[0]

    async def _queue(self, parsed: jsonl.Parsed) -> None:
        """The lines that cannot run get their results, the others go to the work stream.
        Twice is as once: results are stored once, and a line's Nats-Msg-Id (batch id and
        line key) makes the stream keep one copy within DEDUP_WINDOW_S."""
        for result in parsed.rejected:
            await self.put_result(result)
        acks = [
            await self.js.publish_async(
                subjects.batch_work(item.batch_id),
                protocol.encode(item),
                headers={"Nats-Msg-Id": f"{item.batch_id}:{item.key}"},
            )
            for item in parsed.items
        ]
        await asyncio.gather(*acks)

    async def _start(self, batch: BatchMsg, revision: int) -> None:
        """validating -> in_progress, unless someone else changed the record first (another
        sweep finished the creation, or the batch was cancelled meanwhile)."""
        started = replace(batch, status=IN_PROGRESS, in_progress_at=int(self.clock()))
        try:
            await self._kv.update(f"batch.{batch.id}", protocol.encode(started), revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass

    async def submit(self, data: bytes, endpoint: str, filename: str = "batch.jsonl", **kw):
        """Upload and create in one call: the BatchMsg."""
        record = await self.upload(data, filename)
        return await self.create(record.id, endpoint, **kw)

    async def batch(self, batch_id: str) -> BatchMsg:
        entry = await self._get(f"batch.{batch_id}", "batch_id", batch_id)
        return protocol.decode(entry.value, BatchMsg)

    async def recent(self) -> list[BatchMsg]:
        batches = await self._records("batch.", BatchMsg)
        return sorted(batches, key=lambda b: b.created_at, reverse=True)

    async def _records(self, prefix: str, cls):
        """The bucket's records under `prefix` (one deleted as they are read is left out).
        The keys come from the stream's subjects, not KeyValue.keys(): its watcher can
        signal "no more keys" before delivering the ones the server already sent (nats-py
        checks the consumer's pending count before its callback has run), and a listing
        then came back empty."""
        info = await self.js.stream_info(f"KV_{BUCKET}", subjects_filter=f"$KV.{BUCKET}.{prefix}>")
        keys = [s.removeprefix(f"$KV.{BUCKET}.") for s in sorted(info.state.subjects or {})]
        records = []
        for key in keys:
            try:
                records.append(protocol.decode((await self._kv.get(key)).value, cls))
            except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                continue
        return records

    async def counts(self, batch: BatchMsg) -> Counts:
        done = await self._subjects(subjects.batch_results(batch.id))
        failed = await self._subjects(subjects.batch_failures(batch.id))
        return Counts(batch.total, done - failed, failed)

    async def refresh(self, batch_id: str) -> tuple[BatchMsg, Counts]:
        """The batch and its counts, recording what has happened (by whoever sees it first):
        a batch whose every line has its result is completed; one whose completion window
        ended first is expired, and each of its lines still queued gets a batch_expired
        result (OpenAI's error line)."""
        entry = await self._get(f"batch.{batch_id}", "batch_id", batch_id)
        batch = protocol.decode(entry.value, BatchMsg)
        counts = await self.counts(batch)
        if batch.status == IN_PROGRESS and counts.done >= batch.total:
            ended = replace(batch, status=COMPLETED, completed_at=int(self.clock()))
        elif batch.status == IN_PROGRESS and self.clock() > batch.expires_at:
            ended = replace(batch, status=EXPIRED, expired_at=int(self.clock()))
        elif batch.status == EXPIRED and counts.done < batch.total:
            ended = batch  # its expirer died before it had answered every line
        else:
            return batch, counts
        if ended is not batch:
            try:
                await self._kv.update(f"batch.{batch_id}", protocol.encode(ended), entry.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return await self.batch(batch_id), counts
        if ended.status == EXPIRED:
            await self._expire_lines(ended)
            counts = await self.counts(ended)
        return ended, counts

    async def _expire_lines(self, batch: BatchMsg) -> None:
        """Each line of the batch still on the work stream (queued, or held by a runner)
        gets its batch_expired result, then the stream forgets them. A runner holding one
        finds its own result refused (one a line), so every line ends once."""
        subject, seq = subjects.batch_work(batch.id), 0
        while True:
            try:
                msg = await self.js.get_msg(WORK_STREAM, seq + 1, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            seq = msg.seq
            try:
                item = protocol.decode(msg.data, BatchItemMsg)
            except ProtocolError as e:
                protocol.dropped(BatchItemMsg.KIND, subject, e)
                continue
            await self.put_result(unrun(item, "batch_expired", EXPIRED_MESSAGE))
        await self.js.purge_stream(WORK_STREAM, subject=subject)

    async def sweep(self) -> None:
        """What no request may be there to see: batches whose completion window ended are
        expired, and batches left validating by a creator that died half-way (older than
        STALE_CREATE_S) are created to the end. Every gateway runs it now and then; any
        number may at once."""
        for batch in await self.recent():
            if batch.status == VALIDATING and self.clock() - batch.created_at > STALE_CREATE_S:
                await self.resume(batch.id)
            elif batch.status in (IN_PROGRESS, EXPIRED):
                await self.refresh(batch.id)

    async def resume(self, batch_id: str) -> BatchMsg:
        """Finishes the creation of a batch left validating: its lines are queued again from
        its input file (what was queued already is kept once). A batch whose input file is
        gone fails, saying so."""
        entry = await self._get(f"batch.{batch_id}", "batch_id", batch_id)
        batch = protocol.decode(entry.value, BatchMsg)
        if batch.status != VALIDATING:
            return batch
        try:
            data = await self.file_content(batch.input_file_id)
        except BatchError as e:
            failed = replace(batch, status=FAILED, failed_at=int(self.clock()), error=e.message)
            try:
                await self._kv.update(f"batch.{batch_id}", protocol.encode(failed), entry.revision)
            except nats.js.errors.KeyWrongLastSequenceError:
                return await self.batch(batch_id)
            log.warning("batch %s failed: %s", batch_id, e.message)
            await self.js.purge_stream(WORK_STREAM, subject=subjects.batch_work(batch_id))
            return failed
        log.info("batch %s: its creation was cut short; finishing it", batch_id)
        await self._queue(jsonl.parse(data, batch_id, batch.endpoint))
        await self._start(batch, entry.revision)
        return await self.batch(batch_id)

    async def cancel(self, batch_id: str) -> BatchMsg:
        """Lines not yet taken by a runner are dropped; lines running finish and count."""
        batch = await self.batch(batch_id)
        if batch.status in ENDED:
            raise BatchError("batch_id", f"batch {batch_id} is already {batch.status}", 409)
        now = int(self.clock())
        await self._kv.put(
            f"batch.{batch_id}",
            protocol.encode(replace(batch, status=CANCELLING, cancelling_at=now)),
        )
        await self.js.purge_stream(WORK_STREAM, subject=subjects.batch_work(batch_id))
        batch = replace(batch, status=CANCELLED, cancelling_at=now, cancelled_at=int(self.clock()))
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
        has one or the batch is cancelled (or failed) and nothing more comes."""
        batch = await self.batch(batch_id)
        seen = 0
        async for result in self._read(batch_id, poll_s):
            if result is None:
                batch, counts = await self.refresh(batch_id)
                if batch.status in (CANCELLED, FAILED) and counts.done <= seen:
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
