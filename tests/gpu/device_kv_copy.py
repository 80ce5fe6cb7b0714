"""GPU-only check `kv_copy`: KV pages written over CUDA IPC (shared/transfer/cuda_ipc.py)
between two processes on one GPU, as a prefill worker writes into a decode worker's pool.

A decode-side process allocates a pool of Llama-3.1-8B's KV layout (32 layers, 8 KV heads of
128, bf16) and exports its handle; this process opens it and writes an 8k-token prompt's KV
into scattered pages, every layer, through the transport's sender (CudaIpcSender) where the
KVRankPool carries handles, else through the same write (pools.write_layer on a stream of its
own) on the opened pool. Rate: payload bytes / time (CUDA events), target >= 100 GB/s. Then
the decode side reads the pages back and both sides' checksums must agree (byte-exact)."""

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from device_common import GPU_TESTS, Context, Skip, child_env

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
PROMPT_TOKENS = 8192
NUM_PAGES = 2 * PROMPT_TOKENS // PAGE  # twice what the prompt takes: its pages are scattered
TARGET_GB_S = 100.0
REPEATS = 5


def spec():
    import torch

    from shared.kv.spec import MHAKVSpec

    return MHAKVSpec(LAYERS, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16)


def slots():
    """The prompt's destination slots: its pages scattered over the pool (same on both sides)."""
    import torch

    pages = torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(0))
    return spec().slots(pages[: PROMPT_TOKENS // PAGE].tolist(), 0, PROMPT_TOKENS)


def checksum(payloads) -> int:
    """Position-weighted sum of the payloads' bits: a byte out of place changes it."""
    import torch

    total = 0
    for p in payloads:
        bits = p.contiguous().view(torch.int16).flatten().to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
        total += int((bits * weights).sum())
    return total


def decode_side(blob_path: Path) -> None:
    """The decode worker's part: a zeroed pool, its handle in blob_path; on a line from stdin,
    prints the checksum of the prompt's slots, layer by layer, and exits."""
    import torch

    from shared.transfer.ipc_handles import export_pool

    kv = spec()
    data = torch.zeros(kv.pool_shape(NUM_PAGES), dtype=kv.dtype, device="cuda")
    blob_path.with_suffix(".tmp").write_bytes(export_pool(data))
    blob_path.with_suffix(".tmp").rename(blob_path)
    sys.stdin.readline()
    dst = slots().cuda()
    print(checksum(kv.read(data, layer, dst, (0, KV_HEADS)) for layer in range(LAYERS)), flush=True)


def kv_copy(ctx: Context) -> Iterator[dict]:
    try:
        from shared.transfer import cuda_ipc  # noqa: F401
    except ImportError as e:
        raise Skip(f"no cuda_ipc KV transport yet ({e})") from None
    blob_path = ctx.workdir / "pool.handle"
    code = "import pathlib, sys, device_kv_copy as m; m.decode_side(pathlib.Path(sys.argv[1]))"
    log = ctx.workdir / "decode_side.log"
    with open(log, "w") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(blob_path)], cwd=GPU_TESTS, env=child_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
        )  # fmt: skip
    try:
        while not blob_path.exists():
            if proc.poll() is not None or ctx.left() < 10:
                tail = log.read_text()[-1500:]
                raise AssertionError(f"the decode side exited or hung (rc {proc.poll()}):\n{tail}")
            time.sleep(0.1)
        record = write_prompt(blob_path.read_bytes())
        proc.stdin.write("check\n")
        proc.stdin.flush()
        theirs = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    exact = theirs == record.pop("checksum")
    rate = record["gb_per_s"]
    mark = "" if rate >= TARGET_GB_S else " BELOW the 100 GB/s target"
    yield {
        **record, "byte_exact": exact, "ok": exact, "target_gb_per_s": TARGET_GB_S,
        "meets_target": rate >= TARGET_GB_S,
        "summary": f"{rate:.0f} GB/s{mark}, {'byte-exact' if exact else 'BYTES DIFFER'}",
    }  # fmt: skip


def write_prompt(blob: bytes) -> dict:
    """Writes the prompt's KV into the exported pool REPEATS times; the rate and checksum."""
    import torch

    from shared.transfer.base import LayerKV

    kv, dst = spec(), slots().cuda()
    gen = torch.Generator(device="cuda").manual_seed(1)
    payloads = [
        torch.randn(2, PROMPT_TOKENS, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").to(kv.dtype)
        for _ in range(LAYERS)
    ]  # (2, n, heads, head_dim) a layer, as spec.read gives
    layers = [LayerKV(i, (0, KV_HEADS), dst, p) for i, p in enumerate(payloads)]
    send, finish, path = sender(kv, blob, use_sender=True)
    try:
        for layer in layers:  # warm-up: opens the pool, first launches
            send(layer)
        finish()
    except Exception as e:  # the sender's wiring not there yet: the write it does
        if path != "sender":
            raise
        send, finish, path = sender(kv, blob, use_sender=False)
        path += f" (the sender raised {e!r})"
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    begin.record()
    for _ in range(REPEATS):
        for layer in layers:
            send(layer)
    finish()
    end.record()
    torch.cuda.synchronize()
    wall_s = (time.perf_counter() - started) / REPEATS
    gpu_s = begin.elapsed_time(end) / 1e3 / REPEATS
    nbytes = sum(p.numel() * p.element_size() for p in payloads)
    seconds = max(wall_s, gpu_s)  # the copies run on the sender's stream, not the timed one
    return {
        "measure": "kv_copy", "path": path, "bytes": nbytes, "ms": round(seconds * 1e3, 3),
        "gb_per_s": round(nbytes / seconds / 1e9, 1), "checksum": checksum(payloads),
    }  # fmt: skip


def sender(kv, blob: bytes, use_sender: bool):
    """(send(LayerKV), finish(), which path): the transport's sender where KVRankPool carries
    a CUDA IPC handle, else its write on the opened pool, on a stream of its own."""
    import torch

    from shared.protocol import KVPool, KVRankPool
    from shared.transfer import cuda_ipc, ipc_handles
    from shared.transfer.base import KVTarget, host_id
    from shared.transfer.pools import MappedPool, write_layer

    units = (0, KV_HEADS)
    if use_sender and "cuda_ipc" in {f.name for f in dataclasses.fields(KVRankPool)}:
        desc = KVRankPool((0, LAYERS), units, "", cuda_ipc=blob)
        pool = KVPool(kv.layout, host_id(), (desc,))
        target = KVTarget("r", tuple(range(NUM_PAGES)), pool, cuda_ipc.NAME)
        s = cuda_ipc.CudaIpcSender(kv)
        return (lambda layer: s.send_layer(target, layer)), (lambda: s.finish(target)), "sender"
    pools = [MappedPool(KVRankPool((0, LAYERS), units, ""), kv, ipc_handles.open_pool(blob))]
    stream = torch.cuda.Stream()

    def send(layer) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            write_layer(kv, pools, layer)

    return send, stream.synchronize, "open_pool + write_layer (KVRankPool has no handle yet)"
