"""Workloads, the result file, its Markdown report, `compare` and the plots."""

import json

import numpy as np
import pytest

from loadtest.bench import WorkloadConfig, make_requests, sweep
from loadtest.compare import compare_table
from loadtest.metrics import Cost, RequestResult, Slo, summarize
from loadtest.plots import compare_plots, report_plots
from loadtest.report import BenchReport, RunRecord, markdown
from loadtest.runner import Load
from loadtest.workloads import LengthDist, PromptMaker, mixed, random_requests, sharegpt_requests
from shared.errors import InvalidRequestError
from shared.tokenizer.tokenizer import Tokenizer

from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return Tokenizer.from_dir(out)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("64").sample(rng, 3) == [64, 64, 64]
    uniform = LengthDist.parse("uniform:10:20").sample(rng, 2000)
    assert min(uniform) == 10 and max(uniform) == 20
    normal = np.array(LengthDist.parse("normal:500:50").sample(rng, 4000))
    assert normal.mean() == pytest.approx(500, rel=0.02) and normal.std() == pytest.approx(
        50, rel=0.1
    )
    exp = np.array(LengthDist.parse("exp:100").sample(rng, 4000))
    assert exp.mean() == pytest.approx(100, rel=0.08) and exp.min() >= 1
    for bad in ("abc", "uniform:5", "uniform:9:3", "gauss:1:2", "exp:-1"):
        with pytest.raises(InvalidRequestError):
            LengthDist.parse(bad)


def test_random_prompts_have_the_asked_length(tokenizer):
    maker = PromptMaker(tokenizer, np.random.default_rng(1))
    specs = random_requests(maker, 20, LengthDist.parse("uniform:20:60"), LengthDist.parse("7"))
    for s in specs:
        assert s.prompt_len == len(tokenizer.encode(s.text, add_special_tokens=False))
        assert 15 <= s.prompt_len <= 60 and s.max_tokens == 7
    again = random_requests(
        PromptMaker(tokenizer, np.random.default_rng(1)),
        20,
        LengthDist.parse("uniform:20:60"),
        LengthDist.parse("7"),
    )
    assert again == specs  # reproducible from the seed


def test_shared_prefix_workload(tokenizer):
    cfg = WorkloadConfig(
        "shared-prefix", 30, input_len="16", output_len="4", prefix_len=100, num_prefixes=3, seed=2
    )
    specs = make_requests(cfg, tokenizer)
    prefixes = {s.prefix for s in specs}
    assert len(specs) == 30 and len(prefixes) == 3
    assert len({s.text for s in specs}) == 30  # every tail differs
    for s in specs:
        assert s.prompt_len >= 100 * 0.9 + 16 * 0.9


def test_sharegpt_file(tokenizer, tmp_path):
    long_reply = "the quick brown fox jumps over the lazy dog " * 6
    data = [
        {
            "conversations": [
                {"from": "human", "value": "tell me about the lazy dog please"},
                {"from": "gpt", "value": long_reply},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        {
            "conversations": [
                {"role": "user", "content": "print the numbers from one to ten"},
                {"role": "assistant", "content": long_reply},
            ]
        },
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    maker = PromptMaker(tokenizer, np.random.default_rng(0))
    specs = sharegpt_requests(maker, path, 10)
    assert sorted(s.text for s in specs) == [
        "print the numbers from one to ten",
        "tell me about the lazy dog please",
    ]  # "hi" is under 4 tokens; the one-turn entry has no reply
    assert {s.max_tokens for s in specs} == {maker.count(long_reply)}
    assert {s.max_tokens for s in sharegpt_requests(maker, path, 10, output_len=9)} == {9}
    with pytest.raises(InvalidRequestError, match="dataset"):
        WorkloadConfig("sharegpt", 5)


def test_mixed_keeps_every_request():
    a = [f"a{i}" for i in range(5)]
    b = [f"b{i}" for i in range(7)]
    out = mixed(np.random.default_rng(0), a, b)
    assert sorted(out) == sorted(a + b) and out != a + b


def test_sweeps():
    assert sweep([1, 2], [8]) == [Load(1, 8), Load(2, 8)]
    assert sweep([], [4, 16]) == [Load(concurrency=4), Load(concurrency=16)]
    assert sweep([5.0], []) == [Load(5.0)]
    with pytest.raises(InvalidRequestError):
        sweep([1, 2], [3, 4])


def fake_report(label: str, scale: float, loads=(1.0, 2.0)) -> BenchReport:
    """Synthetic runs whose latencies grow with `scale` and load."""
    runs = []
    rng = np.random.default_rng(int(scale * 10))
    for rate in loads:
        results = []
        for i in range(40):
            ttft = scale * rate * (0.05 + 0.01 * rng.random())
            itl = tuple(scale * 0.01 * (1 + rng.random()) for _ in range(9))
            results.append(RequestResult(True, 50, 10, i / rate, ttft, ttft + sum(itl), itl))
        results.append(RequestResult(False, 50, 0, 0.0, 0.0, 0.1, (), "http_429", "full"))
        summary = summarize(results, 40 / rate, Slo(ttft_ms=80, tpot_ms=15), Cost(2.0, 1))
        runs.append(RunRecord(Load(rate), summary, tuple(results)))
    meta = {
        "label": label,
        "target": "http://127.0.0.1:1",
        "model": "m",
        "api": "completions",
        "stream": True,
        "workload": "synthetic",
        "slo": {"ttft_ms": 80, "tpot_ms": 15},
    }
    return BenchReport(meta, tuple(runs))


def test_report_round_trip_and_markdown(tmp_path):
    report = fake_report("A", 1.0)
    report.save(tmp_path / "a.json")
    loaded = BenchReport.load(tmp_path / "a.json")
    assert loaded == report
    text = markdown(loaded, ["x/a-cdf.png"])
    assert "| 1 req/s | 40/41 |" in text and "| 2 req/s | 40/41 |" in text
    assert "http_429 1" in text and "![a-cdf](a-cdf.png)" in text
    assert "TTFT ≤ 80 ms, TPOT ≤ 15 ms" in text
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    with pytest.raises(InvalidRequestError):
        BenchReport.load(tmp_path / "bad.json")


def test_compare_prints_ratios():
    a, b = fake_report("colocated", 2.0), fake_report("disaggregated", 1.0)
    table = compare_table(a, b)
    row = next(line for line in table.splitlines() if line.startswith("| ITL p99 ms"))
    itl_a, itl_b = a.runs[0].summary.itl.p99, b.runs[0].summary.itl.p99
    assert f"{itl_b / itl_a:.2f}x" in row and row.endswith("| B |")  # lower latency: B better
    tput = next(line for line in table.splitlines() if line.startswith("| output tokens/s"))
    assert "1.00x" in tput and tput.endswith("|  |")  # same throughput: no winner
    assert table.count("### ") == 2


def test_plots_are_pngs(tmp_path):
    a, b = fake_report("A", 1.0), fake_report("B", 1.5)
    paths = report_plots(a, tmp_path / "a") + compare_plots(a, b, tmp_path / "vs")
    assert [p.name for p in paths] == ["a-cdf.png", "a-load.png", "vs-cdf.png", "vs-load.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
