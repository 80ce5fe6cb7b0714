"""Per-token cost of the grammar engines' next-token masks on this CPU: llguidance and
xgrammar, whichever are importable (add a scratch install with PYTHONPATH=/tmp/xg).

For each tokenizer (the bundled one, vocab 8192, and a byte-level BPE of 32000 trained here on
the stdlib, the vocabulary of loadtest/random_model.py's bench model) it walks the tokens of a
real JSON document that a schema accepts (an array of 40 records: a few hundred tokens),
filling the mask before each token and advancing the matcher by it, and prints the median and
p90 microseconds per token of the fill, the advance, and the one-off compile. Then, with the
32000-token vocabulary, the sampler's cost of applying a batch of 32 such masks to the logits
(shared/sampling/token_mask.apply_): the C kernel beside the torch path, in paired rounds.

    python -m loadtest.bench_grammar [--repeats 3] [--threads 1]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from shared.cpu_report import report as env_report
from shared.default_model import default_model_dir

SCHEMA = {
    "type": "array",
    "minItems": 40,
    "maxItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["file", "directory", "link"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 1000000},
            "hidden": {"type": "boolean"},
        },
        "required": ["name", "kind", "size", "hidden"],
        "additionalProperties": False,
    },
}


def document() -> str:
    """A compact JSON text SCHEMA accepts, with names and numbers that vary."""
    kinds = SCHEMA["items"]["properties"]["kind"]["enum"]
    items = [
        {"name": f"entry_{i * 7919 % 1000}.txt", "kind": kinds[i % 3], "size": i * 1337,
         "hidden": i % 4 == 0}
        for i in range(40)
    ]  # fmt: skip
    return json.dumps(items, separators=(",", ":"))


def tokenizer_32k(out: Path) -> Path:
    """A 32000-token byte-level BPE trained on part of the stdlib (a few seconds)."""
    from shared.default_model.corpus import source_files
    from shared.default_model.tokenizer_files import train_tokenizer

    tok = train_tokenizer([text for _, text in source_files()[:600]], 32000)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def bench_llguidance(tokenizer_json: Path, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json.read_text())
    info_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    mask = llt.allocate_token_bitmask(1, tok.vocab_size)
    fills, advances, compiles = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compiles.append(time.perf_counter() - start)
        for token in ids:
            t0 = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, mask)
            t1 = time.perf_counter()
            ok = matcher.consume_token(token)
            advances.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
            assert ok, matcher.get_error()
    return _summary(fills, advances, compiles, info_s)


def bench_xgrammar(tokenizer_json: Path, ids: list[int], repeats: int) -> dict:
    import transformers
    import xgrammar

    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    vocab_size = hf.backend_tokenizer.get_vocab_size()
    eos = hf.backend_tokenizer.token_to_id("<|endoftext|>")
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    info_s = time.perf_counter() - start
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    fills, advances, compiles = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
        )
        matcher = xgrammar.GrammarMatcher(compiled)
        compiles.append(time.perf_counter() - start)
        for token in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            t1 = time.perf_counter()
            ok = matcher.accept_token(token)
            advances.append(time.perf_counter() - t1)
            fills.append(t1 - t0)
            assert ok, token
    return _summary(fills, advances, compiles, info_s)


def _summary(fills: list[float], advances: list[float], compiles: list[float], info_s: float):
    def us(values, q):
        return round(statistics.quantiles(values, n=10)[q] * 1e6, 1) if q else None

    return {
        "fill_us_median": round(statistics.median(fills) * 1e6, 1),
        "fill_us_p90": us(fills, 8),
        "fill_us_mean": round(statistics.fmean(fills) * 1e6, 1),
        "advance_us_median": round(statistics.median(advances) * 1e6, 1),
        "compile_ms_median": round(statistics.median(compiles) * 1e3, 2),
        "tokenizer_info_ms": round(info_s * 1e3, 1),
    }


def bench_apply(tokenizer_json: Path, ids: list[int], repeats: int) -> list[dict]:
    """Microseconds to apply 32 rows of llguidance masks (those before the document's first 32
    tokens) to (32, V) logits: the C kernel and the torch path alternating, median of rounds."""
    import llguidance
    import llguidance.torch as llt

    from kernels.cpu import library
    from shared.sampling import token_mask

    tok = llguidance.LLTokenizer(tokenizer_json.read_text())
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    bitmask = llt.allocate_token_bitmask(32, tok.vocab_size)  # (32, W)
    for row, token in enumerate(ids[:32]):
        llt.fill_next_token_bitmask(matcher, bitmask, row)
        matcher.consume_token(token)
    masks = token_mask.TokenMasks(torch.arange(32), bitmask)
    paths = {"kernel": token_mask.apply_, "torch": token_mask._apply_torch_}
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(32, tok.vocab_size).to(dtype)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(max(repeats, 3) * 3):  # rounds: each path 50 calls, then the other
            for name, apply in paths.items():
                start = time.perf_counter()
                for _ in range(50):
                    apply(logits, masks)
                times[name].append((time.perf_counter() - start) / 50)
        us = {f"{name}_us": round(statistics.median(t) * 1e6, 1) for name, t in times.items()}
        tier = library.built_tier()
        lines.append({"apply": f"32 x {tok.vocab_size}", "dtype": str(dtype), **us,
                      "tier": tier.name if tier else None})  # fmt: skip
    return lines


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_grammar")
    parser.add_argument("--repeats", type=int, default=3, help="walks of the document each")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    env = env_report()
    print(json.dumps({"cpu": env["cpu"], "cores": env["cores"], "threads": args.threads}))
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {
            "bundled-8192": default_model_dir() / "tokenizer.json",
            "bpe-32000": tokenizer_32k(Path(tmp)),
        }
        for name, path in tokenizers.items():
            ids = Tokenizer.from_file(str(path)).encode(document(), add_special_tokens=False).ids
            for engine, bench in ENGINES.items():
                try:
                    result = bench(path, ids, args.repeats)
                except ImportError as e:
                    result = {"skipped": f"not importable ({e.name})"}
                facts = {"tokenizer": name, "tokens": len(ids), "engine": engine}
                print(json.dumps({**facts, **result}))
        for line in bench_apply(tokenizers["bpe-32000"], ids, args.repeats):  # its ids: the last
            print(json.dumps(line))


if __name__ == "__main__":
    main()
