"""What Tison sees of this CPU and what it runs there (the tier, its kernels, torch's own choice,
threads), and of its GPUs: `tison env` prints it, the benchmarks head their results with it."""

import os
import platform

from kernels.cpu import isa


def report() -> dict:
    """The facts `tison env` prints, as a dict."""
    import torch

    from kernels.cpu import library
    from shared.models.layers.cpu_linear import onednn_bf16

    flags = isa.cpu_flags()
    wanted = sorted(set().union(*(t.needs for t in isa.TIERS)))
    built = library.built_tier()
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_flags": {flag: flag in flags for flag in wanted},
        "tier_detected": isa.detected().name,
        "TISON_CPU_ISA": os.environ.get(isa.ENV_VAR) or None,
        "tier": isa.active().name,
        "tiers_runnable": [t.name for t in isa.tiers_up_to(isa.detected())],
        "kernels_built_for": None if built is None else built.name,
        "linear_kernel": "none" if built is None else ("amx" if library.amx_ready() else
                                                       f"vector ({built.name})"),
        "fused_decoder": built is not None,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": onednn_bf16(),
        "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA") or None,
        "MKL_ENABLE_INSTRUCTIONS": os.environ.get("MKL_ENABLE_INSTRUCTIONS") or None,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        **gpu_report(torch),
    }  # fmt: skip


def gpu_report(torch) -> dict:
    """What `--device auto` would take: torch's CUDA devices, and whether the CUDA kernels
    can be compiled (cupy's NVRTC) here."""
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB sm_{p.major}{p.minor}")
    try:
        import cupy

        kernels = f"cupy {cupy.__version__}"
    except ImportError:
        kernels = None
    return {
        "torch_cuda": torch.version.cuda,
        "gpus": gpus,
        "device_auto": "cuda" if gpus else "cpu",
        "cuda_kernels": kernels,
    }


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
