"""The C CPU kernels build at every tier (x86-64 compilers accept each tier's flags whatever
this CPU has), and the portable sources compile for aarch64 with a cross-compiler, with the
flags the library is built with: no x86 intrinsic outside its guard, and no loop that crashes
that compiler's vectorizer at -O3 (gcc 12's did on an fmaxf reduction). Under qemu-user the
aarch64 build computes the same bits as this machine's portable one. Running each tier is
test_library.py's job (tiers.py)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kernels.cpu import isa, library
from shared.codec import native
from shared.parallel import shm_group

from compilers import aarch64_tools, cross_compiler, needs_compiler, program_build, run_at_once

DIGESTS = Path(__file__).with_name("native") / "kernel_digests.c"
SHM_SYNC = Path(shm_group.__file__).with_name("_shm_sync.c")  # the all-reduce's signals
PORTABLE = isa.BY_NAME["portable"]


def compile_objects(compiler: str, tier: isa.Tier, tmp_path) -> tuple[int, str]:
    """Compiles (no link) every kernel source with the tier's library flags, a compiler process
    a source, at once (one after another they took ~20 s of the suite on 2 cores) -> (the worst
    return code, every source's errors)."""
    cmd = [compiler, *library.flags(tier), "-Werror=implicit-function-declaration", "-c"]
    results = run_at_once([[*cmd, str(source)] for source in library.SOURCES], cwd=tmp_path)
    return max(r.returncode for r in results), b"".join(r.stderr for r in results).decode()


@pytest.mark.skipif(not isa.is_x86(), reason="the tiers' flags are x86-64 flags")
@pytest.mark.parametrize("tier", isa.TIER_NAMES)
def test_every_tier_compiles_on_x86(tier, tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    code, errors = compile_objects(compiler, isa.BY_NAME[tier], tmp_path)
    assert code == 0, errors


def test_portable_sources_compile_for_aarch64(tmp_path):
    compiler = cross_compiler()
    if compiler is None:
        pytest.skip("no aarch64 cross-compiler (Debian: gcc-aarch64-linux-gnu; .ci/run has one)")
    code, errors = compile_objects(compiler, PORTABLE, tmp_path)
    assert code == 0, errors
    objects = sorted(p.name for p in tmp_path.glob("*.o"))
    assert objects == sorted(p.stem + ".o" for p in library.SOURCES)
    for name in objects:
        header = (tmp_path / name).read_bytes()[:20]
        assert (
            header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183
        )  # EM_AARCH64


@pytest.mark.skipif(not isa.is_x86(), reason="compares an x86-64 build with an aarch64 one")
def test_portable_kernels_compute_the_same_bits_on_aarch64(tmp_path):
    """Every kernel, alone and in the fused decoder, on one thread and two, the all-reduce
    between two processes (kernel_digests.c): the aarch64 build (run by qemu-user) prints the
    same digest of each output as this machine's portable build, which the kernel tests check
    against torch at the portable tier."""
    gcc, cross, qemu = aarch64_tools()
    x86, arm = tmp_path / "digests", tmp_path / "digests-aarch64"
    sources = [*library.SOURCES, SHM_SYNC]
    builds = run_at_once(
        [
            program_build(compiler, DIGESTS, sources, library.flags(PORTABLE), out, *extra)
            for compiler, out, extra in ((gcc, x86, ["-lm"]), (cross, arm, ["-static", "-lm"]))
        ]
    )
    assert [b.returncode for b in builds] == [0, 0], b"".join(b.stderr for b in builds).decode()
    ours, theirs = (
        subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        for cmd in ([x86], [qemu, arm])
    )
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr + theirs.stderr
    lines = ours.stdout.splitlines()
    names = {line.rsplit(" ", 2)[0] for line in lines}
    assert len(lines) == 2 * 57 and len(names) == 57, ours.stdout  # 1 and 2 threads
    assert theirs.stdout.splitlines() == lines


@needs_compiler
def test_the_c_libraries_build_wherever_there_is_a_compiler():
    """A compile error in our own C fails here: the C paths' tests skip only without a
    compiler, and the kernels load at the tier this CPU runs, not one below it."""
    assert native.load() is not None
    assert library.usable(torch.zeros(1))
    active = isa.active()
    assert library.built_tier() == active or active.name == "amx"  # amx: if the OS grants
