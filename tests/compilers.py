"""Tests of the C paths skip only where there is no C compiler: where there is one, a build that
fails is a failure (the library then is None and the tests that call it fail), never a skip.
And compiler runs for the build tests, one a core at once."""

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from kernels.build import compiler

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc or gcc) on PATH")


def run_at_once(commands: list[list[str]], cwd=None) -> list[subprocess.CompletedProcess]:
    """Each command's result (output captured as bytes), in order; they run one a core at
    once (a compiler is a process a source, so one after another they leave cores idle)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda c: subprocess.run(c, cwd=cwd, capture_output=True), commands))
