"""The C CPU kernels build at every tier (x86-64 compilers accept each tier's flags whatever
this CPU has), and the portable sources compile for aarch64 with a cross-compiler: no x86
intrinsic outside its guard. Running each tier is test_library.py's job (tiers.py)."""

import shutil

import pytest
import torch

from kernels.cpu import isa, library
from shared.codec import native

from compilers import needs_compiler, run_at_once

CROSS_COMPILERS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-gcc-12")


def compile_objects(compiler: str, flags: list[str], tmp_path) -> tuple[int, str]:
    """Compiles (no link) every kernel source with these flags, a compiler process a source,
    at once (one after another they took ~20 s of the suite on 2 cores) -> (the worst return
    code, every source's errors)."""
    cmd = [compiler, "-O2", "-std=gnu11", "-fopenmp", "-fPIC", "-ffp-contract=off", *flags]
    cmd += ["-Werror=implicit-function-declaration", "-c"]
    results = run_at_once([[*cmd, str(source)] for source in library.SOURCES], cwd=tmp_path)
    return max(r.returncode for r in results), b"".join(r.stderr for r in results).decode()


@pytest.mark.skipif(not isa.is_x86(), reason="the tiers' flags are x86-64 flags")
@pytest.mark.parametrize("tier", isa.TIER_NAMES)
def test_every_tier_compiles_on_x86(tier, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    code, errors = compile_objects(compiler, list(isa.BY_NAME[tier].cflags), tmp_path)
    assert code == 0, errors


def test_portable_sources_compile_for_aarch64(tmp_path):
    compiler = next((c for c in CROSS_COMPILERS if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no aarch64 cross-compiler (Debian: gcc-aarch64-linux-gnu; .ci/run has one)")
    code, errors = compile_objects(compiler, [], tmp_path)
    assert code == 0, errors
    objects = sorted(p.name for p in tmp_path.glob("*.o"))
    assert objects == sorted(p.stem + ".o" for p in library.SOURCES)
    for name in objects:
        header = (tmp_path / name).read_bytes()[:20]
        assert (
            header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183
        )  # EM_AARCH64


@needs_compiler
def test_the_c_libraries_build_wherever_there_is_a_compiler():
    """A compile error in our own C fails here: the C paths' tests skip only without a
    compiler, and the kernels load at the tier this CPU runs, not one below it."""
    assert native.load() is not None
    assert library.usable(torch.zeros(1))
    active = isa.active()
    assert library.built_tier() == active or active.name == "amx"  # amx: if the OS grants
