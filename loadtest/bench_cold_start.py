"""Cold start: weight load time of a raw vs a compressed checkpoint, with a cold and a warm
page cache, and the time to first token of a fresh engine process, each in its own process.

    PYTHONPATH=. python -m loadtest.bench_cold_start [--models 150m,1g] [--rounds 3]
        [--read-limit MBPS] [--threads N] [--cache DIR] [--out FILE.json]

Models: the ~150M Llama of bench_engine.py and a ~1 GB one (8 layers of hidden 2048), bf16,
random weights drawn as transformers initializes them (normal, std 0.02): their exponents
spread like trained weights', so the codec stores them in about the same share (0.657 of the
raw bytes for both models; all-MiniLM-L6-v2's trained bf16 weights: 0.663, bench_codec; the
run prints the ratio it measured). Both are built once, with their
`tison compress` copies, under --cache.

Cold: every file of the folder is fsynced and dropped from the page cache
(posix_fadvise(POSIX_FADV_DONTNEED)) right before the process starts; the run checks with
mincore() that none of it stayed resident, and measures the storage's cold sequential read
GB/s on the raw file. On a VM the host may still cache the disk: the figure printed is what
the guest saw. Warm: the files were just read. Where the storage reads faster than the codec
decodes, compression cannot win on time; --read-limit caps every pipelined read of the loading
process (raw and compressed alike, shared/readahead.py's TISON_READ_LIMIT_MBPS) to stand in
for slower storage, and the table says so.

Rounds are paired and interleaved (raw, compressed; then compressed, raw; ...), so the
machine's drift falls on both; figures are medians with their range, ratios are the median of
the per-round ratios. "weights" is load_weights alone (read, decode, place); "load" adds
building the model and repacking its linears for the CPU kernels; "peak_rss_mb" is the loading
process's peak resident memory (torch, the model, what the load held at once); "TTFT" runs from the
process's start to the first token of a 1-token generation, and both sides must produce the
same token.

--peer adds TTFT sides whose weights come from a peer (what `--weights-from peer` gives a
worker): a WeightsServer (shared/peer) in this process over the raw and over the compressed
folder, on loopback, the child's model folder holding only the small files. The serving
folders stay warm (a running worker read them recently), so these sides compare with the
warm disk-raw side, the issue's "within 1.2x of a warm local load". Server and child share
this machine's cores: on two hosts the sending is the other host's work.
"""

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from loadtest.paired import round_order
from loadtest.random_model import llama_fields, save_random_llama
from loadtest.scenarios.output import emit

MODELS = {
    "150m": llama_fields(32000, 768, 2048, layers=16, heads=12, kv_heads=4),  # bench_engine's
    "1g": llama_fields(32000, 2048, 5632, layers=8, heads=16, kv_heads=8),  # ~0.98 GB in bf16
    "tiny": llama_fields(1024, 128, 256, layers=2, heads=4, kv_heads=2),  # to try the script
}
FORMATS = ("raw", "compressed")
PEER_SECRET = "bench-cold-start"  # the peer sides' TISON_KV_SECRET

# Runs in the child: load one folder in bf16; seconds since the parent started it.
_LOAD = """
import json, sys, time
spawned = float(sys.argv[3])
import torch
from shared.models import loader
from shared.models.config import ModelConfig
torch.set_num_threads(int(sys.argv[2]))
took = {}
def timed(*args, _load=loader.load_weights, **kwargs):
    start = time.perf_counter()
    _load(*args, **kwargs)
    took["weights_s"] = time.perf_counter() - start
loader.load_weights = timed
imported = time.time()
start = time.perf_counter()
loader.load_model(sys.argv[1], ModelConfig.from_dir(sys.argv[1]), torch.bfloat16)
took.update(load_s=time.perf_counter() - start, imports_s=imported - spawned)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec (the parent's peak)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
took["peak_rss_mb"] = int(status["VmHWM"].split()[0]) / 1024
print(json.dumps(took))
"""

# Runs in the child: a fresh engine, one greedy token; seconds since the parent started it.
_TTFT = """
import json, sys, time
spawned = float(sys.argv[3])
import torch
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling.params import SamplingParams
torch.set_num_threads(int(sys.argv[2]))
config = EngineConfig(model_dir=sys.argv[1], dtype="bfloat16", kv_cache_bytes=64 << 20,
                      enable_prefix_caching=False, **json.loads(sys.argv[4]))
engine = LLMEngine(config)
ready = time.time()
engine.add_request("r", list(range(1, 17)), SamplingParams(temperature=0, max_tokens=1,
                                                            ignore_eos=True))
tokens = []
while not tokens:
    tokens = [t for out in engine.step() for t in out.new_token_ids]
print(json.dumps(dict(ttft_s=time.time() - spawned, ready_s=ready - spawned, token=tokens[0])))
"""


def build(cache: Path, model: str) -> dict[str, Path]:
    """{"raw": folder, "compressed": folder} of the model, made once under `cache`."""
    from shared.codec import compress_dir

    folders = {"raw": cache / model / "raw", "compressed": cache / model / "compressed"}
    if not (folders["raw"] / "model.safetensors").is_file():
        import torch

        save_random_llama(folders["raw"], MODELS[model], torch.bfloat16)
    if not (folders["compressed"] / "tison-codec.json").is_file():
        compress_dir(folders["raw"], folders["compressed"])
    return folders


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def evict(folder: Path) -> None:
    """Drops every file of the folder from the page cache (written back first)."""
    for path in folder.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            read_gbps(path)


def resident_share(path: Path) -> float:
    """Share of the file's pages in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        return sum(v & 1 for v in vec) / pages
    finally:
        os.close(fd)


def read_gbps(path: Path) -> float:
    """GB/s of one sequential read of the file (8 MiB reads)."""
    buf = bytearray(8 << 20)
    start, total = time.perf_counter(), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            total += n
    return total / (time.perf_counter() - start) / 1e9


def storage(folder: Path) -> dict:
    """Cold and warm sequential read GB/s of the raw weights, after checking eviction."""
    path = folder / "model.safetensors"
    evict(folder)
    left = resident_share(path)
    cold = read_gbps(path)
    return dict(resident_after_evict=left, cold_read_gbps=cold, warm_read_gbps=read_gbps(path))


def decode_gbps(folder: Path, threads: int) -> tuple[float, float]:
    """(the codec's decode GB/s of output on `threads` threads, warm planes in memory; stored
    bytes / raw bytes of the tensors)."""
    import torch

    from shared.codec import CompressedCheckpoint
    from shared.codec.tensor import decode_tensors

    torch.set_num_threads(threads)
    checkpoint = CompressedCheckpoint(folder)
    encoded = [checkpoint.get_encoded(name) for name in checkpoint.names()]
    out_bytes = sum(e.num_elements * e.dtype.itemsize for e in encoded)
    stored = sum(sum(t.numel() * t.element_size() for t in e.planes.tensors().values())
                 if e.planes is not None else e.data.nbytes for e in encoded)  # fmt: skip
    start = time.perf_counter()
    for i in range(0, len(encoded), 16):  # batches, as the pipelined load decodes them
        decode_tensors(encoded[i : i + 16], num_threads=threads)
    return out_bytes / (time.perf_counter() - start) / 1e9, stored / out_bytes


def run_child(
    code: str, folder: Path, threads: int, env: dict, options: dict | None = None
) -> dict:
    """Runs `code` in a fresh process on `folder` (options: the TTFT child's EngineConfig
    fields beyond the defaults); the JSON line it prints."""
    args = [sys.executable, "-c", code, str(folder), str(threads), repr(time.time())]
    args.append(json.dumps(options or {}))
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{folder}: child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def ttft_sides(folders: dict[str, Path], peers: dict[str, str]) -> dict[str, tuple]:
    """Where a fresh engine gets its weights: side -> (its model folder, EngineConfig fields,
    the folder to drop from the page cache first or None to keep it warm). peers: format ->
    the endpoint of a WeightsServer over folders[format] (empty without --peer)."""
    sides = {
        "disk-raw": (folders["raw"], {}, folders["raw"]),
        "disk-compressed": (folders["compressed"], {}, folders["compressed"]),
        "disk-raw warm": (folders["raw"], {}, None),
    }
    for fmt, endpoint in peers.items():
        options = {"weights_peer": endpoint, "kv_secret": PEER_SECRET}
        sides[f"peer-{fmt}"] = (folders["small files"], options, None)
    return sides


def small_files_folder(folders: dict[str, Path]) -> Path:
    """A model folder without weights, as a worker taking them from a peer has."""
    from shared.peer.server import small_files

    out = folders["raw"].parent / "small-files"
    out.mkdir(exist_ok=True)
    for rel, path in small_files(folders["raw"]).items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out / rel)
    return out


def measure(
    folders: dict[str, Path], rounds: int, threads: int, env: dict, peers: dict[str, str]
) -> dict:
    """Paired rounds of load (cold, warm) and TTFT on each side."""
    loads = {(f, c): [] for f in FORMATS for c in ("cold", "warm")}
    sides = ttft_sides(folders, peers)
    ttft: dict[str, list] = {side: [] for side in sides}
    for r in range(rounds):
        for cache in ("cold", "warm"):
            for fmt in round_order(list(FORMATS), r):
                (evict if cache == "cold" else warm)(folders[fmt])
                loads[(fmt, cache)].append(run_child(_LOAD, folders[fmt], threads, env))
        for side in round_order(list(ttft), r):
            folder, options, cold = sides[side]
            if cold is not None:
                evict(cold)
            ttft[side].append(run_child(_TTFT, folder, threads, env, options))
        print(f"round {r + 1} of {rounds} done", file=sys.stderr)
    tokens = {run["token"] for runs in ttft.values() for run in runs}
    if len(tokens) != 1:
        raise RuntimeError(f"the sides' first tokens differ: {sorted(tokens)}")
    result = {}
    for cache in ("cold", "warm"):
        raw, packed = loads[("raw", cache)], loads[("compressed", cache)]
        for key in ("weights_s", "load_s", "peak_rss_mb"):
            result[f"{cache} {key}"] = {
                "raw": spread([x[key] for x in raw]),
                "compressed": spread([x[key] for x in packed]),
                "ratio": spread([p[key] / q[key] for p, q in zip(packed, raw)]),
            }
    warm_raw = ttft["disk-raw warm"]
    for side, runs in ttft.items():
        result[f"ttft_s {side}"] = spread([x["ttft_s"] for x in runs])
        result[f"ready_s {side}"] = spread([x["ready_s"] for x in runs])
        ratios = [x["ttft_s"] / w["ttft_s"] for x, w in zip(runs, warm_raw)]
        result[f"ttft_vs_warm {side}"] = spread(ratios)
    return result


def table(name: str, info: dict, m: dict) -> str:
    def f(s: dict) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    rows = [
        f"\n{name}: raw {info['raw_bytes'] / 1e9:.2f} GB, compressed {info['ratio']:.3f} of it; "
        f"storage {info['cold_read_gbps']:.2f} GB/s cold ({info['resident_after_evict']:.0%} "
        f"resident after evicting), {info['warm_read_gbps']:.2f} GB/s warm; decode "
        f"{info['decode_gbps']:.2f} GB/s; read limit {info['read_limit']}",
        "| measure | raw | compressed | compressed / raw |",
        "|---|---|---|---|",
    ]
    for key, v in m.items():
        if isinstance(v, dict) and "ratio" in v:
            rows.append(f"| {key} | {f(v['raw'])} | {f(v['compressed'])} | {f(v['ratio'])} |")
    rows += [
        "",
        "| TTFT of a fresh engine, from | s (ready s) | / disk-raw warm |",
        "|---|---|---|",
    ]
    for key in m:
        if key.startswith("ttft_s "):
            side = key.removeprefix("ttft_s ")
            rows.append(f"| {side} | {f(m[key])} ({f(m[f'ready_s {side}'])}) "
                        f"| {f(m[f'ttft_vs_warm {side}'])} |")  # fmt: skip
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="150m,1g", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--read-limit", type=float, default=None, help="MB/s cap on the reads")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/tison-bench-cold-start"))
    ap.add_argument("--peer", action="store_true", help="also weights from a peer (TTFT)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    limit = "none (the storage as it is)"
    if args.read_limit:
        env["TISON_READ_LIMIT_MBPS"] = str(args.read_limit)  # shared/readahead.py
        limit = f"{args.read_limit:.0f} MB/s (TISON_READ_LIMIT_MBPS, raw and compressed alike)"
    result = dict(threads=args.threads, rounds=args.rounds, cpus=os.cpu_count(), models={})
    tables = []
    for name in args.models.split(","):
        folders = build(args.cache, name)
        gbps, ratio = decode_gbps(folders["compressed"], args.threads)
        info = dict(storage(folders["raw"]), decode_gbps=gbps, ratio=ratio, read_limit=limit,
                    raw_bytes=folder_bytes(folders["raw"]))  # fmt: skip
        servers = {}
        if args.peer:
            from shared.peer.server import WeightsServer

            folders["small files"] = small_files_folder(folders)
            servers = {f: WeightsServer(folders[f], PEER_SECRET.encode()) for f in FORMATS}
        try:
            peers = {fmt: server.start() for fmt, server in servers.items()}
            m = measure(folders, args.rounds, args.threads, env, peers)
        finally:
            for server in servers.values():
                server.close()
        result["models"][name] = dict(info, **m)
        tables.append(table(name, info, m))
    print("\n".join(tables), file=sys.stderr)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
