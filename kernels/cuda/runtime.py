"""How a wrapper launches a kernel of kernels/cuda/: `function(source, name)` gives a callable
`(grid, block, args, shared_mem=0)`, as cupy's RawKernel takes them. On a GPU it is cupy's,
compiled by NVRTC once per process and launched on torch's current stream; the tests install a
backend that runs the same source on the CPU (tests/gpu/host_runtime.py), so every wrapper's
checks and launch arithmetic run there too.

args: torch tensors (device memory, passed by pointer) and numpy scalars (np.int32, np.int64,
np.float32: the kernel parameter's exact type)."""

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

HERE = Path(__file__).parent
Dims = tuple[int, ...]
# The GPU architectures we ship for; tests/test_cuda_compile.py builds every kernel for each.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


class Launch(Protocol):
    def __call__(self, grid: Dims, block: Dims, args: Sequence, shared_mem: int = 0) -> None: ...


class Backend(Protocol):
    def function(self, source: Path, name: str) -> Launch: ...

    def takes(self, x: torch.Tensor) -> bool: ...


class CupyBackend:
    """NVRTC through cupy: one RawModule per source file, kept for the process."""

    def __init__(self) -> None:
        self._modules: dict[Path, object] = {}
        self._cupy: bool | None = None  # whether cupy imports, once asked

    def takes(self, x: torch.Tensor) -> bool:
        if not x.is_cuda:
            return False
        if self._cupy is None:
            try:
                import cupy  # noqa: F401
            except ImportError:
                self._cupy = False
            else:
                self._cupy = True
        return self._cupy

    def function(self, source: Path, name: str) -> Launch:
        import cupy

        if source not in self._modules:
            options = ("--std=c++17", f"-I{HERE}")
            self._modules[source] = cupy.RawModule(code=source.read_text(), options=options)
        kernel = self._modules[source].get_function(name)

        def launch(grid, block, args, shared_mem=0):
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            stream = torch.cuda.current_stream(device).cuda_stream
            with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream):
                kernel(tuple(grid), tuple(block), _cupy_args(cupy, args), shared_mem=shared_mem)

        return launch


def _cupy_args(cupy, args: Sequence) -> tuple:
    """Torch CUDA tensors as cupy arrays (zero copy; a kernel sees their data pointer). cupy
    has no bfloat16, so those go as int16 views of the same memory; a CPU tensor would be
    copied to the GPU by cupy.asarray (the kernel's writes lost), so it is refused."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cuda":
                raise ValueError(f"a kernel argument is on {a.device}, not on a CUDA device")
            a = cupy.asarray(a.view(torch.int16) if a.dtype == torch.bfloat16 else a)
        out.append(a)
    return tuple(out)


_backend: Backend | None = None
_launchers: dict[tuple[str, str], Launch] = {}  # the current backend's, asked for once each


def use_backend(backend: Backend | None) -> Backend | None:
    """Installs a backend (None: cupy's again); returns the one it replaces."""
    global _backend
    previous, _backend = _backend, backend
    _launchers.clear()
    return previous


def _current() -> Backend:
    global _backend
    if _backend is None:
        _backend = CupyBackend()
    return _backend


def function(source: str, name: str) -> Launch:
    """Kernel `name` of kernels/cuda/`source` (looked up once: a decode step launches
    hundreds of kernels outside CUDA graphs)."""
    key = (source, name)
    if key not in _launchers:
        _launchers[key] = _current().function(HERE / source, name)
    return _launchers[key]


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels run on x: a GPU tensor where cupy imports (or the CPU tensors of the
    tests' emulation, when installed). The layers ask it before their torch code."""
    return x.dtype in (torch.float32, torch.bfloat16) and _current().takes(x)


def check(
    t: torch.Tensor,
    what: str,
    dtypes: Sequence[torch.dtype],
    dims: int | None = None,
    device: torch.device | None = None,
    dense_from: int = 0,
) -> None:
    """ValueError naming `what` unless t is of one of dtypes, has dims dimensions, lies on
    device (when given) and its dimensions from dense_from on are packed densely: 0 (the
    default) contiguous, 1 rows that may lie any stride apart, t.dim() - 1 only the last
    dimension contiguous. The kernel then takes the outer strides as arguments."""
    if t.dtype not in dtypes:
        raise ValueError(f"{what}: dtype {t.dtype}, expected one of {list(dtypes)}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{what}: {t.dim()} dimensions {tuple(t.shape)}, expected {dims}")
    if device is not None and t.device != device:
        raise ValueError(f"{what}: on {t.device}, expected {device}")
    inner = 1
    for size, stride in zip(reversed(t.shape[dense_from:]), reversed(t.stride()[dense_from:])):
        if size > 1 and stride != inner:
            layout = "contiguous" if dense_from == 0 else f"dense from dimension {dense_from}"
            raise ValueError(f"{what}: must be {layout} (strides {t.stride()})")
        inner *= size


def suffix(dtype: torch.dtype) -> str:
    """The kernels' name suffix of an element type: float32 'f32', bfloat16 'bf16'."""
    names: dict[torch.dtype, str] = {torch.float32: "f32", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise ValueError(f"the CUDA kernels take float32 or bfloat16, not {dtype}")
    return names[dtype]


def blocks(n: int, per_block: int) -> int:
    """Blocks of per_block that cover n (at least one)."""
    return max(1, -(-n // per_block))
