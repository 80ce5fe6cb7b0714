"""Running the C CPU kernels at each tier of kernels/cpu/isa.py in one process: `at_tier`
parametrizes a test over every tier, skipping (with the reason) those this CPU cannot run, and
swaps in that tier's library for the test. TISON_CPU_ISA caps the tiers as it caps Tison."""

import pytest
import torch

from kernels.cpu import isa, library

RUNNABLE = [t.name for t in isa.tiers_up_to(isa.active())]


EMULATED_AMX = "amx_emulated"  # the amx tier's library with its tiles in C (amx_emulated.h)
_EMULATION_HOST = "avx512_bf16"  # what the emulated build needs of the CPU


def tier_params(emulated_amx: bool = False) -> list:
    """Every tier, those above this run's (the CPU's best, or TISON_CPU_ISA's) marked skip;
    with emulated_amx, also the AMX kernels on emulated tiles wherever avx512_bf16 runs (so
    that they are tested on CPUs without AMX too)."""
    params = []
    for tier in isa.TIERS:
        missing = sorted(tier.needs - isa.cpu_flags()) if isa.is_x86() else ["x86-64"]
        marks = []
        if tier.name not in RUNNABLE:
            reason = f"CPU lacks {' '.join(missing)}" if missing else "capped by TISON_CPU_ISA"
            marks = [pytest.mark.skip(reason=f"tier {tier.name}: {reason}")]
        params.append(pytest.param(tier.name, marks=marks, id=tier.name))
    if emulated_amx:
        reason = f"{EMULATED_AMX}: tier {_EMULATION_HOST} cannot run here"
        marks = [] if _EMULATION_HOST in RUNNABLE else [pytest.mark.skip(reason=reason)]
        params.append(pytest.param(EMULATED_AMX, marks=marks, id=EMULATED_AMX))
    return params


def use_tier(name: str, monkeypatch) -> None:
    """Make the kernel wrappers use the library of tier `name` for the rest of the test."""
    if name == EMULATED_AMX:  # built for avx512_bf16, running as the amx tier's library
        tier = isa.BY_NAME["amx"]
        kernels = library.load_kernels(isa.BY_NAME[_EMULATION_HOST], ("-DTISON_AMX_EMULATED",))
    else:
        tier = isa.BY_NAME[name]
        kernels = library.load_kernels(tier)
    if kernels is None:
        pytest.fail(f"the C kernels do not build at tier {name}")
    if name == "amx" and not kernels["tk_amx_ready", torch.bfloat16]():
        pytest.skip("tier amx: the OS grants this process no AMX tiles")
    monkeypatch.setattr(library, "functions", kernels)
    monkeypatch.setattr(library, "_built", [tier])
