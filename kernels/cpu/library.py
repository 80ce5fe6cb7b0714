"""The C CPU kernels as one library: every source here built for the CPU's tier (isa.py) on
first use, flags in the cache key (kernels/build.py), loaded with ctypes. The op wrappers
(norm.py, rope.py, activation.py, argmax.py, token_mask.py, attention.py, linear.py,
decode_layer.py, all_reduce.py) check dtype, shape and strides and pass addresses to its
functions. The layers call them for CPU tensors of float32 or bfloat16 when `usable(x)`;
elsewhere (another device, no C compiler) the layers keep their torch code, which is also the
reference the kernel tests compare against."""

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from kernels.build import build_library
from kernels.cpu import isa

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# -fno-trapping-math: while FP exceptions may trap, GCC does not vectorize a loop that clamps
# before a float-to-int conversion (exp_approx: SiLU, the softmax); no result changes
BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
BASE_FLAGS += ["-fno-trapping-math"]
SOURCES = sorted(_HERE.glob("*.c"))  # one a kernel, all in the one library
HEADERS = sorted(_HERE.glob("*.h"))
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "tk_rms_norm": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int]),
    "tk_rope": (None, [_ptr, _i64, _ptr, _i64, *[_i64] * 4, _ptr, _ptr, _ptr, _ptr, _ptr, _int]),
    "tk_silu_mul": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "tk_all_reduce": (_i64, [_ptr, _ptr, _i64, _int]),
    "tk_argmax": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
    "tk_token_mask": (_int, [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "tk_paged_attention": (
        _int,
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
        + [*[_i64] * 6, _f32, _ptr, _int],
    ),
    "tk_attention_timed": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, *[_i64] * 5, _f32, _ptr, _int, _ptr],
    ),
}
_BF16_ONLY = {  # linear_bf16.c, decode_layer.c, shares.c: one function each, not one a dtype
    "tk_amx_ready": (_int, []),
    "tk_shares_walk": (_int, [_i64, _int, _int, _ptr, _i64, _ptr]),
    "tk_op_seconds": (_int, [_ptr, _i64]),
    "tk_linear_bf16": (_int, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int]),
    "tk_experts_linear_bf16": (_int, [_ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _int]),
    "tk_decode_layers_bf16": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _int, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
        + [_ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _int],
    ),
}
_lock = threading.Lock()
functions: dict = {}  # (name, dtype) -> the ctypes function, once built and loaded
_built: list = []  # [the tier the loaded library was built for, or None], once tried


def flags(tier: isa.Tier) -> list[str]:
    return [*BASE_FLAGS, *tier.cflags]


def _load() -> bool:
    if _built:  # every kernel call asks: no lock once the library is loaded
        return _built[0] is not None
    with _lock:
        if not _built:
            tier, kernels = None, None
            for candidate in reversed(isa.tiers_up_to(isa.active())):
                kernels = load_kernels(candidate)
                if kernels is not None and not (
                    candidate.name == "amx" and not kernels["tk_amx_ready", torch.bfloat16]()
                ):  # an AMX build where the OS grants no tiles: the next tier down
                    tier = candidate
                    break
            if tier is None:
                log.warning("no C CPU kernels (no working C compiler): the layers use torch ops")
            functions.update(kernels if tier is not None else {})
            _built.append(tier)
        return _built[0] is not None


def built_tier() -> isa.Tier | None:
    """The tier the loaded kernels were built for (None: no C kernels)."""
    _load()
    return _built[0]


def load_kernels(tier: isa.Tier, extra_flags: tuple[str, ...] = ()) -> dict | None:
    """{(name, dtype): ctypes function} of the library built for this tier (and extra_flags:
    the tests' -DTISON_AMX_EMULATED); None if it cannot be built."""
    try:
        path = build_library("tison_cpu_kernels", SOURCES, [*flags(tier), *extra_flags], HEADERS)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("C CPU kernels at tier %s: %s", tier.name, e)
        return None
    kernels = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype, fn.argtypes = restype, argtypes
            kernels[name, dtype] = fn
    for name, (restype, argtypes) in _BF16_ONLY.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
        kernels[name, torch.bfloat16] = fn
    return kernels


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can take x's device and dtype (building them on the first call);
    then `functions` holds them."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _load()


def amx_ready() -> bool:
    """Whether the bfloat16 linear runs on AMX tiles here: the library was built for the amx
    tier, and the OS lets this process use the tiles (_load checked)."""
    return _load() and _built[0].name == "amx"


def kernel(name: str, dtype: torch.dtype = torch.bfloat16):
    """The C function `name` for `dtype`, for callers that have not asked `usable`
    (linear.py, decode_layer.py, bench_attention.py). RuntimeError where the kernels cannot be
    built."""
    if not _load():
        raise RuntimeError(f"{name}: the C CPU kernels could not be built (no C compiler?)")
    return functions[name, dtype]
