"""What the GPU test modules share: whether this machine runs them (a CUDA device torch sees
and cupy to compile the kernels; each tests/gpu module skips itself without them), the runtime
backend installed for a module, and kernel timing for their measure() functions. The modules
that run the CUDA kernels on the CPU (tests/test_cuda_*_cpu.py) share their fixture and marks
too.

    if not gpu_ready():
        pytest.skip("needs cupy and a CUDA device", allow_module_level=True)
    pytestmark = ON_GPU  # or ON_HOST, for the CPU emulation

tests/conftest.py imports the two backend fixtures, so that every module sees them."""

import contextlib

import pytest
import torch
from gpu.host_runtime import HostBackend, compiler

from kernels.cuda import runtime


def gpu_ready() -> bool:
    try:
        import cupy

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # cupy missing or no driver: nothing to test here
        return False


@contextlib.contextmanager
def installed(backend):
    """The kernels run on `backend` (cupy's, or the CPU emulation) inside the block."""
    previous = runtime.use_backend(backend)
    try:
        yield backend
    finally:
        runtime.use_backend(previous)


@pytest.fixture(scope="module")
def host_backend(tmp_path_factory):
    """The module's CUDA kernels run on the CPU (host_runtime.py), built in a folder of its own."""
    with installed(HostBackend(tmp_path_factory.mktemp("cuda-host"))):
        yield


@pytest.fixture(scope="module")
def cupy_backend():
    """The module's CUDA kernels run on the GPU, compiled by cupy."""
    with installed(runtime.CupyBackend()):
        yield


# the marks of a module of CUDA kernels: on the CPU emulation (skipped without a C++
# compiler), or on a GPU (its own skip first: see above)
ON_HOST = [
    pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler"),
    pytest.mark.usefixtures("host_backend"),
]
ON_GPU = [pytest.mark.gpu, pytest.mark.usefixtures("cupy_backend")]


def graph_and_eager_ms(calls, repeats: int) -> tuple[float, float]:
    """Milliseconds a call of calls [(fn, args), ...], taken in turn `repeats` times: from a
    CUDA graph of them, and launched eagerly."""
    repeats = max(repeats, len(calls))

    def run():
        for i in range(repeats):
            fn, args = calls[i % len(calls)]
            fn(*args)

    run()  # compiles, warms the allocator
    eager_ms = _elapsed_ms(run) / repeats
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    return _elapsed_ms(graph.replay) / repeats, eager_ms


def _elapsed_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)
