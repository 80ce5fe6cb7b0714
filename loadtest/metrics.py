"""Per-request timings → run metrics, with vLLM's definitions (`vllm bench serve`). Pure.

- TTFT: request sent → first streamed chunk carrying output text (vLLM takes any chunk with a
  choice, which times a role-only first chunk; the client skips those and empty closing ones).
- ITL: the gaps between consecutive output tokens, pooled over all requests (an event of k
  tokens gives k gaps of its gap / k, see client.token_gaps; vLLM's bench takes a gap an event).
- TPOT: per request, (E2E − TTFT) / (output tokens − 1); requests with one token have none.
- E2E: request sent → response complete.
- Goodput: completed requests per second whose every given SLO holds (TTFT ≤ slo_ttft,
  TPOT ≤ slo_tpot, E2E ≤ slo_e2e; a one-token request has TPOT 0).
- Throughputs divide by the run's duration: first request sent → last response ended.
"""

import math
from dataclasses import asdict, dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestResult:
    """What the load generator saw of one request. Times in seconds."""

    ok: bool  # completed without error
    prompt_len: int  # prompt tokens (the server's usage when it reports one)
    output_len: int  # output tokens (usage, else the number of streamed chunks)
    start_s: float = 0.0  # when it was sent, from the start of the run
    ttft_s: float = 0.0  # first output chunk (E2E for non-streamed requests)
    latency_s: float = 0.0  # E2E
    itl_s: tuple[float, ...] = ()  # gaps between consecutive output tokens (client.token_gaps)
    error: str = ""  # error kind when not ok: "http_429", "timeout", "stream_error", ...
    detail: str = ""  # the error message, shortened
    itl_per_token: bool = True  # False: the server sent tokens several an event uncounted,
    # so itl_s has a gap per event
    session: int | None = None  # agent workload: the session's index, from 0
    turn: int | None = None  # agent workload: the turn's index within its session, from 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_len < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_len - 1)

    def to_json(self) -> dict:
        return {**asdict(self), "itl_s": list(self.itl_s)}

    @classmethod
    def from_json(cls, body: dict) -> "RequestResult":
        return cls(**{**body, "itl_s": tuple(body.get("itl_s", ()))})


@dataclass(frozen=True)
class Dist:
    """Mean and percentiles of one latency, in milliseconds; None when nothing was measured."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    count: int = 0

    @classmethod
    def of_seconds(cls, values: list[float]) -> "Dist":
        if not values:
            return cls()
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, len(values))


@dataclass(frozen=True)
class Spread:
    """Per-round ratios of a paired comparison: their median and range."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, ratios: list[float]) -> "Spread":
        return cls(float(np.median(ratios)), min(ratios), max(ratios))

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.lo:.2f}-{self.hi:.2f})"


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None: not part of goodput."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, r: RequestResult) -> bool:
        """vLLM's rule: a completed request whose every set objective holds."""
        if not r.ok:
            return False
        measured = (r.ttft_s, r.tpot_s or 0.0, r.latency_s)
        limits = (self.ttft_ms, self.tpot_ms, self.e2e_ms)
        return all(lim is None or value * 1000.0 <= lim for value, lim in zip(measured, limits))


@dataclass(frozen=True)
class Cost:
    """Device price: `gpu_hour_cost` per device-hour, `num_devices` devices held for the run."""

    gpu_hour_cost: float
    num_devices: int = 1

    def per_million(self, duration_s: float, num_tokens: int) -> float | None:
        """Price of a million tokens at the rate this run produced them."""
        if num_tokens <= 0 or duration_s <= 0:
            return None
        return self.gpu_hour_cost * self.num_devices * duration_s / 3600.0 / num_tokens * 1e6


@dataclass(frozen=True)
class Summary:
    """The metrics of one run (one load point)."""

    duration_s: float
    num_requests: int
    completed: int
    errors: dict[str, int]  # error kind → count
    total_input_tokens: int  # of completed requests
    total_output_tokens: int
    request_throughput: float  # completed / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    itl_per_event: int = 0  # completed requests whose ITL could only be taken per event
    good: int | None = None  # requests meeting the SLOs (None: no SLO given)
    goodput: float | None = None  # good / s
    cost_per_m_output: float | None = None  # currency per million output tokens
    cost_per_m_total: float | None = None  # per million input + output tokens

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> "Summary":
        dists = {k: Dist(**body[k]) for k in ("ttft", "tpot", "itl", "e2e")}
        return cls(**{**body, **dists})


def summarize(
    results: list[RequestResult],
    duration_s: float,
    slo: Slo = Slo(),
    cost: Cost | None = None,
) -> Summary:
    """Metrics of a run from its requests and wall time."""
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    num_in = sum(r.prompt_len for r in done)
    num_out = sum(r.output_len for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    good = sum(slo.met_by(r) for r in done) if slo.is_set else None
    return Summary(
        duration_s=duration_s,
        num_requests=len(results),
        completed=len(done),
        errors=dict(sorted(errors.items())),
        total_input_tokens=num_in,
        total_output_tokens=num_out,
        request_throughput=len(done) * per_s,
        output_throughput=num_out * per_s,
        total_token_throughput=(num_in + num_out) * per_s,
        ttft=Dist.of_seconds([r.ttft_s for r in done]),
        tpot=Dist.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl=Dist.of_seconds([gap for r in done for gap in r.itl_s]),
        e2e=Dist.of_seconds([r.latency_s for r in done]),
        itl_per_event=sum(not r.itl_per_token for r in done),
        good=good,
        goodput=None if good is None else good * per_s,
        cost_per_m_output=cost.per_million(duration_s, num_out) if cost else None,
        cost_per_m_total=cost.per_million(duration_s, num_in + num_out) if cost else None,
    )


def ttft_by_turn(results: list[RequestResult]) -> dict[int, Dist]:
    """TTFT of the completed requests of each agent turn (turn index from 0 -> its Dist);
    empty when no request has a turn."""
    by_turn: dict[int, list[float]] = {}
    for r in results:
        if r.ok and r.turn is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft_s)
    return {t: Dist.of_seconds(v) for t, v in sorted(by_turn.items())}
