"""The bfloat16 linear for decode-sized inputs (linear_bf16.c; amx_linear.c on the amx tier):
y = x w^T + bias on the plain row-major weight, summed in float32."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check

AMX_MAX_ROWS = 256  # measured: above this oneDNN's large-M kernel is the faster one
VEC_MAX_ROWS = 64  # likewise, for linear_bf16.c's dot-product vector kernels
# avx2's outer products, against F.linear on the weight widened to float32 for the call (the
# avx2 tier has no oneDNN bf16): 1.1-1.5x faster up to 512 rows, even at 1024 (Zen 3)
OUTER_MAX_ROWS = 512
LINEAR_K_ALIGN = 32  # linear_bf16.c: input features, a multiple of this


_MAX_ROWS = {"amx": AMX_MAX_ROWS, "avx2": OUTER_MAX_ROWS}  # by the tier the library was built for


def linear_max_rows() -> int:
    """Rows of x up to which linear_bf16 beats F.linear (measured: AMX_MAX_ROWS on AMX tiles,
    OUTER_MAX_ROWS on avx2, VEC_MAX_ROWS on the other vector units). One lookup: every linear
    of a step asks."""
    tier = library.built_tier()
    return VEC_MAX_ROWS if tier is None else _MAX_ROWS.get(tier.name, VEC_MAX_ROWS)


def linear_fits(weight: torch.Tensor) -> bool:
    """Whether linear_bf16 takes this (out, in) weight: bf16, contiguous, its input features
    aligned (any number of outputs: the AMX kernel leaves the last out % 16 to the vector
    units)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and weight.shape[1] % LINEAR_K_ALIGN == 0
    )


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) bf16, rows possibly strided; weight (out, in) with linear_fits(weight); bias
    (out,) or None -> (M, out) = x weight^T + bias, summed in float32, on AMX tiles where
    library.amx_ready(), else on the vector units."""
    M, K = x.shape
    N = weight.shape[0]
    check("linear x", x, torch.bfloat16, M, K)
    if weight.shape[1] != K:
        raise ValueError(f"linear: x has {K} features, the weight takes {weight.shape[1]}")
    if not linear_fits(weight):
        raise ValueError(
            f"linear weight: {weight.dtype} {tuple(weight.shape)}, contiguous "
            f"{weight.is_contiguous()}; takes bf16, contiguous, in_features % {LINEAR_K_ALIGN} == 0"
        )
    if bias is not None:
        check("linear bias", bias, torch.bfloat16, N)
    y = torch.empty((M, N), dtype=torch.bfloat16)
    if M == 0:
        return y
    status = library.kernel("tk_linear_bf16")(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
        M, N, K, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("linear: no memory for the scratch of its input")
    return y
