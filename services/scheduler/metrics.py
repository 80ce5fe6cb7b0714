"""Prometheus metrics of the scheduler's routing, in a registry of their own, served on
`--metrics-port` (off by default: the gateway's /metrics has the request-level view)."""

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.scheduler.policy import Choice
from shared import protocol

_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class SchedulerMetrics:
    """Routing decisions by reason, the cached prompt tokens they predicted, the KV index."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(
            "tison_scheduler_routing_decisions",
            "Workers chosen, by role and reason (kv_overlap, affinity, load, round_robin, "
            "local_prefill)",
            ("role", "reason"),
            registry=r,
        )
        self.cached_tokens = Histogram(
            "tison_scheduler_predicted_overlap_tokens",
            "Prompt tokens the chosen worker's prefix cache holds, as its KV events say",
            ("role",),
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.index_pages = Gauge(
            "tison_scheduler_kv_index_pages",
            "Page hashes the index holds for a worker",
            ("worker",),
            registry=r,
        )
        self.dropped = Gauge(
            "tison_scheduler_dropped_messages",
            "NATS messages the scheduler dropped as malformed, by message kind",
            ("kind",),
            registry=r,
        )
        self.snapshot_asks = Counter(
            "tison_scheduler_kv_snapshot_asks",
            "Snapshots asked of workers (a lost KV events message, or a scheduler restart)",
            registry=r,
        )

    def observe_choice(self, choice: Choice) -> None:
        self.decisions.labels("decode", choice.decode_reason).inc()
        self.decisions.labels("prefill", choice.prefill_reason).inc()
        self.cached_tokens.labels("decode").observe(choice.decode_cached_tokens)
        if not choice.local:
            self.cached_tokens.labels("prefill").observe(choice.prefill_cached_tokens)

    def forget_worker(self, worker_id: str) -> None:
        try:
            self.index_pages.remove(worker_id)
        except KeyError:
            pass

    def render(self) -> bytes:
        for kind, count in protocol.DROPPED.items():
            self.dropped.labels(kind).set(count)
        return generate_latest(self.registry)


async def serve_metrics(metrics: SchedulerMetrics, host: str, port: int) -> web.AppRunner:
    """Start /metrics on host:port; the caller cleans the returned runner up."""

    async def handle(request: web.Request) -> web.Response:
        headers = {"Content-Type": "text/plain; version=0.0.4"}
        return web.Response(body=metrics.render(), headers=headers)

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
