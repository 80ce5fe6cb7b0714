"""What this CPU can run, as one tier, and the flags each tier's C libraries are built with.

The tiers are ordered; each adds instructions to the one before (llama.cpp builds its CPU
backend once per such variant and picks the best at load time, and so do we):

| tier        | needs (Linux /proc/cpuinfo flags)        | Tison's kernels get            |
|-------------|------------------------------------------|--------------------------------|
| portable    | nothing (any x86-64, aarch64, ...)       | plain C the compiler vectorizes |
| avx2        | avx2 fma f16c                            | 256-bit AVX2 + FMA             |
| avx512      | avx512f avx512bw avx512vl avx512dq       | 512-bit AVX-512                |
| avx512_bf16 | avx512 + avx512_bf16                     | bf16 dot products (vdpbf16ps)  |
| amx         | avx512_bf16 + amx_tile amx_bf16          | AMX tiles for the linears      |

The tier is the best one the CPU has, capped by TISON_CPU_ISA (a tier's name) so one machine
can run as an older CPU would. The cap also caps torch (ATEN_CPU_CAPABILITY) and oneDNN
(ONEDNN_MAX_CPU_ISA) when `cap_torch()` runs before torch's first operation. The libraries
are built with the tier's flags, never -march=native, so a library built on one CPU is right
for every CPU of its tier."""

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV_VAR = "TISON_CPU_ISA"


@dataclass(frozen=True)
class Tier:
    name: str
    needs: frozenset[str]  # CPU flags (as /proc/cpuinfo spells them), this tier's and below
    cflags: tuple[str, ...]  # compiler flags for this tier's code (x86-64 gcc/clang)
    aten: str  # ATEN_CPU_CAPABILITY of torch's kernels at most this wide
    onednn: str  # ONEDNN_MAX_CPU_ISA likewise
    mkl: str  # MKL_ENABLE_INSTRUCTIONS likewise (MKL runs torch's float32 matmuls, which use
    # no more than AVX-512 at any tier)


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX512_NEEDS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
TIERS = (
    Tier("portable", frozenset(), (), "default", "SSE41", "SSE4_2"),
    Tier("avx2", frozenset({"avx2", "fma", "f16c"}), _AVX2, "avx2", "AVX2", "AVX2"),
    Tier(
        "avx512", frozenset(_AVX512_NEEDS), (*_AVX512, "-mprefer-vector-width=512"), "avx512",
        "AVX512_CORE", "AVX512",
    ),
    Tier(
        "avx512_bf16", frozenset({*_AVX512_NEEDS, "avx512_bf16"}),
        (*_AVX512, "-mavx512bf16", "-mprefer-vector-width=512"), "avx512", "AVX512_CORE_BF16",
        "AVX512",
    ),
    Tier(
        "amx", frozenset({*_AVX512_NEEDS, "avx512_bf16", "amx_tile", "amx_bf16"}),
        (*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mprefer-vector-width=512"),
        "avx512", "AVX512_CORE_AMX", "AVX512",
    ),
)  # fmt: skip
TIER_NAMES = tuple(t.name for t in TIERS)
BY_NAME = {t.name: t for t in TIERS}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags: /proc/cpuinfo's "flags" (x86) or "Features" (ARM) line."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detected(flags: frozenset[str] | None = None) -> Tier:
    """The best tier whose needs the CPU meets (portable off x86)."""
    flags = cpu_flags() if flags is None else flags
    if not is_x86():
        return TIERS[0]
    return [t for t in TIERS if t.needs <= flags][-1]


def cap(value: str | None = None) -> Tier | None:
    """The tier TISON_CPU_ISA names (or `value`), None when unset; ValueError naming the
    variable when it names no tier."""
    value = os.environ.get(ENV_VAR, "") if value is None else value
    if not value.strip():
        return None
    name = value.strip().lower()
    if name not in BY_NAME:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(TIER_NAMES)}")
    return BY_NAME[name]


def active() -> Tier:
    """The tier Tison's kernels run at: the CPU's best, capped by TISON_CPU_ISA."""
    best, limit = detected(), cap()
    if limit is None or TIERS.index(limit) >= TIERS.index(best):
        return best
    return limit


def tiers_up_to(tier: Tier) -> list[Tier]:
    """tier and every tier below it, lowest first."""
    return list(TIERS[: TIERS.index(tier) + 1])


def at_least(name: str) -> bool:
    """Whether the active tier includes tier `name`."""
    return TIERS.index(active()) >= TIERS.index(BY_NAME[name])


def cap_torch() -> None:
    """When TISON_CPU_ISA caps the tier, cap torch's, oneDNN's and MKL's kernels the same way
    (unless their own variables are set). Takes effect only before torch's first CPU
    operation. Off x86-64 nothing: the caps name x86 instruction sets."""
    if cap() is None or not is_x86():
        return
    tier = active()
    os.environ.setdefault("ATEN_CPU_CAPABILITY", tier.aten)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", tier.onednn)
    os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", tier.mkl)


if __name__ == "__main__":  # .ci/run: the tiers below this run's, which it tests again
    print(" ".join(t.name for t in tiers_up_to(active())[:-1]))
