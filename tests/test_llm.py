"""The offline API: text in, text out; stop conditions, logprobs, seeds, page accounting."""

import subprocess
import sys

import pytest

from shared.engine.llm import LLM
from shared.sampling.params import SamplingParams

from engine_helpers import hf_greedy

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\n", "Once upon a time", "東京 🙂"]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32")


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_text_prompts_match_transformers(llm, tiny_llama):
    outs = llm.generate(PROMPTS, greedy(32))
    refs = hf_greedy(tiny_llama, [llm.tokenizer.encode(p) for p in PROMPTS])
    assert [o.token_ids for o in outs] == refs
    for o in outs:
        assert o.text == llm.tokenizer.decode(o.token_ids)
        assert o.finish_reason in ("stop", "length")
    assert llm.engine.num_pages_used == 0


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    out = llm.chat([messages], greedy(8, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert len(out.token_ids) == 8


def test_stop_string_is_left_out(llm):
    full = llm.generate(PROMPTS[0], greedy(24, ignore_eos=True))[0]
    # a stop string from the middle of the output: a clean ASCII token's text
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids[4:]]
    stop = next(p for p in pieces if len(p.strip()) >= 2 and p.isascii() and p.isprintable())
    out = llm.generate(PROMPTS[0], greedy(24, ignore_eos=True, stop=[stop]))[0]
    assert out.text == full.text[: full.text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert llm.engine.num_pages_used == 0


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate(PROMPTS[1], greedy(24, ignore_eos=True))[0]
    stop_token = full.token_ids[2]
    out = llm.generate(PROMPTS[1], greedy(24, stop_token_ids=[stop_token]))[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_token)
    late = llm.generate(PROMPTS[1], greedy(24, stop_token_ids=[stop_token], min_tokens=10))[0]
    assert len(late.token_ids) >= 10
    assert stop_token not in late.token_ids[:9]


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPTS[2], greedy(5, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (5, "length")


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], greedy(6, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top_ids) == len(lp.top_logprobs) == 3
        assert lp.top_ids[0] == token and lp.top_logprobs[0] == pytest.approx(lp.logprob)
        assert lp.top_logprobs[0] >= lp.top_logprobs[1] >= lp.top_logprobs[2]
        assert lp.logprob <= 0


def test_seeded_sampling_ignores_batch_companions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[3], seeded)[0].token_ids
    others = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in range(4)
    ]
    batch = llm.generate(
        PROMPTS[:2] + [PROMPTS[3]] + PROMPTS[2:4], others[:2] + [seeded] + others[2:]
    )
    assert batch[2].token_ids == alone
    again = llm.generate([PROMPTS[4], PROMPTS[3]], [others[0], seeded])[1].token_ids
    assert again == alone
    different = llm.generate(
        PROMPTS[3], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    )
    assert different[0].token_ids != alone


def test_pages_return_to_zero_after_abort(llm):
    engine = llm.engine
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    for i, p in enumerate(ids):
        engine.add_request(f"abort-{i}", p, greedy(40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.num_pages_used > 0
    assert engine.abort("abort-0") and engine.abort("abort-3")
    assert not engine.abort("abort-0")  # already gone
    while engine.has_unfinished():
        engine.step()
    assert engine.num_pages_used == 0
    engine.add_request("waiting", ids[0], greedy(4))
    assert engine.abort("waiting")  # never scheduled: nothing to free, nothing leaks
    assert engine.num_pages_used == 0 and not engine.has_unfinished()


def test_cli_generate_prints_only_the_completion(llm, tiny_llama):
    expected = llm.generate(PROMPTS[0], greedy(8))[0].text
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "generate",
            "--model",
            str(tiny_llama),
            "--dtype",
            "float32",
            "--max-tokens",
            "8",
            PROMPTS[0],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + ("" if expected.endswith("\n") else "\n")
