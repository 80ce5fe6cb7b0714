"""What the scenario scripts share: running bench loads against a started server, saving the
results beside a Markdown table, and the small model they serve."""

import asyncio
import json
import shutil
import time
from pathlib import Path

import aiohttp

from loadtest.bench import BenchConfig, run_bench, run_sync, write_outputs
from loadtest.client import send
from loadtest.metrics import RequestResult, Slo
from loadtest.random_model import llama_fields, save_random_llama
from loadtest.report import BenchReport
from loadtest.runner import Load, run_load
from loadtest.target import Target
from loadtest.workloads import RequestSpec
from shared.default_model import default_model_dir
from shared.errors import ProcessStartError

# A small Llama-shaped model (~30M parameters) with the bundled model's 8k-token tokenizer.
SMALL_LLAMA = llama_fields(
    8192,
    512,
    1408,
    layers=8,
    heads=8,
    kv_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_small_llama(out: Path, seed: int = 0) -> Path:
    """Random-weight SMALL_LLAMA (bfloat16 safetensors) plus the bundled tokenizer in `out`."""
    import torch

    out = Path(out)
    if (out / "model.safetensors").is_file():
        return out
    save_random_llama(out, SMALL_LLAMA, torch.bfloat16, seed)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir() / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["model_max_length"] = SMALL_LLAMA["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return out


def wait_serving(target: Target, timeout_s: float = 120.0) -> None:
    """Send one small request until it succeeds: /health can answer before the scheduler has
    seen every worker's heartbeat, and the first requests warm the servers up."""
    spec = RequestSpec("warm up", max_tokens=4, prompt_len=2)

    async def attempt() -> RequestResult:
        async with aiohttp.ClientSession() as session:
            return await send(session, target, spec, 0.0)

    deadline = time.monotonic() + timeout_s
    while not (result := asyncio.run(attempt())).ok:
        if time.monotonic() > deadline:
            raise ProcessStartError(f"{target.url} does not serve: {result.detail}")
        time.sleep(0.5)


def warm_up(target: Target, specs: list[RequestSpec]) -> None:
    """Send `specs` two at a time and forget the results (first-use costs of big shapes)."""
    run_sync(run_load(target, specs, Load(concurrency=2), max_duration_s=600))


def bench(
    target: Target,
    specs: list[RequestSpec],
    loads: list[Load],
    label: str,
    workload: str,
    max_duration_s: float = 300.0,
    slo: Slo | None = None,
    command: str = "",
) -> BenchReport:
    """Run `specs` at each load against an already started server."""
    cfg = BenchConfig(
        target=target,
        loads=tuple(loads),
        workload=workload,
        max_duration_s=max_duration_s,
        slo=slo or Slo(),
        label=label,
        command=command,
    )
    return run_sync(run_bench(cfg, specs))


def save(report: BenchReport, out_dir: Path, name: str) -> None:
    """`<out_dir>/<name>.json`, `.md` and plots."""
    write_outputs(report, Path(out_dir) / name)


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
