"""Wrappers of the C kernels in cpu_kernels.c, linear_bf16.c, amx_linear.c and decode_layer.c
(one library, built on first use for the CPU's tier (kernels/cpu/isa.py), loaded with ctypes):
each checks dtype, shape and strides, then passes addresses. The layers call them for CPU
tensors of float32 or bfloat16 when `usable(x)`; elsewhere (another device, no C compiler) the
layers keep their torch code, which is also the reference the kernel tests compare against."""

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
BASE_FLAGS = ["-O3", "-std=gnu11", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off"]
SOURCES = [_HERE / f for f in ("cpu_kernels.c", "linear_bf16.c", "amx_linear.c", "decode_layer.c")]
HEADERS = [_HERE / f for f in ("cpu_kernels.h", "cpu_kernels_impl.h", "attention_vec_impl.h")]
AMX_MAX_ROWS = 256  # measured: above this oneDNN's large-M kernel is the faster one
VEC_MAX_ROWS = 64  # likewise, for linear_bf16.c's vector kernels
LANES = 16  # cpu_kernels.c: head sizes must be a multiple of this
MAX_GROUP = 64  # cpu_kernels.c: query heads per KV head, at most
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "tk_rms_norm": (None, [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int]),
    "tk_rope": (None, [_ptr, _i64, _ptr, _i64, *[_i64] * 4, _ptr, _ptr, _ptr, _ptr, _ptr, _int]),
    "tk_silu_mul": (None, [_ptr, _ptr, _i64, _i64, _int]),
    "tk_argmax": (None, [_ptr, _i64, _i64, _i64, _ptr, _int]),
    "tk_paged_attention": (
        _int,
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr]
        + [*[_i64] * 6, _f32, _ptr, _int],
    ),
}
_BF16_ONLY = {  # linear_bf16.c, decode_layer.c
    "tk_amx_ready": (_int, []),
    "tk_linear_bf16": (_int, [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _int]),
    "tk_decode_layers_bf16": (
        _int,
        [_ptr, _i64, _ptr, _ptr, _int, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64]
        + [_ptr, _i64, _i64, _int],
    ),
}
LINEAR_K_ALIGN = 32  # linear_bf16.c: input features, a multiple of this
AMX_N_ALIGN = 16  # amx_linear.c: output features, a multiple of this
_lock = threading.Lock()
_kernels: dict = {}  # (name, dtype) -> the ctypes function, once built and loaded
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
            _kernels.update(kernels if tier is not None else {})
            _built.append(tier)
        return _built[0] is not None


def built_tier() -> isa.Tier | None:
    """The tier the loaded kernels were built for (None: no C kernels)."""
    _load()
    return _built[0]


def load_kernels(tier: isa.Tier) -> dict | None:
    """{(name, dtype): ctypes function} of the library built for this tier; None if it cannot
    be built."""
    try:
        path = build_library("tison_cpu_kernels", SOURCES, flags(tier), HEADERS)
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
    """Whether the kernels can take x's device and dtype (building them on the first call)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _load()


def amx_ready() -> bool:
    """Whether the bfloat16 linear runs on AMX tiles here: the library was built for the amx
    tier, and the OS lets this process use the tiles (_load checked)."""
    return _load() and _built[0].name == "amx"


def linear_max_rows() -> int:
    """Rows of x up to which linear_bf16 beats F.linear (measured: AMX_MAX_ROWS on AMX tiles,
    VEC_MAX_ROWS on the vector units)."""
    return AMX_MAX_ROWS if amx_ready() else VEC_MAX_ROWS


def kernel(name: str, dtype: torch.dtype = torch.bfloat16):
    """The C function `name` for `dtype`, for callers that pass their own addresses
    (decode_layer.py, bench_attention.py). RuntimeError where the kernels cannot be built."""
    if not _load():
        raise RuntimeError(f"{name}: the C CPU kernels could not be built (no C compiler?)")
    return _kernels[name, dtype]


def linear_fits(weight: torch.Tensor) -> bool:
    """Whether linear_bf16 takes this (out, in) weight: bf16, contiguous, sizes aligned."""
    out_features, in_features = weight.shape
    return (
        weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and in_features % LINEAR_K_ALIGN == 0
        and (not amx_ready() or out_features % AMX_N_ALIGN == 0)
    )


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) bf16, rows possibly strided; weight (out, in) with linear_fits(weight); bias
    (out,) or None -> (M, out) = x weight^T + bias, summed in float32, on AMX tiles where
    amx_ready(), else on the vector units."""
    M, K = x.shape
    N = weight.shape[0]
    _check("linear x", x, torch.bfloat16, M, K)
    if weight.shape[1] != K:
        raise ValueError(f"linear: x has {K} features, the weight takes {weight.shape[1]}")
    if bias is not None:
        _check("linear bias", bias, torch.bfloat16, N)
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if M == 0:
        return y
    status = kernel("tk_linear_bf16")(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        M, N, K, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("linear: no memory for the scratch of its input")
    return y


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


def rope(q: torch.Tensor, k: torch.Tensor, positions, cos, sin):
    """q (n, nh, hd) and k (n, nkv, hd), rows possibly strided -> rotated copies, contiguous;
    cos/sin (max_positions, hd) tables, contiguous, read at positions (n,) int64."""
    n, nh, hd = q.shape
    nkv = k.shape[1]
    _check("rope k", k, q.dtype, n, nkv, hd)
    _check("rope positions", positions, torch.int64, n)
    _check("rope cos", cos, q.dtype, cos.shape[0], hd)
    _check("rope sin", sin, q.dtype, *cos.shape)
    if not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("rope: cos, sin and positions must be contiguous")
    q_out, k_out = torch.empty((n, nh, hd), dtype=q.dtype), torch.empty((n, nkv, hd), dtype=q.dtype)
    _kernels["tk_rope", q.dtype](
        q.data_ptr(), _rows_of("rope q", q), k.data_ptr(), _rows_of("rope k", k), n, nh, nkv, hd,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return q_out, k_out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """(n, 2 * d) gate|up, contiguous -> (n, d) silu(gate) * up."""
    n, d = x.shape[0], x.shape[1] // 2
    _check("silu_mul x", x, x.dtype, n, 2 * d)
    if not x.is_contiguous():
        raise ValueError("silu_mul: x must be contiguous")
    out = torch.empty((n, d), dtype=x.dtype)
    _kernels["tk_silu_mul", x.dtype](x.data_ptr(), out.data_ptr(), n, d, torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """(n, d) rows (strided rows allowed) -> (n,) int64 index of each row's first maximum,
    NaN counting as the largest value (as x.max(dim=-1).indices). d must be at least 1."""
    n, d = x.shape
    _check("argmax x", x, x.dtype, n, d)
    if d == 0:
        raise ValueError("argmax: rows are empty")
    out = torch.empty(n, dtype=torch.int64)
    _kernels["tk_argmax", x.dtype](
        x.data_ptr(), x.stride(0), n, d, out.data_ptr(), torch.get_num_threads()
    )
    return out


def attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return head_dim % LANES == 0 and num_heads // num_kv_heads <= MAX_GROUP


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_table: torch.Tensor | None = None,
    context_lens: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """Writes the new tokens' k, v (T, nkv, hd) into their slots (T,) int64 of kv_layer
    (2, P, S, nkv, hd), then runs decode attention for the decode rows of q (T, nh, hd) (rows
    may be strided), reading keys and values in place from the pages, into those rows of out
    (T, nh, hd), contiguous. The decode rows: block_table (B, Pmax) int32 of their pages,
    context_lens (B,) int32, rows (B,) int64 or None (rows 0..B-1), sliding window or None.
    No block_table: no row decodes."""
    T, nh, hd = q.shape
    _, num_pages, page_size, nkv, _ = kv_layer.shape
    if not attention_supported(nh, nkv, hd):
        raise ValueError(f"paged_attention: head size {hd} or {nh}/{nkv} heads unsupported")
    _check("paged_attention k", k, q.dtype, T, nkv, hd)
    _check("paged_attention v", v, q.dtype, T, nkv, hd)
    _check("paged_attention slots", slots, torch.int64, T)
    _check("paged_attention pool", kv_layer, q.dtype, 2, num_pages, page_size, nkv, hd)
    _check("paged_attention out", out, q.dtype, T, nh, hd)
    if not (kv_layer.is_contiguous() and out.is_contiguous() and slots.is_contiguous()):
        raise ValueError("paged_attention: the pool, out and slots must be contiguous")
    B, table, lens = 0, block_table, context_lens
    if table is not None:
        B = table.shape[0]
        _check("paged_attention block_table", table, torch.int32, *table.shape)
        _check("paged_attention context_lens", lens, torch.int32, B)
        if rows is not None:
            _check("paged_attention rows", rows, torch.int64, B)
        elif B != T:
            raise ValueError(f"paged_attention: {B} rows decode but q has {T}")
        if not (table.is_contiguous() and lens.is_contiguous()):
            raise ValueError("paged_attention: block table and context lengths: contiguous")
    status = _kernels["tk_paged_attention", q.dtype](
        k.data_ptr(), _rows_of("paged_attention k", k), v.data_ptr(),
        _rows_of("paged_attention v", v), slots.data_ptr(), T,
        q.data_ptr(), _rows_of("paged_attention q", q), None if rows is None else rows.data_ptr(),
        kv_layer[0].data_ptr(), kv_layer[1].data_ptr(),
        None if table is None else table.data_ptr(), 0 if table is None else table.stride(0),
        None if lens is None else lens.data_ptr(), B, nh, nkv, hd, page_size, window or 0, scale,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("paged_attention: no memory for the attention scores")
