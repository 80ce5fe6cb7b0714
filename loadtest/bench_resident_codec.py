"""What resident compressed weights cost per step (EngineConfig.resident_codec): decode step
time at batch 1 and 32 of the same random-weight ~150M bf16 Llama (bench_engine's dense model),
compressed with the codec, loaded as usual and with its layers' linears kept encoded and
decoded before each layer; paired rounds of the same run (A, B / B, A ...), a ratio being the
median of the per-round ratios with their range. Also the decode of a step's weights by itself
(every layer's, back to back) as GB/s of decoded weights, and the bytes the weights take either
way (encoded planes + the shared scratch + everything else). With --device cuda the ordinary
load decodes from CUDA graphs and the resident one eagerly, as the engine runs them (needs
cupy).

    python -m loadtest.bench_resident_codec [--device cuda] [--threads 2] [--rounds 3]
"""

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loadtest.decode_steps import median_step_s
from loadtest.random_model import llama_fields, save_random_llama
from shared.codec import compress_dir
from shared.cpu_report import report as env_report
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.huge_pages import restart_with_huge_pages
from shared.models.resident import ResidentLayer, weight_bytes

FIELDS = llama_fields(32000, 768, 2048, layers=16, heads=12, kv_heads=4)  # ~150M parameters
BATCHES = (1, 32)
SIDES = ("ordinary", "resident")  # EngineConfig.resident_codec False / True


def decode_step_s(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """The median time of a decode step of `batch` rows, after every prompt is computed."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 32000, (batch, prompt_len), generator=g).tolist()
    return median_step_s(engine, prompts, new_tokens)


def decode_alone_s(engine: LLMEngine) -> float:
    """One step's weight decode by itself: every layer's FixedDecode, back to back."""
    layers = [m for m in engine.model.modules() if isinstance(m, ResidentLayer)]
    start = time.perf_counter()
    for layer in layers:
        layer.weights()
    if engine.kv.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_rounds(engines: dict, rounds: int, prompt_len: int, new_tokens: int) -> list[dict]:
    """Per round: {(side, batch): step seconds, "decode": the decode alone}, the sides in
    turn, reversed every other round."""
    results = []
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        steps = {
            (side, batch): decode_step_s(engines[side], batch, prompt_len, new_tokens)
            for batch in BATCHES
            for side in order
        }
        results.append({**steps, "decode": decode_alone_s(engines["resident"])})
    return results


def print_report(results: list[dict], engines: dict, device: str, threads: int) -> None:
    """The step-time table, the decode's own time and rate, the weights' bytes."""
    facts = env_report()
    where = device if device != "cpu" else f"CPU: {facts['cpu']}, tier {facts['tier']}"
    print(
        f"{where}; linear {facts['linear_kernel']}; torch {torch.__version__}; {threads} "
        f"threads; {len(results)} paired rounds; ordinary: fused decoder "
        f"{'on' if engines['ordinary'].model.model.fused is not None else 'off'}, decode "
        f"graphs {'on' if engines['ordinary'].config.uses_graphs else 'off'}"
    )
    ordinary, resident = (weight_bytes(engines[s].model) for s in SIDES)
    raw_linears = ordinary.total - resident.other
    print("| batch | ordinary step | resident step | ratio (range) |")
    print("|------:|--------------:|--------------:|---------------|")
    for batch in BATCHES:
        steps = {s: [r[(s, batch)] for r in results] for s in SIDES}
        ratios = [b / a for a, b in zip(steps["ordinary"], steps["resident"])]
        a, b = (statistics.median(steps[s]) for s in SIDES)
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        print(f"| {batch:5} | {a * 1e3:10.1f} ms | {b * 1e3:10.1f} ms | {spread:13} |")
    decode = [r["decode"] for r in results]
    print(
        f"decode of every layer's weights by itself: {statistics.median(decode) * 1e3:.1f} ms "
        f"a step (range {min(decode) * 1e3:.1f}-{max(decode) * 1e3:.1f}), "
        f"{raw_linears / statistics.median(decode) / 1e9:.2f} GB/s of decoded weights"
    )
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    print(
        f"weights: ordinary {mb(ordinary.total)} (layer linears {mb(raw_linears)}, other "
        f"{mb(resident.other)}); resident {mb(resident.total)} = encoded {mb(resident.encoded)}"
        f" ({resident.encoded / raw_linears:.0%} of the linears) + scratch "
        f"{mb(resident.scratch)} + other {mb(resident.other)}: "
        f"{resident.total / ordinary.total:.0%} of the ordinary load"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=6, help="paired rounds (A, B / B, A ...)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=12, help="decode steps a measure times")
    args = ap.parse_args()
    if args.device.startswith("cuda") and importlib.util.find_spec("cupy") is None:
        sys.exit("--device cuda: the resident weights decode with cupy, which is not installed")
    restart_with_huge_pages()  # as the `tison` command does: weights on 2 MiB pages
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        plain, packed = Path(tmp) / "bf16", Path(tmp) / "compressed"
        save_random_llama(plain, FIELDS, torch.bfloat16)
        compress_dir(plain, packed)
        engines = {
            side: LLMEngine(
                EngineConfig(
                    model_dir=packed, dtype="bfloat16", device=args.device,
                    num_pages=512, enable_prefix_caching=False,
                    resident_codec=side == "resident",
                )
            )
            for side in SIDES
        }  # fmt: skip
        for engine in engines.values():
            decode_step_s(engine, 1, 8, 3)  # warm-up
        results = run_rounds(engines, args.rounds, args.prompt_len, args.new_tokens)
    print_report(results, engines, args.device, args.threads)


if __name__ == "__main__":
    main()
