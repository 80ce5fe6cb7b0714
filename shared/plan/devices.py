"""The accelerators `tison plan` places models on: memory as `nvidia-smi --query-gpu=memory.total`
reports it (MiB), which is what a process can allocate at most, before the reserve."""

from dataclasses import dataclass

MiB, GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int
    description: str


DEVICES = {
    d.name: d
    for d in (
        Device("h100-80gb", 81_559 * MiB, "NVIDIA H100 80GB HBM3 (SXM)"),
        Device("h200-141gb", 143_771 * MiB, "NVIDIA H200 141GB HBM3e"),
        Device("a100-80gb", 81_920 * MiB, "NVIDIA A100 80GB"),
        Device("a100-40gb", 40_960 * MiB, "NVIDIA A100 40GB"),
        Device("l40s-48gb", 46_068 * MiB, "NVIDIA L40S 48GB"),
        Device("b200-180gb", 183_359 * MiB, "NVIDIA B200 180GB HBM3e"),
    )
}
CPU = "cpu"  # `--gpu cpu`: a CPU host of --memory bytes, quantized weights dequantized as loaded
DEFAULT_GPU_RESERVE = 4 * GiB  # per GPU: CUDA context, cuBLAS/NCCL workspaces, activations


def parse_bytes(text: str) -> int:
    """'80GiB', '512MiB', '1.5GB', '123456' -> bytes."""
    units = {"kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
             "gb": 10**9, "tb": 10**12, "b": 1}  # fmt: skip
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * factor)
    return int(t)
