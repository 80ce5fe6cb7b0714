"""Prometheus metrics of the gateway, in a registry of their own (one per gateway app)."""

from dataclasses import fields

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from shared import protocol
from shared.protocol import HeartbeatMsg, PrefixStats, TokensMsg

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_WORKER = ("worker", "role")
_PREFIX_DOCS = {  # PrefixStats field → help; the gauge is tison_prefix_cache_<field>
    "queried_requests": "Admissions that looked the prefix cache up (worker's cumulative count)",
    "hit_requests": "Admissions that found cached pages (worker's cumulative count)",
    "queried_tokens": "Prompt tokens looked up in the prefix cache (worker's cumulative count)",
    "hit_tokens": "Prompt tokens found in the prefix cache (worker's cumulative count)",
    "evicted_pages": "Cached pages reused for other KV (worker's cumulative count)",
    "cached_pages": "Pages the prefix cache names now",
}


class GatewayMetrics:
    """Latency histograms, request gauges, and per-worker KV gauges mirrored from heartbeats."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = histogram(
            "tison_time_to_first_token_seconds",
            "Request arrival to first token sent",
            _LATENCY_BUCKETS,
        )
        self.itl = histogram(
            "tison_inter_token_latency_seconds",
            "Time between consecutive output tokens",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "tison_e2e_request_latency_seconds", "Request arrival to last token", _LATENCY_BUCKETS
        )
        # Where a streamed token's time goes, from each tokens message of a decode worker:
        self.step = histogram("tison_decode_step_seconds", "The engine step", _ITL_BUCKETS)
        self.cycle = histogram(
            "tison_decode_cycle_seconds",
            "Step end to step end: the engine step plus the worker loop's overhead",
            _ITL_BUCKETS,
        )
        self.batch = histogram(
            "tison_decode_batch_size",
            "This gateway's requests in the step",
            (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )
        self.transit = histogram(
            "tison_tokens_transit_seconds",
            "The worker's publish to the gateway (clocks of one host)",
            _ITL_BUCKETS,
        )
        self.running = Gauge("tison_requests_running", "Requests generating", registry=r)
        self.waiting = Gauge(
            "tison_requests_waiting", "Requests awaiting the scheduler", registry=r
        )
        self.pages_used = Gauge("tison_kv_pages_used", "KV pages in use", _WORKER, registry=r)
        self.pages_total = Gauge("tison_kv_pages_total", "KV pool size", _WORKER, registry=r)
        self.transfer_bytes = Gauge(
            "tison_kv_transfer_bytes",
            "KV bytes moved (worker's cumulative count)",
            _WORKER,
            registry=r,
        )
        self.transfer_seconds = Gauge(
            "tison_kv_transfer_seconds",
            "Time spent moving KV (worker's cumulative count)",
            _WORKER,
            registry=r,
        )
        # Hit rate: tison_prefix_cache_hit_tokens / tison_prefix_cache_queried_tokens (rates).
        self.prefix = {
            f.name: Gauge(f"tison_prefix_cache_{f.name}", _PREFIX_DOCS[f.name], _WORKER, registry=r)
            for f in fields(PrefixStats)
        }
        self.worker_dropped = Gauge(
            "tison_worker_dropped_messages",
            "NATS messages a worker dropped as malformed (its cumulative count)",
            _WORKER,
            registry=r,
        )
        self.dropped = Gauge(
            "tison_gateway_dropped_messages",
            "NATS messages this gateway dropped as malformed, by message kind",
            ("kind",),
            registry=r,
        )
        self._per_worker = (
            self.pages_used,
            self.worker_dropped,
            self.pages_total,
            self.transfer_bytes,
            self.transfer_seconds,
            *self.prefix.values(),
        )

    def observe_worker(self, beat: HeartbeatMsg) -> None:
        labels = (beat.worker_id, beat.role)
        self.pages_used.labels(*labels).set(beat.total_pages - beat.free_pages)
        self.pages_total.labels(*labels).set(beat.total_pages)
        self.transfer_bytes.labels(*labels).set(beat.kv_transfer_bytes)
        self.transfer_seconds.labels(*labels).set(beat.kv_transfer_seconds)
        self.worker_dropped.labels(*labels).set(beat.dropped_messages)
        for name, gauge in self.prefix.items():
            gauge.labels(*labels).set(getattr(beat.prefix, name))

    def forget_worker(self, beat: HeartbeatMsg) -> None:
        """A dead worker's series disappear rather than freeze at their last value."""
        for gauge in self._per_worker:
            try:
                gauge.remove(beat.worker_id, beat.role)
            except KeyError:
                pass

    def observe_tokens(self, tokens: TokensMsg, received_at: float) -> None:
        if tokens.step_s:
            self.step.observe(tokens.step_s)
            self.cycle.observe(tokens.cycle_s)
            self.batch.observe(len(tokens.items))
            self.transit.observe(max(0.0, received_at - tokens.sent_at))

    def render(self) -> bytes:
        for kind, count in protocol.DROPPED.items():
            self.dropped.labels(kind).set(count)
        return generate_latest(self.registry)
