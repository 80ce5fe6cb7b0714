"""Running the C CPU kernels at each tier of kernels/cpu/isa.py in one process: `at_tier`
parametrizes a test over every tier, skipping (with the reason) those this CPU cannot run, and
swaps in that tier's library for the test. TISON_CPU_ISA caps the tiers as it caps Tison."""

import pytest
import torch

from kernels.cpu import isa, library

RUNNABLE = [t.name for t in isa.tiers_up_to(isa.active())]


def tier_params() -> list:
    """Every tier, those above this run's (the CPU's best, or TISON_CPU_ISA's) marked skip."""
    params = []
    for tier in isa.TIERS:
        missing = sorted(tier.needs - isa.cpu_flags()) if isa.is_x86() else ["x86-64"]
        marks = []
        if tier.name not in RUNNABLE:
            reason = f"CPU lacks {' '.join(missing)}" if missing else "capped by TISON_CPU_ISA"
            marks = [pytest.mark.skip(reason=f"tier {tier.name}: {reason}")]
        params.append(pytest.param(tier.name, marks=marks, id=tier.name))
    return params


def use_tier(name: str, monkeypatch) -> None:
    """Make the kernel wrappers use the library of tier `name` for the rest of the test."""
    tier = isa.BY_NAME[name]
    kernels = library.load_kernels(tier)
    if kernels is None:
        pytest.fail(f"the C kernels do not build at tier {name}")
    if name == "amx" and not kernels["tk_amx_ready", torch.bfloat16]():
        pytest.skip("tier amx: the OS grants this process no AMX tiles")
    monkeypatch.setattr(library, "functions", kernels)
    monkeypatch.setattr(library, "_built", [tier])
