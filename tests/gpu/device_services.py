"""Checks `serve` and `handoff`: the services on the device.

serve: `tison up --device cuda` (dry run: cpu) on a tiny model; the official `openai` client
(plain HTTP where the package is missing) streams a chat completion and makes a completion.
handoff: a prefill and a decode worker (two processes, one GPU) whose KV moves over cuda_ipc
(dry run: shm); greedy completions through the gateway equal the offline engine's, the
transport's byte-exact test runs (tests/test_kv_handoff.py -k <transport>), and a long prompt's
KV rate is read from the prefill worker's own count (/metrics); then the same greedy check on
a tiny Llama 4, whose decode worker caps its chunked layers."""

import signal
import subprocess
import time
from collections.abc import Iterator

from device_cluster import Cluster, Lines, complete, free_port, metric, need_services, tison
from device_common import Context, Skip, need_modules, run_pytest

MAX_TOKENS = 16
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nfor i in range(10):"]
# handoff on a GPU: the attention shape of Llama-3.1-8B (8 KV heads of 128) in a small model,
# so a long prompt moves as many KV bytes a token and layer as the real one (float32: 8 KiB)
WIDE = dict(
    hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
)  # fmt: skip


def serve(ctx: Context) -> Iterator[dict]:
    need_services()
    need_modules("transformers")  # builds the tiny model
    from tiny_models import build_model

    model_dir = build_model(ctx.workdir / "tiny-serve", "llama")
    port = free_port()
    args = ["up", "--model", str(model_dir), "--dtype", "float32", "--device", ctx.device]
    args += ["--port", str(port)]
    mode = "auto"
    if ctx.gpu:  # 7 GB of the GPU for both workers: a tiny model needs no more pages
        args += ["--gpu-memory-utilization", "0.05"]
        if "cuda_ipc" not in transports():  # GPU workers reach each other over it alone
            mode = "colocated (no cuda_ipc KV transport yet)"
            args.append("--colocated")
    started = time.monotonic()
    proc = tison(*args)
    lines = Lines(proc)
    try:
        lines.wait_for("Tison is serving", ctx.deadline - 20)
        ready_s = time.monotonic() - started
        base_url = f"http://127.0.0.1:{port}/v1"
        yield {
            "measure": "ready",
            "mode": mode,
            "ready_s": round(ready_s, 1),
            "summary": f"ready {ready_s:.1f} s" + ("" if mode == "auto" else f", {mode}"),
        }
        yield openai_requests(base_url, model_dir.name)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    yield {
        "measure": "stop",
        "rc": code,
        "ok": code == 0,
        **({"output_tail": lines.tail()} if code else {}),
    }


def openai_requests(base_url: str, model: str) -> dict:
    """A streamed chat completion and a completion, MAX_TOKENS each (EOS ignored)."""
    try:
        import openai
    except ImportError:  # the device machine may lack it: the same requests over plain HTTP
        done = complete(base_url.removesuffix("/v1"), model, PROMPTS[0], MAX_TOKENS)
        return {
            "client": "http (openai not installed)",
            "completion_tokens": done["tokens"],
            "completion_s": round(done["seconds"], 2),
            "ok": done["tokens"] == MAX_TOKENS,
            "summary": f"completion {done['tokens']} tokens (no openai: chat not streamed)",
        }
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    extra = {"ignore_eos": True}
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a function that reverses a list."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks, first_s, usage = 0, None, None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            first_s = first_s or time.monotonic() - started
        usage = chunk.usage or usage
    chat_tokens = usage.completion_tokens if usage else 0
    started = time.monotonic()
    out = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )
    done_s = time.monotonic() - started
    return {
        "client": f"openai {openai.__version__}",
        "chat_chunks": chunks,
        "chat_tokens": chat_tokens,
        "chat_first_token_s": round(first_s or 0.0, 3),
        "completion_tokens": out.usage.completion_tokens,
        "completion_s": round(done_s, 2),
        "ok": chat_tokens == MAX_TOKENS and out.usage.completion_tokens == MAX_TOKENS,
        "summary": f"chat {chat_tokens} tokens streamed, completion {out.usage.completion_tokens}",
    }


def transports() -> tuple[str, ...]:
    from shared.transfer.handoff import TRANSPORTS

    return TRANSPORTS


def handoff(ctx: Context) -> Iterator[dict]:
    transport = "cuda_ipc" if ctx.gpu else "shm"
    if transport not in transports():
        raise Skip(f"no {transport} KV transport yet (shared/transfer/cuda_ipc.py)")
    need_services()
    need_modules("transformers")
    yield byte_exact(ctx, transport)
    from tiny_models import build_model

    model_dir = build_model(ctx.workdir / "tiny-handoff", "llama", **(WIDE if ctx.gpu else {}))
    with Cluster(ctx.workdir / "llama") as cluster:
        yield greedy(ctx, cluster, model_dir, transport, "greedy")
        yield kv_rate(ctx, cluster, model_dir, transport)
    # Llama 4: the decode worker caps its chunked layers (page groups of one pool, exported
    # whole); the prefill worker writes each chunked layer's last chunk into its group's pages
    model_dir = build_model(ctx.workdir / "tiny-llama4", "llama4_moe")
    with Cluster(ctx.workdir / "llama4") as cluster:
        record = greedy(ctx, cluster, model_dir, transport, "greedy_llama4_capped")
        capped = "chunked layers capped" in (cluster.workdir / "decode.log").read_text()
        yield {**record, "capped": capped, "ok": record["ok"] and capped}


def greedy(ctx: Context, cluster: Cluster, model_dir, transport: str, measure: str) -> dict:
    """The workers' greedy completions through the gateway against the offline engine's."""
    expected = offline(ctx, model_dir)
    start_workers(ctx, cluster, model_dir, transport)
    ready_s = cluster.wait_serving(model_dir.name, ctx.deadline - 30)
    got = [complete(cluster.base_url, model_dir.name, p, MAX_TOKENS) for p in PROMPTS]
    equal = sum(
        g["text"] == e["text"] and g["tokens"] == e["tokens"] for g, e in zip(got, expected)
    )
    return {
        "measure": measure,
        "transport": transport,
        "ready_s": round(ready_s, 1),
        "equal": equal,
        "requests": len(PROMPTS),
        "ok": equal == len(PROMPTS),
        "summary": f"{measure}: {transport} {equal}/{len(PROMPTS)} = offline",
        **({} if equal == len(PROMPTS) else {"got": got, "expected": expected}),
    }


def byte_exact(ctx: Context, transport: str) -> dict:
    """The transport's byte-exact test: tests/test_kv_handoff.py's cases of that transport."""
    record = run_pytest(["tests/test_kv_handoff.py", "-k", transport], ctx, "kv_handoff")
    if record["rc"] == 5:  # no case of that transport there yet
        return {**record, "summary": f"no byte-exact test of {transport} yet"}
    ran = sum(record.get(k, 0) for k in ("passed", "failed", "errors"))
    summary = f"byte-exact {record.get('passed', 0)}/{ran}"
    return {**record, "ok": record["rc"] == 0, "summary": summary}


def offline(ctx: Context, model_dir) -> list[dict]:
    """The offline engine's greedy outputs on the device: what the workers must give."""
    from shared.engine.llm import LLM
    from shared.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device=ctx.device, num_pages=256, max_num_seqs=16) as llm:
        outs = llm.generate(PROMPTS, params)
    if ctx.gpu:
        import torch

        torch.cuda.empty_cache()  # the workers share this GPU
    return [{"text": o.text, "tokens": len(o.token_ids)} for o in outs]


def start_workers(ctx: Context, cluster: Cluster, model_dir, transport: str) -> None:
    common = ["--model", str(model_dir), "--dtype", "float32", "--device", ctx.device]
    common += ["--heartbeat", "0.2", "--max-num-seqs", "16", "--num-pages", "1024"]
    common += ["--gpu-memory-utilization", "0.2"] if ctx.gpu else ["--threads", "1"]
    cluster.start("scheduler", "scheduler")
    cluster.start("prefill", "prefill", *common, "--kv-transport", transport)
    cluster.start("decode", "decode", *common)
    cluster.gateway(model_dir)


def kv_rate(ctx: Context, cluster: Cluster, model_dir, transport: str) -> dict:
    """GB/s of one long prompt's KV from the prefill worker's own count (its heartbeats)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    length = 4000 if ctx.gpu else 200
    prompt = [3 + (i * 7919) % (cfg["vocab_size"] - 3) for i in range(length)]
    names = ("tison_kv_transfer_bytes", "tison_kv_transfer_seconds")
    time.sleep(0.5)  # the earlier requests' counts come with the next heartbeats (0.2 s)
    before = [metric(cluster.base_url, n, "prefill") for n in names]
    complete(cluster.base_url, model_dir.name, prompt, max_tokens=1)
    deadline = time.monotonic() + 5  # the count comes with the next heartbeat
    while True:
        after = [metric(cluster.base_url, n, "prefill") for n in names]
        if after[0] - before[0] >= length * per_token or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    moved, seconds = after[0] - before[0], after[1] - before[1]
    rate = moved / seconds / 1e9 if seconds > 0 else 0.0
    return {
        "measure": "kv_rate",
        "transport": transport,
        "prompt_tokens": length,
        "bytes": int(moved),
        "expected_bytes": length * per_token,
        "seconds": round(seconds, 5),
        "gb_per_s": round(rate, 2),
        "summary": f"KV {rate:.1f} GB/s (worker count)",
    }
