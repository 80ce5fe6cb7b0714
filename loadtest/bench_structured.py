"""Structured-output benchmark: batch-32 decode tokens/s with a JSON schema on every row beside
the same decode with none, in paired rounds of the same run, on bench_engine's random-weight
~150M Llama (vocab 32000, with bench_grammar's 32000-token BPE as its tokenizer).

A fair pair: both sides decode exactly --new-tokens tokens a row after the same prompts, greedy.
The free side ignores EOS; the schema (an array of 500 small records: integers with bounds,
an enum, a boolean, a string of at most 8 characters) cannot be complete within that many
tokens, so it never allows EOS there either; each round checks every row ran the full length.
Two schema sides: masks filled on a thread beside the forward pass (the engine's choice when
a core is left) and filled before it (`Grammars.background = False`, its choice when torch
takes every core), which shows what the overlap buys here.

    python -m loadtest.bench_structured [--dtype float32] [--threads 2] [--rounds 4]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtest.bench_engine import MODELS, prompts
from loadtest.bench_grammar import tokenizer_32k
from loadtest.random_model import save_random_llama
from shared.cpu_report import report as env_report
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import FinishReason
from shared.huge_pages import restart_with_huge_pages
from shared.sampling.params import SamplingParams
from shared.sampling.structured import JSON, StructuredOutput

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["file", "directory", "link"]},
        "hidden": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["id", "kind", "hidden", "name"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "minItems": 500, "maxItems": 500, "items": RECORD}
SIDES = ("none", "schema, masks beside the forward", "schema, masks before the forward")


def decode_tok_s(engine: LLMEngine, side: str, batch: int, prompt_len: int, new: int) -> float:
    """Decode tokens/s of one side: tokens after the first of each row / time after prefill."""
    spec = None if side == "none" else StructuredOutput(JSON, json.dumps(SCHEMA))
    engine.grammars.background = side == SIDES[1]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, structured=spec)
    requests = [
        engine.add_request(f"{side}-{i}", p, params)
        for i, p in enumerate(prompts(batch, prompt_len))
    ]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        engine.step()
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(s.new_token_ids) for s in engine.step())
    elapsed = time.perf_counter() - start
    short = [r for r in requests if r.finish_reason != FinishReason.LENGTH]
    assert not short and all(len(r.output_token_ids) == new for r in requests), "unequal runs"
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds, sides rotated")
    args = ap.parse_args()
    restart_with_huge_pages()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_random_llama(folder, MODELS["dense"], getattr(torch, args.dtype))
        tokenizer_32k(folder)
        engine = LLMEngine(EngineConfig(model_dir=folder, dtype=args.dtype, kv_cache_bytes=2 << 30))
        for side in SIDES:  # warm-up, and the tokenizer's one-off build
            decode_tok_s(engine, side, 4, 8, 4)
        rounds = []
        for i in range(args.rounds):
            order = SIDES[i % 3 :] + SIDES[: i % 3]
            shape = (args.batch, args.prompt_len, args.new_tokens)
            rounds.append({side: decode_tok_s(engine, side, *shape) for side in order})
        engine.close()
    facts = env_report()
    print(
        f"CPU: {facts['cpu']} ({facts['cores']} cores), tier {facts['tier']}; torch "
        f"{torch.__version__}; {args.threads} threads; {args.dtype}; batch {args.batch}, "
        f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens; {args.rounds} rounds"
    )
    print(f"| {'side':34} | tok/s (median) | ratio to none (median, range) |")
    print(f"|{'-' * 36}|----------------|-------------------------------|")
    for side in SIDES:
        ratios = [r[side] / r["none"] for r in rounds]
        print(
            f"| {side:34} | {statistics.median(r[side] for r in rounds):14.1f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )


if __name__ == "__main__":
    main()
