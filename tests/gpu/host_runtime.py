"""A kernels.cuda.runtime backend that runs the CUDA kernels on the CPU: each .cu file is
compiled as C++ with cuda_host.h (g++ -x c++), its `extern "C"` kernels (found in the
preprocessed source) each get a launcher `host_<name>(grid, block, shared bytes, args...)`
that ctypes calls, and tensors go by their CPU data pointer. A wrapper in kernels/cuda/ thus
runs unchanged on CPU tensors in the tests, its checks and launch arithmetic included.

    previous = runtime.use_backend(HostBackend())"""

import ctypes
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

HOST_HEADER = Path(__file__).with_name("cuda_host.h")
KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "cuda"
SMEM_BYTES = 96 * 1024  # cuda_host.h's TISON_HOST_SMEM
_KERNEL = re.compile(r'extern\s+"C"\s+void\s+(tison_\w+)\s*\(([^)]*)\)\s*\{')


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


class HostBackend:
    """One shared library per .cu file, built into `cache` (a temporary folder by default)."""

    def __init__(self, cache: Path | None = None):
        self.cache = Path(cache or tempfile.mkdtemp(prefix="tison-cuda-host-"))
        self._libraries: dict[Path, tuple[ctypes.CDLL, dict[str, list[str]]]] = {}

    def takes(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu"

    def function(self, source: Path, name: str):
        library, kernels = self._library(source)
        if name not in kernels:
            raise KeyError(f"{source.name} has no kernel {name!r} (has {sorted(kernels)})")
        params = kernels[name]
        entry = getattr(library, f"host_{name}")

        def launch(grid, block, args, shared_mem=0):
            if len(args) != len(params):
                raise TypeError(f"{name} takes {len(params)} arguments, got {len(args)}")
            if shared_mem > SMEM_BYTES:
                raise ValueError(f"{name}: {shared_mem} B of shared memory, at most {SMEM_BYTES}")
            grid, block = _dim3(grid), _dim3(block)
            entry(*grid, *block, *(_c_arg(a, p, name) for a, p in zip(args, params)))

        return launch

    def _library(self, source: Path):
        if source not in self._libraries:
            kernels = self._kernels(source)
            shim = self._shim(source, kernels)
            digest = hashlib.sha256(shim.encode())
            for path in (source, *sorted(KERNELS.glob("*.cuh")), HOST_HEADER):  # its includes
                digest.update(path.read_bytes())
            target = self.cache / f"{source.stem}_{digest.hexdigest()[:16]}.so"
            if not target.exists():
                cpp = target.with_suffix(".cpp")
                cpp.write_text(shim)
                cmd = [compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", "-pthread"]
                cmd += ["-Wall", "-Werror", f"-I{KERNELS}", "-o", str(target), str(cpp)]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
            self._libraries[source] = (ctypes.CDLL(str(target)), kernels)
        return self._libraries[source]

    def _kernels(self, source: Path) -> dict[str, list[str]]:
        """name -> parameter declarations, from the source as the preprocessor expands it."""
        cmd = [compiler(), "-x", "c++", "-std=c++17", "-E", "-P", f"-I{KERNELS}"]
        cmd += ["-include", str(HOST_HEADER), str(source)]
        text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        found = {m[1]: [p.strip() for p in m[2].split(",")] for m in _KERNEL.finditer(text)}
        if not found:
            raise ValueError(f'no extern "C" tison_* kernel in {source}')
        return found

    @staticmethod
    def _shim(source: Path, kernels: dict[str, list[str]]) -> str:
        lines = [f'#include "{HOST_HEADER}"', f'#include "{source}"']
        for name, params in kernels.items():
            names = [re.findall(r"\w+", p)[-1] for p in params]
            dims = "unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz"
            lines.append(
                f'extern "C" void host_{name}({dims}, {", ".join(params)}) {{\n'
                f"    tison_host_launch({{gx, gy, gz}}, {{bx, by, bz}}, [&] {{\n"
                f"        {name}({', '.join(names)});\n"
                f"    }});\n}}"
            )
        return "\n".join(lines) + "\n"


def _dim3(dims) -> tuple[int, int, int]:
    dims = tuple(int(d) for d in dims)
    return (*dims, *(1,) * (3 - len(dims)))


_SCALARS = {
    "float": (np.float32, ctypes.c_float),
    "double": (np.float64, ctypes.c_double),
    "int": (np.int32, ctypes.c_int),
    "unsigned int": (np.uint32, ctypes.c_uint),
    "unsigned": (np.uint32, ctypes.c_uint),
    "tison_i64": (np.int64, ctypes.c_int64),
    "long long": (np.int64, ctypes.c_int64),
}


def _c_arg(value, param: str, kernel: str):
    """A ctypes value for one kernel parameter, its type checked as the GPU would need it."""
    if "*" in param:
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            raise TypeError(f"{kernel}: {param!r} takes a CPU tensor here, got {type(value)}")
        return ctypes.c_void_p(value.data_ptr())
    words = re.findall(r"\w+", param.replace("const", ""))[:-1]  # drop the parameter's name
    kind = " ".join(words)
    if kind not in _SCALARS:
        raise TypeError(f"{kernel}: no host conversion for parameter {param!r}")
    want, c_type = _SCALARS[kind]
    if type(value) is not want:  # cupy passes a numpy scalar by its own type: it must match
        raise TypeError(f"{kernel}: {param!r} needs {want.__name__}, got {type(value).__name__}")
    return c_type(value.item())
