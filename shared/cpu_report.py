"""What Tison sees of this CPU and what it runs there (the tier, its kernels, torch's own choice,
threads): `tison env` prints it, the benchmarks head their results with it."""

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
    }  # fmt: skip


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
