"""Every CUDA kernel (kernels/cuda/*.cu, found by glob: a new one is covered as it lands)
compiles with nvcc for each GPU architecture we ship (kernels.cuda.runtime.ARCHS), warnings
as errors: a cubin per architecture (ptxas runs, so register and shared-memory limits count;
it takes ~1.4x the time of -ptx alone), and for sm_90 a whole object instead, its host side
through g++ -Wall -Wextra -Werror. Also that no kernel includes a header from outside
kernels/cuda: NVRTC and the CPU emulation (tests/gpu/cuda_host.h) compile the same source
without the CUDA toolkit's headers. Skipped where nvcc is not on PATH; a build that passed is
not repeated while nothing it reads changes (pytest's cache: --cache-clear repeats them)."""

import functools
import hashlib
import re
import shutil
import subprocess

import pytest

from kernels.cuda import runtime

SOURCES = sorted(runtime.HERE.glob("*.cu"))
NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
FLAGS = ["--std=c++17", "-Werror", "all-warnings", f"-I{runtime.HERE}"]
HOST_FLAGS = "-Wall,-Wextra,-Werror"
OBJECT_ARCH = "sm_90"  # H100/H200: the one architecture also built as a host object
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.MULTILINE)


def _nvcc(cache, source, out, *args: str) -> None:
    """Compiles, unless this very command passed on these very sources before (pytest's cache,
    keyed by nvcc's version, the flags, the file and the headers beside it)."""
    command = [NVCC, *FLAGS, *args, "-o", str(out), str(source)]
    digest = hashlib.sha256(_nvcc_version().encode() + " ".join(command[1:-2]).encode())
    for path in (source, *sorted(runtime.HERE.glob("*.cuh")), *sorted(runtime.HERE.glob("*.h"))):
        digest.update(path.read_bytes())
    key = f"tison/cuda_compile/{source.name}/{digest.hexdigest()[:24]}"
    if cache.get(key, False):
        return
    done = subprocess.run(command, capture_output=True)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    cache.set(key, True)


@functools.cache
def _nvcc_version() -> str:
    return subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout


def test_there_are_kernels_and_architectures():
    assert SOURCES, f"no .cu file in {runtime.HERE}"
    assert OBJECT_ARCH in runtime.ARCHS


@needs_nvcc
@pytest.mark.parametrize("arch", runtime.ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles(source, arch, tmp_path, cache):
    if arch == OBJECT_ARCH:  # the whole object: device code, then the host side's g++
        out, args = tmp_path / "kernel.o", ("-c", f"-arch={arch}", "-Xcompiler=" + HOST_FLAGS)
    else:
        out, args = tmp_path / "kernel.cubin", ("-cubin", f"-arch={arch}")
    _nvcc(cache, source, out, *args)


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_includes_only_its_own_headers(source):
    for name in _INCLUDE.findall(source.read_text()):
        assert (runtime.HERE / name).is_file(), f"{source.name} includes {name}"
