"""OpenAI's Files and Batch API on the gateway: POST /v1/files (purpose batch), GET
/v1/files/{id} and /v1/files/{id}/content, POST /v1/batches, GET /v1/batches[/{id}], POST
/v1/batches/{id}/cancel, over services/batch (JetStream); and the batch runner that runs the
lines, started with the gateway. The official `openai` client's batch calls work unchanged."""

import asyncio
import logging

import nats.errors
import nats.js.errors
from aiohttp import web

from services.batch.objects import batch_object, file_object
from services.batch.runner import BatchRunner, RunnerMetrics
from services.batch.store import BatchError, Batches
from services.gateway.completions import json_error
from services.gateway.config import GatewayConfig
from services.nats_client import connect_nats

log = logging.getLogger(__name__)
MAX_FILE_BYTES = 200 << 20  # an input file, at most (OpenAI's limit for batch files)
SWEEP_S = 10.0  # how often a gateway expires batches and finishes half-created ones


class BatchService:
    """The gateway's JetStream connection for batches, its routes' handlers and its runner.
    `batches` is None while JetStream cannot be used (the routes then answer 503)."""

    def __init__(self, config: GatewayConfig, registry=None):
        self.config = config
        self.metrics = RunnerMetrics(registry)  # on the gateway's /metrics
        self.batches: Batches | None = None
        self.unavailable = "not started"  # why batches is None
        self.runner: BatchRunner | None = None
        self._nc = None
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()

    async def start(self) -> None:
        self._nc = await connect_nats(
            self.config.nats_url, f"{self.config.gateway_id}-batch", self.config.nats
        )
        try:
            batches = Batches(self._nc)
            await batches.ensure()
        except Exception as e:  # no JetStream on this server, or no rights to it
            self.unavailable = f"the batch API needs NATS JetStream ({e})"
            log.warning("%s; /v1/batches answers 503", self.unavailable)
            return
        self.batches = batches
        self._tasks.append(asyncio.create_task(self._keep_sweeping(batches)))
        if self.config.batch_runners > 0:
            self.runner = BatchRunner(
                batches,
                self._own_url(),
                self.config.api_key,
                self.config.batch_runners,
                self.metrics,
            )
            self._tasks.append(asyncio.create_task(self._keep_running(self.runner)))

    async def _keep_running(self, runner: BatchRunner) -> None:
        """The runner until stop, started again should it fail (NATS gone as it subscribed)."""
        while not self._stop.is_set():
            try:
                await runner.run(self._stop)
            except Exception:
                log.exception("batch runner failed; starting it again in 1 s")
                await asyncio.sleep(1.0)

    async def _keep_sweeping(self, batches: Batches) -> None:
        """Batches.sweep every SWEEP_S until stop (a sweep NATS cut short is the next one's)."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), SWEEP_S)
            except asyncio.TimeoutError:
                pass
            if self._stop.is_set():
                return
            try:
                await batches.sweep()
            except Exception as e:
                log.warning("batch sweep failed (%r); the next one is in %.0f s", e, SWEEP_S)

    async def close(self) -> None:
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    def _own_url(self) -> str:
        host = self.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.config.port}"

    def _store(self) -> Batches:
        if self.batches is None:
            raise BatchError("", self.unavailable, 503)
        return self.batches

    # the routes

    async def create_file(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            raise BatchError("file", "upload the file as multipart/form-data")
        purpose, data, filename = None, None, "upload.jsonl"
        reader = await request.multipart()
        async for part in reader:
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or filename
                data = await _read_limited(part)
        if data is None:
            raise BatchError("file", "no file part in the upload")
        if purpose is None:
            raise BatchError("purpose", "purpose is required")
        return web.json_response(file_object(await self._store().upload(data, filename, purpose)))

    async def get_file(self, request: web.Request) -> web.Response:
        record = await self._store().file(request.match_info["file_id"])
        return web.json_response(file_object(record))

    async def list_files(self, request: web.Request) -> web.Response:
        data = [file_object(r) for r in await self._store().files()]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def delete_file(self, request: web.Request) -> web.Response:
        record = await self._store().delete_file(request.match_info["file_id"])
        return web.json_response({"id": record.id, "object": "file", "deleted": True})

    async def file_content(self, request: web.Request) -> web.Response:
        data = await self._store().file_content(request.match_info["file_id"])
        return web.Response(body=data, content_type="application/octet-stream")

    async def create_batch(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError as e:
            raise BatchError("body", f"invalid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BatchError("body", "the body must be a JSON object")
        for name in ("input_file_id", "endpoint"):
            if not isinstance(body.get(name), str):
                raise BatchError(name, f"{name} is required (a string)")
        store = self._store()
        batch = await store.create(
            body["input_file_id"],
            body["endpoint"],
            body.get("completion_window", "24h"),
            body.get("metadata"),
        )
        return web.json_response(batch_object(batch, await store.counts(batch)))

    async def get_batch(self, request: web.Request) -> web.Response:
        batch, counts = await self._store().refresh(request.match_info["batch_id"])
        return web.json_response(batch_object(batch, counts))

    async def cancel_batch(self, request: web.Request) -> web.Response:
        store = self._store()
        batch = await store.cancel(request.match_info["batch_id"])
        return web.json_response(batch_object(batch, await store.counts(batch)))

    async def list_batches(self, request: web.Request) -> web.Response:
        store = self._store()
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            raise BatchError("limit", "limit must be an integer") from None
        if not 1 <= limit <= 100:
            raise BatchError("limit", "limit must be between 1 and 100")
        batches = (await store.recent())[:limit]
        data = [batch_object(b, await store.counts(b)) for b in batches]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": False,
            }
        )


async def _read_limited(part) -> bytes:
    chunks, size = [], 0
    while chunk := await part.read_chunk(1 << 20):
        size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise BatchError("file", f"the file is larger than {MAX_FILE_BYTES >> 20} MiB", 413)
        chunks.append(chunk)
    return b"".join(chunks)


@web.middleware
async def batch_errors(request: web.Request, handler):
    """BatchError as OpenAI's error JSON with its status; NATS unreachable: 503."""
    try:
        return await handler(request)
    except BatchError as e:
        err_type = "invalid_request_error" if e.status < 500 else "service_unavailable"
        return json_error(e.status, e.message, err_type, e.param or None)
    except (nats.errors.Error, nats.js.errors.Error) as e:
        if not request.path.startswith(("/v1/files", "/v1/batches")):
            raise
        return json_error(503, f"NATS JetStream did not answer ({e})", "service_unavailable")


def add_routes(app: web.Application, service: BatchService) -> None:
    app.router.add_post("/v1/files", service.create_file)
    app.router.add_get("/v1/files", service.list_files)
    app.router.add_get("/v1/files/{file_id}", service.get_file)
    app.router.add_delete("/v1/files/{file_id}", service.delete_file)
    app.router.add_get("/v1/files/{file_id}/content", service.file_content)
    app.router.add_post("/v1/batches", service.create_batch)
    app.router.add_get("/v1/batches", service.list_batches)
    app.router.add_get("/v1/batches/{batch_id}", service.get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", service.cancel_batch)
