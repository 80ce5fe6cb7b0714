"""Wrappers of the C kernels in cpu_kernels.c (built on first use, loaded with ctypes): each
checks dtype, shape and strides, then passes addresses. The layers call them for CPU tensors
of float32 or bfloat16 when `usable(x)`; elsewhere (another device, no C compiler) the layers
keep their torch code, which is also the reference the kernel tests compare against."""

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from shared.native_build import build_library

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
PORTABLE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
# this CPU's vector units (AVX-512 where there is one); the portable build where not accepted
NATIVE_FLAGS = [*PORTABLE_FLAGS, "-march=native", "-mprefer-vector-width=512"]
LANES = 16  # cpu_kernels.c: head sizes must be a multiple of this
MAX_GROUP = 64  # cpu_kernels.c: query heads per KV head, at most
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "tk_rms_norm": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int]),
    "tk_rope": (None, [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int]),
    "tk_store_kv": (None, [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr]),
    "tk_silu_mul": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "tk_decode_attention": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64]
        + [_f32, _ptr, _int],
    ),
}
_lock = threading.Lock()
_kernels: dict = {}  # (name, dtype) -> the ctypes function, once built and loaded
_built: list[bool] = []  # [whether the library loaded], once it was tried


def _load() -> bool:
    with _lock:
        if not _built:
            kernels = load_kernels(NATIVE_FLAGS) or load_kernels(PORTABLE_FLAGS)
            if kernels is None:
                log.warning("no C CPU kernels (no working C compiler): the layers use torch ops")
            _kernels.update(kernels or {})
            _built.append(kernels is not None)
        return _built[0]


def load_kernels(flags: list[str]) -> dict | None:
    """{(name, dtype): ctypes function} of the library built with these flags; None if it
    cannot be built."""
    try:
        sources, headers = [_HERE / "cpu_kernels.c"], [_HERE / "cpu_kernels_impl.h"]
        lib = ctypes.CDLL(str(build_library("tison_cpu_kernels", sources, flags, headers)))
    except (OSError, subprocess.SubprocessError) as e:
        log.info("C CPU kernels with %s: %s", " ".join(flags), e)
        return None
    kernels = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.restype, fn.argtypes = restype, argtypes
            kernels[name, dtype] = fn
    return kernels


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels can take x's device and dtype (building them on the first call)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and (_built[0] if _built else _load())


def _check(name: str, x: torch.Tensor, dtype: torch.dtype, *shape: int) -> None:
    if x.dtype != dtype or x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {x.dtype} on {x.device}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if x.dim() and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def _rows_of(name: str, x: torch.Tensor) -> int:
    """Row stride of x (n, ...): all but the first dimension must be packed densely."""
    inner = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size > 1 and stride != inner:
            raise ValueError(f"{name}: only the first dimension may be strided")
        inner *= size
    return x.stride(0)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x (n, [heads,] dim) -> normalised (n, [heads,] dim) times weight (dim,). With residual
    (n, dim): residual += x first (in place) and the sum is normalised."""
    dim, n = x.shape[-1], x.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    _check("rms_norm weight", weight, x.dtype, dim)
    if residual is not None:
        _check("rms_norm residual", residual, x.dtype, n, dim)
        if not residual.is_contiguous() or heads != 1:
            raise ValueError("rms_norm: the residual must be contiguous (n, dim)")
    out = torch.empty(x.shape, dtype=x.dtype)
    _kernels["tk_rms_norm", x.dtype](
        x.data_ptr(), _rows_of("rms_norm x", x), out.data_ptr(), heads * dim,
        None if residual is None else residual.data_ptr(), weight.data_ptr(),
        n, heads, dim, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x (n, heads, hd), rows possibly strided -> rotated (n, heads, hd), contiguous; cos/sin
    (max_positions, hd) tables read at positions (n,) int64."""
    n, heads, hd = x.shape
    _check("rope positions", positions, torch.int64, n)
    _check("rope cos", cos, x.dtype, cos.shape[0], hd)
    _check("rope sin", sin, x.dtype, *cos.shape)
    if not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("rope: cos, sin and positions must be contiguous")
    out = torch.empty((n, heads, hd), dtype=x.dtype)
    _kernels["tk_rope", x.dtype](
        x.data_ptr(), _rows_of("rope x", x), n, heads, hd, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slots: torch.Tensor):
    """k, v (n, nkv, hd), rows possibly strided -> slots (n,) int64 of kv_layer
    (2, P, S, nkv, hd), contiguous."""
    n, nkv, hd = k.shape
    _check("store_kv v", v, k.dtype, n, nkv, hd)
    _check("store_kv slots", slots, torch.int64, n)
    _check("store_kv pool", kv_layer, k.dtype, 2, *kv_layer.shape[1:3], nkv, hd)
    if not (kv_layer.is_contiguous() and slots.is_contiguous()):
        raise ValueError("store_kv: the pool and the slots must be contiguous")
    _kernels["tk_store_kv", k.dtype](
        k.data_ptr(), _rows_of("store_kv k", k), v.data_ptr(), _rows_of("store_kv v", v),
        n, nkv * hd, slots.data_ptr(), kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
    )  # fmt: skip


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """(n, 2 * d) gate|up, contiguous -> (n, d) silu(gate) * up."""
    n, d = x.shape[0], x.shape[1] // 2
    _check("silu_mul x", x, x.dtype, n, 2 * d)
    if not x.is_contiguous():
        raise ValueError("silu_mul: x must be contiguous")
    out = torch.empty((n, d), dtype=x.dtype)
    _kernels["tk_silu_mul", x.dtype](x.data_ptr(), out.data_ptr(), n, d, torch.get_num_threads())
    return out


def attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim % LANES == 0 and num_heads // num_kv_heads <= MAX_GROUP


def decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    rows: torch.Tensor | None,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """One query token per row, keys and values read in place from the pages.
    q (T, nh, hd), rows possibly strided; kv_layer (2, P, S, nkv, hd), contiguous;
    block_table (B, Pmax) int32; context_lens (B,) int32; rows (B,) int64: the rows of q and
    out that decode (None: rows 0..B-1); out (T, nh, hd), contiguous, written at those rows."""
    T, nh, hd = q.shape
    _, num_pages, page_size, nkv, _ = kv_layer.shape
    B = block_table.shape[0]
    if not attention_supported(nh, nkv, hd):
        raise ValueError(f"decode_attention: head size {hd} or {nh}/{nkv} heads unsupported")
    _check("decode_attention pool", kv_layer, q.dtype, 2, num_pages, page_size, nkv, hd)
    _check("decode_attention out", out, q.dtype, T, nh, hd)
    _check("decode_attention block_table", block_table, torch.int32, *block_table.shape)
    _check("decode_attention context_lens", context_lens, torch.int32, B)
    if rows is not None:
        _check("decode_attention rows", rows, torch.int64, B)
    elif B > T:
        raise ValueError(f"decode_attention: {B} rows decode but q has {T}")
    if not all(t.is_contiguous() for t in (kv_layer, out, block_table, context_lens)):
        raise ValueError("decode_attention: pool, out, block table and lengths: contiguous")
    status = _kernels["tk_decode_attention", q.dtype](
        q.data_ptr(), _rows_of("decode_attention q", q), None if rows is None else rows.data_ptr(),
        kv_layer[0].data_ptr(), kv_layer[1].data_ptr(), block_table.data_ptr(),
        block_table.stride(0), context_lens.data_ptr(), B, nh, nkv, hd, page_size,
        window or 0, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("decode_attention: no memory for the attention scores")
