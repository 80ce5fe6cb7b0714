"""The agent workload: multi-turn sessions whose every turn resends the history, against a real
aiohttp server (tests/fake_openai.py) that records each prompt and answers with text made
from it."""

import json

import numpy as np
import pytest

from loadtest.bench import WorkloadConfig, make_requests, run_sync
from loadtest.metrics import ttft_by_turn
from loadtest.runner import Load, run_sessions
from loadtest.target import Target
from loadtest.workloads import AgentWorkload, Conversation, LengthDist, PromptMaker, agent_sessions
from services.cli import main as tison
from shared.errors import InvalidRequestError
from shared.tokenizer.tokenizer import Tokenizer

from fake_openai import FIRST_S, fake_server, output_words
from services_harness import free_port
from tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def server():
    with fake_server() as fake:
        yield fake


@pytest.fixture
def fake(server):
    server.reset()
    return server


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return Tokenizer.from_dir(out)


def workload(tokenizer, sessions=4, turns=3, think_time_s=0.0, seed=0) -> AgentWorkload:
    maker = PromptMaker(tokenizer, np.random.default_rng(seed))
    ins, outs = LengthDist.parse("uniform:4:9"), LengthDist.parse("3")
    return agent_sessions(maker, sessions, turns, 24, 2, ins, outs, think_time_s)


def expected_prompts(work: AgentWorkload, chat: bool) -> list[list[tuple]]:
    """Per session, the prompt of each turn as the fake server's answers make it."""
    out = []
    for s in work.sessions:
        ids, messages, prompts = list(s.prefix_ids), [("system", s.prefix)], []
        for turn in s.turns:
            ids += turn.token_ids
            messages.append(("user", turn.text))
            prompt = tuple(messages) if chat else tuple(ids)
            prompts.append(prompt)
            text = "".join(output_words(prompt, turn.max_tokens))
            ids += work.encode(text)
            messages.append(("assistant", text))
        out.append(prompts)
    return out


def test_conversation_extends_the_previous_prompt_exactly(tokenizer):
    work = workload(tokenizer, sessions=1, turns=3)
    (session,) = work.sessions
    talk = Conversation(session, work.encode)
    first = talk.next_request()
    assert first.prompt_ids == (*session.prefix_ids, *session.turns[0].token_ids)
    assert first.messages == (("system", session.prefix), ("user", session.turns[0].text))
    assert first.prompt_len == len(first.prompt_ids) and first.max_tokens == 3
    talk.record_output(" the lazy dog")
    second = talk.next_request()
    reply = tuple(work.encode(" the lazy dog"))
    assert second.prompt_ids == (*first.prompt_ids, *reply, *session.turns[1].token_ids)
    assert second.messages == (
        *first.messages,
        ("assistant", " the lazy dog"),
        ("user", session.turns[1].text),
    )
    talk.record_output("")  # an output of no text (an end-of-sequence at once)
    assert talk.next_request().prompt_ids == (*second.prompt_ids, *session.turns[2].token_ids)
    talk.record_output("x")
    assert talk.finished


def test_agent_workload_is_reproducible_and_shaped(tokenizer):
    cfg = WorkloadConfig(
        kind="agent",
        num_sessions=6,
        num_turns=3,
        prefix_len=30,
        num_prefixes=2,
        input_len="uniform:5:10",
        output_len="4",
        seed=3,
    )
    work = make_requests(cfg, tokenizer)
    assert work.sessions == make_requests(cfg, tokenizer).sessions and work.num_requests == 18
    assert len({s.prefix_ids for s in work.sessions}) == 2  # two shared system prompts
    for s in work.sessions:
        assert 20 <= len(s.prefix_ids) <= 30 and len(s.turns) == 3
        assert all(1 <= len(t.token_ids) <= 14 and t.max_tokens == 4 for t in s.turns)
    assert "6 sessions x 3 turns" in cfg.describe()
    with pytest.raises(InvalidRequestError):
        WorkloadConfig(kind="agent", num_turns=0)
    with pytest.raises(InvalidRequestError):
        WorkloadConfig(kind="agent", think_time_s=-1)


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_sessions_resend_their_history_one_turn_at_a_time(fake, tokenizer, api):
    work = workload(tokenizer)
    target = Target(fake.url, "fake", api)
    load = Load(rate=20.0)
    out = run_sync(run_sessions(target, work, load, max_duration_s=60, seed=5))
    assert len(out.results) == 12 and all(r.ok for r in out.results)
    assert [(r.session, r.turn) for r in out.results] == [
        (s, t) for s in range(4) for t in range(3)
    ]
    assert all(r.output_len == 3 for r in out.results)
    # every prompt arrived exactly as the history makes it: previous prompt + output + user turn
    seen = {prompt: (arrived, finished) for arrived, finished, prompt in fake.seen}
    assert len(fake.seen) == len(seen) == 12
    for prompts in expected_prompts(work, chat=api == "chat"):
        times = [seen[p] for p in prompts]
        # sequential: turn k + 1 came in only after turn k's answer was complete
        assert all(done <= nxt for (_, done), (nxt, _) in zip(times, times[1:]))
    # sessions start as the Poisson process of the load, turn 0 at its arrival offsets
    starts = [r.start_s for r in out.results if r.turn == 0]
    offsets = load.arrival_offsets(4, np.random.default_rng(5))
    # never early. How late is the event loop's business: no upper bound here, since a loaded
    # 2-core CI machine delayed one start by more than 1 s (performance is loadtest's to measure)
    assert all(s >= o - 1e-9 for s, o in zip(starts, offsets))
    assert starts == sorted(starts)
    by_turn = ttft_by_turn(out.results)
    assert list(by_turn) == [0, 1, 2] and all(d.count == 4 for d in by_turn.values())
    assert all(d.p50 >= FIRST_S * 1000 for d in by_turn.values())


def test_concurrency_caps_sessions_and_think_time_spaces_turns(fake, tokenizer):
    work = workload(tokenizer, sessions=4, turns=2, think_time_s=0.1)
    target = Target(fake.url, "fake")
    out = run_sync(run_sessions(target, work, Load(concurrency=2), max_duration_s=60))
    assert len(out.results) == 8 and all(r.ok for r in out.results)
    assert fake.max_in_flight == 2  # two sessions at a time, each one request at a time
    for first, second in zip(out.results[::2], out.results[1::2]):
        assert second.start_s - (first.start_s + first.latency_s) >= 0.1 - 0.005  # loop clock


def test_a_failed_turn_ends_its_session(tokenizer):
    work = workload(tokenizer, sessions=3, turns=3)
    target = Target(f"http://127.0.0.1:{free_port()}", "nobody")
    out = run_sync(run_sessions(target, work, Load(), max_duration_s=30))
    assert [(r.session, r.turn, r.error) for r in out.results] == [
        (s, 0, "connect") for s in range(3)
    ]


def test_bench_cli_agent_workload(fake, tmp_path, capsys):
    code = tison(
        [
            "bench",
            "run",
            "--base-url",
            fake.url,
            "--workload",
            "agent",
            "--num-sessions",
            "3",
            "--turns",
            "2",
            "--prefix-len",
            "40",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--request-rate",
            "10",
            "--think-time",
            "0.01",
            "--no-progress",
            "--no-plots",
            "--out",
            str(tmp_path / "agent"),
        ]
    )
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "agent.json").read_text())
    assert (
        report["meta"]["model"] == "fake" and "3 sessions x 2 turns" in report["meta"]["workload"]
    )
    (run,) = report["runs"]
    assert run["summary"]["completed"] == 6 and len(fake.seen) == 6
    assert sorted((r["session"], r["turn"]) for r in run["requests"]) == [
        (s, t) for s in range(3) for t in range(2)
    ]
    md = (tmp_path / "agent.md").read_text()
    assert "| turn | TTFT mean |" in md and "\n| 2 |" in md


def test_a_run_keeps_the_earlier_objects_out_of_the_collectors_view(fake, tokenizer):
    """No full collection over what the process held before the run stalls its arrival loop:
    those objects are frozen while it runs, and given back after."""
    import gc

    class Frozen:
        counts: list[int] = []

        def update(self, result) -> None:
            self.counts.append(gc.get_freeze_count())

    gc.unfreeze()
    seen = Frozen()
    work = workload(tokenizer, sessions=2, turns=1)
    run_sync(run_sessions(Target(fake.url, "fake"), work, Load(), 60, progress=seen))
    assert len(seen.counts) == 2 and min(seen.counts) > 1000
    assert gc.get_freeze_count() == 0
