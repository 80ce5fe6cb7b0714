"""The gateway's aiohttp application: routes, OpenAI-shaped errors, startup and shutdown."""

import asyncio
import hmac
import json
import logging
import time

from aiohttp import web
from aiohttp.web_log import AccessLogger

from services.gateway.batches import BatchService, add_routes, batch_errors
from services.gateway.completions import CompletionService, json_error
from services.gateway.config import GatewayConfig
from services.gateway.control import ControlPlane
from services.gateway.memory import HeapTrimmer
from services.gateway.metrics import GatewayMetrics
from services.gateway.openai_request import parse_chat, parse_completion
from services.gateway.openapi import document
from services.gateway.responses import ResponsesService
from services.gateway.tokenize import detokenize, tokenize
from services.runtime import freeze_heap
from shared.errors import InvalidRequestError
from shared.tokenizer.tokenizer import Tokenizer
from shared.tool_calls import detect_parser, parser_for

log = logging.getLogger(__name__)
SERVICE = web.AppKey("service", CompletionService)
RESPONSES = web.AppKey("responses", ResponsesService)
TRIMMER = web.AppKey("trimmer", HeapTrimmer)
BATCHES = web.AppKey("batches", BatchService)
HEALTH_PATH = "/health"
_KEYED = ("/v1/", "/tokenize", "/detokenize")  # what an API key guards


class QuietHealthAccessLogger(AccessLogger):
    """aiohttp's access log less /health, which `tison up` and load balancers poll several
    times a second: a line per poll would bury the requests."""

    def log(self, request, response, time: float) -> None:
        if request.path != HEALTH_PATH:
            super().log(request, response, time)


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every error leaves as OpenAI's error JSON."""
    try:
        return await handler(request)
    except InvalidRequestError as e:
        return json_error(400, str(e), "invalid_request_error", e.field)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(e.status, e.reason, "invalid_request_error")


@web.middleware
async def api_key(request: web.Request, handler):
    """With an API key set, the /v1 routes, /tokenize and /detokenize need OpenAI's
    `Authorization: Bearer KEY` (401 otherwise); /health and /metrics stay open to probes."""
    key = request.app[SERVICE].config.api_key
    if key and request.path.startswith(_KEYED):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), key.encode()
        ):
            message = "Incorrect API key provided (Authorization: Bearer <key>)."
            return json_error(401, message, "invalid_request_error", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def release_memory(request: web.Request, handler):
    """A large request gives the heap it freed back to the system when it ends (memory.py)."""
    async with request.app[TRIMMER].request(request.content_length or 0):
        return await handler(request)


async def _body(request: web.Request):
    """The JSON body; 400 naming `body` for what no field check can see: invalid JSON,
    nesting deeper than the parser recurses, strings that are not Unicode (a lone surrogate,
    which JSON's \\u escapes can write and no tokenizer takes)."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequestError("body", f"invalid JSON ({e})") from None
    except RecursionError:
        raise InvalidRequestError("body", "nested too deeply") from None
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError("body", f"not valid Unicode ({e.reason})") from None
    except RecursionError:
        raise InvalidRequestError("body", "nested too deeply") from None
    return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await request.app[SERVICE].serve(request, parse_chat(await _body(request)))


async def completions(request: web.Request) -> web.StreamResponse:
    return await request.app[SERVICE].serve(request, parse_completion(await _body(request)))


async def responses(request: web.Request) -> web.StreamResponse:
    return await request.app[RESPONSES].serve(request, await _body(request))


async def tokenize_route(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response(await tokenize(service, await _body(request)))


async def detokenize_route(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    return web.json_response(detokenize(service, await _body(request)))


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(document(request.app[SERVICE].config.served_model_name))


async def models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    model = {
        "id": service.config.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tison",
        "max_model_len": service.max_model_len(),
    }
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    """200 while a scheduler answers over NATS and at least one prefill and one decode worker
    are alive, else 503 (every completion would fail)."""
    control = request.app[SERVICE].control
    counts = {role: len(control.alive(role)) for role in ("prefill", "decode")}
    scheduler = await control.scheduler_answers()
    status = 200 if scheduler and all(counts.values()) else 503
    body = {"status": "ok" if status == 200 else "unavailable", "scheduler": scheduler, **counts}
    return web.json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def build_app(service: CompletionService, batches: BatchService | None = None) -> web.Application:
    limit = service.config.body_limit(service.max_model_len())
    app = web.Application(
        middlewares=[release_memory, openai_errors, api_key, batch_errors], client_max_size=limit
    )
    app[SERVICE] = service
    app[TRIMMER] = HeapTrimmer()
    app[RESPONSES] = ResponsesService(service)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/v1/models", models)
    app.router.add_get(HEALTH_PATH, health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    if batches is not None:
        app[BATCHES] = batches
        add_routes(app, batches)
    return app


def tool_parser(config: GatewayConfig, tokenizer: Tokenizer):
    """The tool-call parser: --tool-call-parser's, else the one the model's chat template and
    special tokens speak ("auto"), else none (tool calls are then forced or not parsed)."""
    name = config.tool_call_parser
    if name == "auto":
        templates = tokenizer.chat_templates
        template = templates.get("tool_use") or templates.get("default")
        added = [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]
        name = detect_parser(template.source if template else None, added)
    if name in (None, "none"):
        log.info("no tool-call parser: tool_choice auto returns the text as it is")
        return None
    log.info("tool-call parser: %s", name)
    return parser_for(name)


async def run_gateway(config: GatewayConfig, stop: asyncio.Event) -> None:
    """Serve HTTP until `stop` is set. A client that disconnects cancels its handler."""
    tokenizer = Tokenizer.from_dir(config.model_dir)
    gateway_metrics = GatewayMetrics()
    control = ControlPlane(
        config.gateway_id,
        config.nats_url,
        gateway_metrics,
        config.miss_limit,
        config.dead_grace_s,
        config.nats,
    )
    await control.start()
    parser = tool_parser(config, tokenizer)
    service = CompletionService(config, tokenizer, control, gateway_metrics, parser)
    batches = BatchService(config, gateway_metrics.registry)
    runner = web.AppRunner(
        build_app(service, batches),
        handler_cancellation=True,
        access_log_class=QuietHealthAccessLogger,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        log.info(
            "gateway %s serving %s on http://%s:%d",
            config.gateway_id,
            config.served_model_name,
            config.host,
            config.port,
        )
        await batches.start()  # its runner posts to the routes above
        freeze_heap()
        await stop.wait()
    finally:
        await batches.close()
        await runner.cleanup()
        await control.close()
