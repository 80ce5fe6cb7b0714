"""Every CUDA kernel (kernels/cuda/*.cu, found by glob: a new one is covered as it lands)
compiles with nvcc for each GPU architecture we ship (kernels.cuda.runtime.ARCHS), warnings
as errors: a cubin per architecture (ptxas runs, so register and shared-memory limits count;
it takes ~1.4x the time of -ptx alone), and for sm_90 a whole object instead, its host side
through g++ -Wall -Wextra -Werror. Also that no kernel includes a header from outside
kernels/cuda: NVRTC and the CPU emulation (tests/gpu/cuda_host.h) compile the same source
without the CUDA toolkit's headers. Skipped where nvcc is not on PATH. The selected builds run
at once, one nvcc a core (one after another they took ~65 s of a 2-core CI host's run); a build
that passed is not repeated while nothing it reads changes (pytest's cache: --cache-clear
repeats them, and under -p no:cacheprovider every build runs)."""

import functools
import hashlib
import re
import shutil
import subprocess

import pytest

from kernels.cuda import runtime

from compilers import run_at_once

SOURCES = sorted(runtime.HERE.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
FLAGS = ["--std=c++17", "-Werror", "all-warnings", f"-I{runtime.HERE}"]
HOST_FLAGS = "-Wall,-Wextra,-Werror"
OBJECT_ARCH = "sm_90"  # H100/H200: the one architecture also built as a host object
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)


def _command(source, arch: str, out_dir) -> list[str]:
    """nvcc's command line for one source at one architecture, its output in out_dir."""
    if arch == OBJECT_ARCH:  # the whole object: device code, then the host side's g++
        out, args = f"{source.stem}.{arch}.o", ("-c", f"-arch={arch}", "-Xcompiler=" + HOST_FLAGS)
    else:
        out, args = f"{source.stem}.{arch}.cubin", ("-cubin", f"-arch={arch}")
    return [NVCC, *FLAGS, *args, "-o", str(out_dir / out), str(source)]


def _cache_key(command: list[str], source) -> str:
    """Keyed by nvcc's version, the flags, the file and the headers beside it."""
    digest = hashlib.sha256(_nvcc_version().encode() + " ".join(command[1:-3]).encode())
    for path in (source, *sorted(runtime.HERE.glob("*.cuh")), *sorted(runtime.HERE.glob("*.h"))):
        digest.update(path.read_bytes())
    return f"tison/cuda_compile/{source.name}/{digest.hexdigest()[:24]}"


@functools.cache
def _nvcc_version() -> str:
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def builds(request, tmp_path_factory) -> dict:
    """(source, arch) -> None or nvcc's errors, for every test_kernel_compiles case this
    session selected: built on all cores at once, or known to pass from pytest's cache."""
    cases = [
        (item.callspec.params["source"], item.callspec.params["arch"])
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_kernel_compiles"
    ]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    out_dir = tmp_path_factory.mktemp("cuda_builds")
    commands = {case: _command(*case, out_dir) for case in cases}
    keys = {case: _cache_key(command, case[0]) for case, command in commands.items()}
    todo = [case for case in cases if cache is None or not cache.get(keys[case], False)]
    done = dict(zip(todo, run_at_once([commands[case] for case in todo])))
    for case, result in done.items():
        if result.returncode == 0 and cache is not None:
            cache.set(keys[case], True)
    return {case: _errors(done.get(case)) for case in cases}


def _errors(result: subprocess.CompletedProcess | None) -> str | None:
    """None where a build passed (or passed before), else the end of nvcc's errors."""
    if result is None or result.returncode == 0:
        return None
    return result.stderr.decode(errors="replace")[-4000:]


def test_there_are_kernels_and_architectures():
    assert SOURCES, f"no .cu file in {runtime.HERE}"
    assert OBJECT_ARCH in runtime.ARCHS


@needs_nvcc
@pytest.mark.parametrize("arch", runtime.ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles(source, arch, builds):
    error = builds[(source, arch)]
    assert error is None, error


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_includes_only_its_own_headers(source):
    for name in _INCLUDE.findall(source.read_text()):
        assert (runtime.HERE / name).is_file(), f"{source.name} includes {name}"
