"""The CPU tier policy (kernels/cpu/isa.py) on given flag sets, TISON_CPU_ISA's cap and its
errors, and `tison env` reporting what this run uses."""

import json
import os
import subprocess
import sys

import pytest

from kernels.cpu import isa

from services_harness import REPO_ROOT

ZEN3 = frozenset("sse4_2 avx avx2 fma f16c bmi2 vpclmulqdq".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.skipif(not isa.is_x86(), reason="x86 tiers")
@pytest.mark.parametrize(
    "flags,tier",
    [(frozenset(), "portable"), (ZEN3, "avx2"), (SKYLAKE_SP, "avx512"), (ZEN4, "avx512_bf16")]
    + [(SAPPHIRE_RAPIDS, "amx"), (ZEN3 - {"fma"}, "portable"), (ZEN4 - {"avx512bw"}, "avx2")],
)
def test_detected_tier_is_the_best_whose_needs_are_met(flags, tier):
    assert isa.detected(flags).name == tier


def test_cap_lowers_never_raises_the_tier(monkeypatch):
    best = isa.detected()
    for tier in isa.TIERS:
        monkeypatch.setenv(isa.ENV_VAR, tier.name.upper())  # case does not matter
        expected = tier if isa.TIERS.index(tier) <= isa.TIERS.index(best) else best
        assert isa.active() == expected
    monkeypatch.setenv(isa.ENV_VAR, "")
    assert isa.active() == best


def test_unknown_tier_names_the_variable(monkeypatch):
    monkeypatch.setenv(isa.ENV_VAR, "avx1024")
    with pytest.raises(ValueError, match="TISON_CPU_ISA='avx1024': expected one of portable"):
        isa.active()


def test_cap_torch_sets_torchs_and_onednns_caps_unless_set(monkeypatch):
    monkeypatch.setattr(isa, "is_x86", lambda: True)
    monkeypatch.setenv(isa.ENV_VAR, "portable")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    isa.cap_torch()
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"  # the user's own setting wins


def test_cap_torch_leaves_torch_alone_off_x86(monkeypatch):
    """On ARM64 the tiers' caps would hand oneDNN an x86 ISA name (SSE41)."""
    monkeypatch.setattr(isa, "is_x86", lambda: False)
    monkeypatch.setenv(isa.ENV_VAR, "portable")
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    isa.cap_torch()
    assert not {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} & set(
        os.environ
    )


def run_tison(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`tison ARGS` with env added, and without the torch caps this run may have set."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    }
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
        env={**base, "PYTHONPATH": str(REPO_ROOT), **env},
    )  # fmt: skip


def test_tison_env_reports_the_capped_tier_and_its_kernels():
    lowest = isa.tiers_up_to(isa.active())[0].name  # portable
    result = run_tison("env", "--json", TISON_CPU_ISA=lowest)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["tier"] == facts["kernels_built_for"] == lowest
    assert facts["tier_detected"] == isa.detected().name
    assert facts["fused_decoder"] and facts["linear_kernel"] == f"vector ({lowest})"
    if isa.is_x86():  # torch was capped before its first operation
        assert facts["torch_cpu_capability"] == "DEFAULT" and facts["onednn_bf16"] is False


def test_tison_with_a_bad_tier_says_so_and_exits_2():
    result = run_tison("env", TISON_CPU_ISA="sse9")
    assert result.returncode == 2 and "TISON_CPU_ISA='sse9'" in result.stderr
