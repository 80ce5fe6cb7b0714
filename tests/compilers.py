"""Tests of the C paths skip only where there is no C compiler: where there is one, a build that
fails is a failure (the library then is None and the tests that call it fail), never a skip.
And compiler runs for the build tests, one a core at once; the aarch64 cross-compiler and
qemu-user that build and run the portable C for ARM64 (.ci/run installs both)."""

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels.build import compiler

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc or gcc) on PATH")
CROSS_COMPILERS = ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-gcc-12")  # Debian's package
QEMU = "qemu-aarch64"  # Debian: qemu-user


def cross_compiler() -> str | None:
    return next((c for c in CROSS_COMPILERS if shutil.which(c)), None)


def aarch64_tools() -> tuple[str, str, str]:
    """(this machine's gcc, the aarch64 cross-compiler, qemu-aarch64), or the test skips."""
    tools = shutil.which("gcc"), cross_compiler(), shutil.which(QEMU)
    if None in tools:
        pytest.skip("needs gcc, gcc-aarch64-linux-gnu and qemu-user (.ci/run installs them)")
    return tools


def program_build(compiler: str, program, sources, flags, out, *extra: str) -> list[str]:
    """The command that builds a test program (tests/native/*.c) into `out` with a C library's
    sources and flags (as the library is built, less -shared and -fPIC); a source the program
    includes (for its types) is left out of the link."""
    included = set(re.findall(r'#include "(\w+\.c)"', program.read_text()))
    linked = [str(s) for s in sources if s.name not in included]
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    include = f"-I{sources[0].parent}"
    return [compiler, *flags, include, str(program), *linked, "-o", str(out), *extra]


def run_at_once(commands: list[list[str]], cwd=None) -> list[subprocess.CompletedProcess]:
    """Each command's result (output captured as bytes), in order; they run one a core at
    once (a compiler is a process a source, so one after another they leave cores idle)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda c: subprocess.run(c, cwd=cwd, capture_output=True), commands))
