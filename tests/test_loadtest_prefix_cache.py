"""The prefix-cache scenario without `tison up`: its counters, its workloads, and its rounds and
report against fake servers (tests/fake_openai.py) that count prefix hits on /metrics."""

import argparse
import json

import pytest

from loadtest.scenarios import prefix_cache
from loadtest.scenarios.prefix_counters import metrics_urls, prefix_counters, prefix_use
from loadtest.scenarios.prefix_report import write
from loadtest.target import Target
from shared.tokenizer.tokenizer import Tokenizer

from fake_openai import fake_server
from tiny_models import build_tokenizer

EXPOSITION = """# HELP tison_prefix_cache_hit_tokens_total Prompt tokens found in the cache
# TYPE tison_prefix_cache_hit_tokens_total counter
tison_prefix_cache_hit_tokens_total{worker="p0",role="prefill"} 30.0
tison_prefix_cache_hit_tokens_total{worker="p1",role="prefill"} 10.0
tison_prefix_cache_hit_tokens_created{worker="p0",role="prefill"} 1.7e9
# TYPE tison_prefix_cache_queried_tokens_total counter
tison_prefix_cache_queried_tokens_total{worker="p0",role="prefill"} 50.0
tison_prefix_cache_queried_tokens_total{worker="p1",role="prefill"} 50.0
# TYPE tison_kv_pages_used gauge
tison_kv_pages_used{worker="p0",role="prefill"} 7.0
"""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return Tokenizer.from_dir(out)


def args(**kw) -> argparse.Namespace:
    base = dict(
        sessions=3,
        turns=3,
        prefix_len=40,
        num_prefixes=1,
        input_len="8",
        output_len=4,
        rate=20.0,
        rounds=2,
        seed=0,
        max_duration=60.0,
        command="python -m loadtest.scenarios.prefix_cache --test",
        prefill_workers=1,
        decode_workers=1,
    )
    return argparse.Namespace(**{**base, **kw})


def test_counters_sum_over_workers_and_tolerate_absence():
    counters = prefix_counters(EXPOSITION)
    assert counters == {
        "tison_prefix_cache_hit_tokens_total": 40.0,
        "tison_prefix_cache_queried_tokens_total": 100.0,
    }
    before = {k: v / 4 for k, v in counters.items()}
    use = prefix_use(before, counters)
    assert (use.hit_tokens, use.queried_tokens, use.computed_tokens) == (30.0, 75.0, 45.0)
    assert use.hit_rate == pytest.approx(0.4)
    assert prefix_use({}, {}).to_json() == {
        "hit_tokens": None,
        "queried_tokens": None,
        "computed_tokens": None,
        "hit_rate": None,
    }
    # hits and misses only: queried = hit + miss, computed = miss
    other = {"tison_prefix_cache_hits_tokens": 6.0, "tison_prefix_cache_miss_tokens": 2.0}
    assert prefix_use({}, other).hit_rate == pytest.approx(0.75)
    assert prefix_use({}, other).computed_tokens == 2.0


def test_metrics_urls_come_from_the_gateway_and_the_log(tmp_path):
    log = tmp_path / "up.log"
    log.write_text("worker p0 metrics at http://127.0.0.1:9101/metrics\nnoise http://x/y\n")
    assert metrics_urls("http://127.0.0.1:8000/", log) == [
        "http://127.0.0.1:8000/metrics",
        "http://127.0.0.1:9101/metrics",
    ]
    assert metrics_urls("http://127.0.0.1:8000", tmp_path / "none.log") == [
        "http://127.0.0.1:8000/metrics"
    ]


def test_no_reuse_prompts_have_the_agent_turns_lengths(tokenizer):
    a = args()
    work = prefix_cache.agent_workload(tokenizer, a, seed=1)
    specs = prefix_cache.no_reuse_specs(tokenizer, work, seed=1)
    wanted = []
    for s in work.sessions:
        length = len(s.prefix_ids)
        for t in s.turns:
            wanted.append(length + len(t.token_ids))
            length += len(t.token_ids) + t.max_tokens
    assert len(specs) == work.num_requests == 9
    got = sorted(s.prompt_len for s in specs)
    assert all(abs(g - w) <= 3 for g, w in zip(got, sorted(wanted)))  # re-encoding drifts
    assert len({s.text[:20] for s in specs}) == 9  # nothing shared


def test_rounds_and_report_against_fake_servers(tokenizer, tmp_path):
    a = args()
    with fake_server() as cached, fake_server() as plain:
        sides = {
            "kv": (Target(cached.url, "fake", ignore_eos=True), [cached.url + "/metrics"]),
            "off": (Target(plain.url, "fake", ignore_eos=True), []),  # no counters: n/a
            "rr": (Target(cached.url, "fake", ignore_eos=True), [cached.url + "/metrics"]),
        }
        results = prefix_cache.run_all(sides, tokenizer, a)
        hit, queried = cached.hit_tokens, cached.queried_tokens
    assert [len(results[n]["agent"]) for n in sides] == [2, 2, 2]
    assert [len(results[n]["random"]) for n in sides] == [2, 2, 0]  # no-reuse skips rr
    kv = results["kv"]["agent"] + results["rr"]["agent"] + results["kv"]["random"]
    assert (
        sum(m.use.hit_tokens for m in kv) == hit
        and sum(m.use.queried_tokens for m in kv) == queried
    )
    assert all(m.report.runs[0].summary.completed == 9 for m in results["kv"]["agent"])
    first = results["kv"]["agent"][0].use
    assert (
        0.5 < first.hit_rate < 1
        and first.computed_tokens == first.queried_tokens - first.hit_tokens
    )
    assert all(m.use.hit_rate is None for m in results["off"]["agent"])
    md = write(results, a, prefix_cache.describe(a), tmp_path)
    assert "| cache on, --routing kv |" in md and "n/a" in md and "turn 3" in md
    assert "| agent TTFT p50, kv / cache off |" in md
    body = json.loads((tmp_path / "prefix_cache.json").read_text())
    assert body["configs"]["kv"]["flags"] == ["--routing", "kv"]
    assert body["configs"]["kv"]["agent"][0]["prefix"]["hit_rate"] == pytest.approx(first.hit_rate)
    assert {t["target"]: t["verdict"] for t in body["targets"]}["agent prefix hit rate, kv"] in (
        "met",
        "MISSED",
    )
    assert (tmp_path / "kv-agent-round2.json").is_file()
    assert (tmp_path / "off-random-round1.md").is_file()


def test_lengths_past_the_context_are_refused(tokenizer, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    work = prefix_cache.agent_workload(tokenizer, args(), seed=0)
    with pytest.raises(SystemExit, match="64 positions"):
        prefix_cache.check_fits(tmp_path, work)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    prefix_cache.check_fits(tmp_path, work)
