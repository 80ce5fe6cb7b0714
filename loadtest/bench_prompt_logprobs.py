"""What prompt logprobs cost a prefill: the seconds to compute one prompt and sample its first
token, with and without `prompt_logprobs` (top 5, 20), on the same random-weight Llama-shaped
model (32k vocabulary: every prompt position then runs the LM head and a log_softmax over
32k, in bounded slices), in paired rounds of one run (this shared machine's speed drifts).

    python -m loadtest.bench_prompt_logprobs [--prompt 1024] [--rounds 5] [--threads 2]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from loadtest.random_model import llama_fields, save_random_llama
from shared.cpu_report import report as env_report
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams

MODEL = llama_fields(32000, 512, 1408, layers=8, heads=8, kv_heads=4)  # ~60M parameters
CASES = {"off": None, "top 5": 5, "top 20": 20}


def prefill_s(engine: LLMEngine, prompt: list[int], top: int | None, name: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top)
    start = time.perf_counter()
    req = engine.add_request(name, prompt, params)
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    assert len(req.prompt_logprobs) == (0 if top is None else len(prompt) - 1)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_prompt_logprobs")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        save_random_llama(Path(tmp), MODEL, torch.float32)
        config = EngineConfig(
            model_dir=Path(tmp),
            dtype="float32",
            num_pages=4 * -(-args.prompt // 16),
            max_num_batched_tokens=max(args.prompt, 2048),
            enable_prefix_caching=False,
        )
        engine = LLMEngine(config)
        prompt = torch.randint(3, 32000, (args.prompt,), generator=torch.Generator().manual_seed(0))
        prompt = prompt.tolist()
        prefill_s(engine, prompt, 5, "warm")
        times: dict[str, list[float]] = {case: [] for case in CASES}
        for r in range(args.rounds):
            for case, top in CASES.items():
                times[case].append(prefill_s(engine, prompt, top, f"{case}-{r}"))
        engine.close()
    medians = {case: statistics.median(t) for case, t in times.items()}
    print(json.dumps({"cpu": env_report(), "prompt_tokens": args.prompt}, default=str))
    for case, median in medians.items():
        extra = median / medians["off"] - 1
        print(f"{case:>7}: median {median * 1e3:8.1f} ms  (+{extra:6.1%} over off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
