"""Metric definitions of the load generator on synthetic timings (vLLM's definitions)."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.metrics import Cost, Dist, RequestResult, Slo, summarize


def req(ttft, latency, n_out, itl=(), n_in=10, ok=True, error=""):
    return RequestResult(
        ok, n_in, n_out, ttft_s=ttft, latency_s=latency, itl_s=tuple(itl), error=error
    )


def test_tpot_excludes_the_first_token():
    r = req(0.100, 0.500, 5, itl=(0.1, 0.1, 0.1, 0.1))
    assert r.tpot_s == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert req(0.1, 0.1, 1).tpot_s is None  # one token: no TPOT
    assert req(0.1, 0.5, 5, ok=False, error="timeout").tpot_s is None


def test_summary_pools_itl_over_requests_and_averages_tpot_per_request():
    a = req(0.050, 0.090, 3, itl=(0.010, 0.030))  # TPOT (0.09 - 0.05) / 2 = 20 ms
    b = req(0.150, 0.170, 2, itl=(0.020,))  # TPOT 20 ms
    s = summarize([a, b], duration_s=2.0)
    assert s.itl.count == 3 and s.itl.mean == pytest.approx(20.0)  # pooled gaps 10, 30, 20
    assert s.itl.p50 == pytest.approx(20.0)
    assert s.ttft.mean == pytest.approx(100.0) and s.ttft.p50 == pytest.approx(100.0)
    assert s.tpot.mean == pytest.approx(20.0) and s.tpot.count == 2
    assert s.e2e.p99 == pytest.approx(np.percentile([90.0, 170.0], 99))
    assert s.output_throughput == pytest.approx(5 / 2.0)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.total_token_throughput == pytest.approx((20 + 5) / 2.0)


def test_failed_requests_count_as_errors_by_kind_and_not_in_throughput():
    results = [
        req(0.1, 0.2, 4, itl=(0.03, 0.03, 0.04)),
        req(0, 0.01, 0, ok=False, error="http_429"),
        req(0, 0.01, 0, ok=False, error="http_429"),
        req(0, 30.0, 0, ok=False, error="timeout"),
    ]
    s = summarize(results, duration_s=1.0)
    assert (s.num_requests, s.completed) == (4, 1)
    assert s.errors == {"http_429": 2, "timeout": 1}
    assert s.total_output_tokens == 4 and s.total_input_tokens == 10
    assert s.e2e.count == 1 and s.e2e.p99 == pytest.approx(200.0)


def test_goodput_counts_completed_requests_meeting_every_slo():
    results = [
        req(0.100, 0.500, 11),  # TTFT 100 ms, TPOT 40 ms: good
        req(0.300, 0.700, 11),  # TTFT 300 ms: misses the TTFT SLO
        req(0.100, 1.100, 11),  # TPOT 100 ms: misses the TPOT SLO
        req(0.100, 0.100, 1),  # one token: TPOT counts as 0, good
        req(0.0, 0.05, 0, ok=False, error="http_503"),
    ]
    s = summarize(results, 4.0, Slo(ttft_ms=200, tpot_ms=50))
    assert s.good == 2 and s.goodput == pytest.approx(0.5)
    only_ttft = summarize(results, 4.0, Slo(ttft_ms=200))
    assert only_ttft.good == 3
    with_e2e = summarize(results, 4.0, Slo(ttft_ms=200, tpot_ms=50, e2e_ms=300))
    assert with_e2e.good == 1
    assert summarize(results, 4.0).goodput is None  # no SLO, no goodput


def test_cost_per_million_tokens():
    cost = Cost(gpu_hour_cost=2.0, num_devices=4)
    # Four $2 devices for half an hour = $4 for 1M tokens.
    assert cost.per_million(1800.0, 1_000_000) == pytest.approx(4.0)
    assert cost.per_million(1800.0, 500_000) == pytest.approx(8.0)
    assert cost.per_million(10.0, 0) is None
    s = summarize([req(0.1, 1.0, 1000, n_in=3000)], 3600.0, cost=Cost(1.5, 2))
    assert s.cost_per_m_output == pytest.approx(3.0 / 1000 * 1e6)
    assert s.cost_per_m_total == pytest.approx(3.0 / 4000 * 1e6)


def test_empty_runs_have_no_latencies():
    s = summarize([req(0, 0.01, 0, ok=False, error="connect")], 1.0)
    assert s.ttft == Dist() and s.ttft.p99 is None
    assert s.completed == 0 and s.output_throughput == 0.0


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=50))
def test_dist_is_ordered_and_in_range(values):
    d = Dist.of_seconds(values)
    assert d.count == len(values)
    lo, hi = min(values) * 1000, max(values) * 1000
    assert lo - 1e-6 <= d.p50 <= d.p90 <= d.p99 <= hi + 1e-6
    assert lo - 1e-6 <= d.mean <= hi + 1e-6


def test_request_result_json_round_trip():
    r = req(0.1, 0.3, 3, itl=(0.1, 0.1))
    assert RequestResult.from_json(r.to_json()) == r
    s = summarize([r], 1.0, Slo(ttft_ms=500), Cost(1.0))
    assert type(s).from_json(s.to_json()) == s
    assert not math.isnan(s.request_throughput)
