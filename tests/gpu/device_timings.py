"""GPU-only checks, the timings: HBM bandwidth, a Llama-3.1-8B-shaped decode step against its
roofline, the codec's decode rate and the paged attention kernel's. Targets are recorded
(`meets_target`), not failed: a slow run is a finding, a wrong one a failure.

decode: a folder of the real 8B config (tests/gpu/llama-3.1-8b.json) with random bf16 weights
(--decode-layers of them; the roofline counts what that folder holds), decoded at batch
1/32/128 with CUDA graphs and eagerly. Roofline of a step: (weight bytes + KV bytes read) / the
HBM bandwidth measured here; the target is >= 70% at batch 1 with graphs."""

import importlib
import importlib.util
import shutil
import time
from collections.abc import Iterator

from device_common import GPU_TESTS, Context, Skip, need_modules
from device_model import build_llama_folder, weight_bytes_read

BATCHES = (1, 32, 128)
PROMPT_TOKENS = 512  # per request: the KV each decode row reads
WARMUP_STEPS, TIMED_STEPS = 3, 20
ROOFLINE_TARGET = 0.70  # batch 1, graphs
CODEC_TARGET_TB_S = 1.0


def copy_bandwidth(device: str, nbytes: int = 4 << 30, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy, bytes read and written both counted."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    seconds = timed(device, lambda: dst.copy_(src), repeats)
    return 2 * nbytes / seconds


def timed(device: str, fn, repeats: int) -> float:
    """Mean seconds of fn() (CUDA events on a GPU)."""
    import torch

    if device == "cpu":
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / repeats


def hbm(ctx: Context) -> Iterator[dict]:
    rate = copy_bandwidth("cuda")
    yield {
        "measure": "hbm_copy",
        "gb_per_s": round(rate / 1e9, 1),
        "summary": f"{rate / 1e12:.2f} TB/s copy",
    }


def decode(ctx: Context) -> Iterator[dict]:
    import torch

    layers = ctx.options.get("decode_layers", 32)
    bandwidth = copy_bandwidth("cuda", 2 << 30, 10)
    torch.cuda.empty_cache()
    started = time.monotonic()
    folder, tensors = build_llama_folder(ctx.workdir, layers, "cuda")
    try:
        yield {
            "measure": "build",
            "layers": layers,
            "seconds": round(time.monotonic() - started, 1),
        }
        yield from decode_roofline(folder, tensors, "cuda", bandwidth, BATCHES)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def decode_roofline(
    folder, tensors: dict, device: str, bandwidth: float, batches
) -> Iterator[dict]:
    """One record per (batch, graphs or eager): step time against the roofline."""
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine

    most = max(batches)
    steps = 2 * (WARMUP_STEPS + TIMED_STEPS) + 2
    pages = most * -(-(PROMPT_TOKENS + steps) // 16) + 16
    started = time.monotonic()
    engine = LLMEngine(
        EngineConfig(
            folder,
            dtype="bfloat16",
            device=device,
            num_pages=pages,
            max_num_seqs=most,
            max_model_len=2048,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            decode_graphs="auto" if device != "cpu" else "on",
        )  # fmt: skip
    )
    try:
        graphs = engine.runner.graphs
        yield {
            "measure": "load",
            "seconds": round(time.monotonic() - started, 1),
            "graph_sizes": list(getattr(graphs, "sizes", ())),
            "captured": sorted(getattr(graphs, "_graphs", {})),
        }
        kv_token_bytes = engine.kv_spec.page_size_bytes // engine.kv_spec.page_size
        weights = weight_bytes_read(tensors)
        for batch in batches:
            yield from decode_batch(engine, batch, steps, weights, kv_token_bytes, bandwidth)
    finally:
        engine.close()


def decode_batch(engine, batch: int, steps: int, weights: int, kv_token_bytes: int, bandwidth):
    from shared.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    prompts = [
        [(7919 * i + 31 * j) % (vocab - 3) + 3 for j in range(PROMPT_TOKENS)] for i in range(batch)
    ]
    reqs = [engine.add_request(f"b{batch}-{i}", p, params) for i, p in enumerate(prompts)]
    while not all(r.output_token_ids for r in reqs):  # prefill
        engine.step()
    graphs = engine.runner.graphs
    for mode in ("graphs", "eager"):
        if mode == "graphs" and graphs is None:
            continue
        engine.runner.graphs = graphs if mode == "graphs" else None
        for _ in range(WARMUP_STEPS):
            engine.step()
        contexts, seconds = [], []
        for _ in range(TIMED_STEPS):
            contexts.append(sum(r.num_tokens for r in reqs))
            started = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - started)
        step_s = sorted(seconds)[len(seconds) // 2]
        kv = kv_token_bytes * sum(contexts) / len(contexts)
        roofline_s = (weights + kv) / bandwidth
        record = {
            "measure": "decode_step",
            "batch": batch,
            "mode": mode,
            "step_ms": round(step_s * 1e3, 3),
            "roofline_ms": round(roofline_s * 1e3, 3),
            "pct_of_roofline": round(100 * roofline_s / step_s, 1),
            "weight_bytes": weights,
            "kv_bytes": int(kv),
            "tokens_per_s": round(batch / step_s),
        }
        if batch == 1 and mode == "graphs":
            record["meets_target"] = roofline_s / step_s >= ROOFLINE_TARGET
            mark = "" if record["meets_target"] else " BELOW the 70% target"
            record["summary"] = f"b1 graphs {record['pct_of_roofline']}% of roofline{mark}"
        yield record
    engine.runner.graphs = graphs
    for r in reqs:
        engine.abort(r.request_id)


def codec(ctx: Context) -> Iterator[dict]:
    need_modules("cupy")
    spec = importlib.util.spec_from_file_location(
        "check_codec_gpu", GPU_TESTS / "check_codec_gpu.py"
    )
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    result = check.measure_throughput("cuda", 1 << 28, repeats=10)
    rate = result["decode_tb_per_s"]
    mark = "" if rate >= CODEC_TARGET_TB_S else " BELOW the 1 TB/s target"
    yield {**result, "ok": result["exact"], "meets_target": rate >= CODEC_TARGET_TB_S,
           "summary": f"decode {rate:.2f} TB/s{mark}"}  # fmt: skip


def codec_load(ctx: Context) -> Iterator[dict]:
    """A compressed folder loaded onto the device (on a GPU its planes decoded there by the
    codec's kernel, checkpoint.py's decode_on_gpu) against the raw folder: every parameter the
    same bits, and the two load times (page cache warm: the folders sit in /dev/shm)."""
    import torch

    from shared.codec.folder import compress_dir
    from shared.models.config import ModelConfig
    from shared.models.loader import load_model

    folder, _ = build_llama_folder(ctx.workdir, 2, ctx.device, vocab_size=32000)
    packed = folder.with_name(folder.name + "-compressed")
    shutil.rmtree(packed, ignore_errors=True)
    try:
        compress_dir(folder, packed)
        cfg = ModelConfig.from_dir(folder)
        params, seconds = {}, {}
        for name, source in (("raw", folder), ("compressed", packed)):
            started = time.monotonic()
            model = load_model(source, cfg, torch.bfloat16, device=ctx.device)
            if ctx.gpu:
                torch.cuda.synchronize()
            seconds[name] = time.monotonic() - started
            params[name] = dict(model.named_parameters())
        same = all(torch.equal(p, params["compressed"][n]) for n, p in params["raw"].items())
        yield {
            "measure": "codec_load",
            "ok": same,
            "raw_s": round(seconds["raw"], 3),
            "compressed_s": round(seconds["compressed"], 3),
            "summary": f"compressed {seconds['compressed']:.2f} s, raw {seconds['raw']:.2f} s, "
            f"parameters {'equal' if same else 'DIFFERENT'}",
        }
    finally:
        shutil.rmtree(packed, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def attention(ctx: Context) -> Iterator[dict]:
    yield from _kernel_rates("attention", "test_cuda_attention")


def fp8_linear(ctx: Context) -> Iterator[dict]:
    yield from _kernel_rates("fp8_linear", "test_cuda_fp8")


def _kernel_rates(what: str, test_module: str) -> Iterator[dict]:
    """The records of tests/gpu/<test_module>.py's measure(): one a case, then a summary."""
    if not (GPU_TESTS / f"{test_module}.py").exists():
        raise Skip(f"tests/gpu/{test_module}.py is not there yet")
    try:  # imported as its docstring says: tests/ on the path, `gpu` a namespace package
        module = importlib.import_module(f"gpu.{test_module}")
    except BaseException as e:  # its module-level pytest.skip (no cupy, no GPU)
        if type(e).__name__ == "Skipped":
            raise Skip(f"{test_module} skipped itself: {e}") from None
        raise
    measure = getattr(module, "measure", None)
    if measure is None:
        raise Skip(f"tests/gpu/{test_module}.py has no measure() yet")
    result = measure()  # {"gqa/b1": {"gb_per_s": ..., "eager_gb_per_s": ...}, ...}
    if not isinstance(result, dict) or not all(isinstance(v, dict) for v in result.values()):
        result = {"all": result if isinstance(result, dict) else {"gb_per_s": result}}
    rates = []
    for case, values in result.items():
        rate = values.get("gb_per_s")
        if isinstance(rate, (int, float)):
            rates.append(f"{case} {rate:.0f}")
        yield {"measure": what, "case": case, **values}
    yield {"measure": what, "summary": "GB/s: " + ", ".join(rates)}
