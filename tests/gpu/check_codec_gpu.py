"""GPU check of the weight codec, for a machine with a CUDA GPU and cupy:

    python tests/gpu/check_codec_gpu.py [--elements 268435456] [--repeats 20]

1. Bit-exactness: shared/codec/gpu.decode_on_device against the CPU decoder
   (shared.codec.decode_tensor) for every coded dtype and split point, on ragged shapes
   with NaN, inf and subnormals mixed in.
2. Throughput: decoding a large BF16 weight tensor already resident on the GPU, in output
   bytes per second, host-side index check included (target: at least 1 TB/s on an
   H100/H200).

Prints one JSON line per measurement; exits 1 if any decode differs from the CPU's.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from shared.codec import decode_tensor, encode_tensor  # noqa: E402
from shared.codec.format import LAYOUTS  # noqa: E402
from shared.codec.gpu import decode_on_device  # noqa: E402

SHAPES = [(513, 301), (64, 33), (1024, 777)]
TARGET_BYTES_PER_S = 1e12


def weights(shape, dtype, seed: int) -> torch.Tensor:
    """Trained-like weights with NaN, +-inf, -0 and subnormals mixed in."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    flat = w.view(-1)
    tiny = torch.finfo(dtype).tiny
    for i, value in enumerate([float("nan"), float("inf"), -float("inf"), -0.0, tiny / 4]):
        flat[(i * 7919) % flat.numel()] = value
    return w.to(dtype)


def check_exact(device: str) -> list[dict]:
    """One record per (dtype, shape, k): whether the GPU decode equals the CPU decode."""
    records = []
    for dtype, layout in LAYOUTS.items():
        for shape in SHAPES:
            tensor = weights(shape, dtype, seed=len(records))
            for k in layout.candidate_ks():
                encoded = encode_tensor(tensor, "w", k=k)
                expected = decode_tensor(encoded).view(layout.int_dtype)
                got = decode_on_device(encoded.to(device)).cpu().view(layout.int_dtype)
                same = torch.equal(got, expected) and torch.equal(
                    expected, tensor.view(layout.int_dtype)
                )
                records.append({"dtype": str(dtype), "shape": list(shape), "k": k, "exact": same})
    return records


def measure_throughput(device: str, num_elements: int, repeats: int) -> dict:
    """Output bytes per second of decode_on_device on one large BF16 tensor."""
    cols = 8192
    tensor = weights((num_elements // cols, cols), torch.bfloat16, seed=1)
    started = time.perf_counter()
    encoded = encode_tensor(tensor, "w")
    encode_s = time.perf_counter() - started
    on_device = encoded.to(device)
    out = decode_on_device(on_device)  # warm-up: compiles the kernels
    exact = torch.equal(out.cpu().view(torch.int16), tensor.view(torch.int16))
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        decode_on_device(on_device)
    end.record()
    torch.cuda.synchronize()
    seconds = begin.elapsed_time(end) / 1000 / repeats
    nbytes = encoded.original_nbytes()
    return {
        "measure": "gpu_decode_bf16",
        "device": torch.cuda.get_device_name(device),
        "elements": tensor.numel(),
        "saved": round(1 - encoded.stored_nbytes() / nbytes, 4),
        "exact": exact,
        "decode_ms": round(seconds * 1e3, 3),
        "decode_tb_per_s": round(nbytes / seconds / 1e12, 3),
        "meets_1tb_per_s": nbytes / seconds >= TARGET_BYTES_PER_S,
        "cpu_encode_s": round(encode_s, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1 << 28)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = "cuda"
    records = check_exact(device)
    for record in records:
        print(json.dumps(record))
    throughput = measure_throughput(device, args.elements, args.repeats)
    print(json.dumps(throughput))
    return 0 if all(r["exact"] for r in records) and throughput["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
