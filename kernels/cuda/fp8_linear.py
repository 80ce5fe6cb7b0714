"""FP8 block-scaled weights on a GPU (fp8_linear.cu): a weight W (N, K) of float8 e4m3fn bytes
(a uint8 tensor) with float32 scales (ceil(N / bn), ceil(K / bk)), one per block of bn x bk
(DeepSeek-V3's `weight_scale_inv`, 128 x 128): W's values are float(byte) * scale of its
block, one float32 multiply (shared/models/quant/fp8.py's dequantize).

- fp8_linear: y (M, N) = x (M, K) W^T (+ bias) for decode-sized x (M <= MAX_ROWS), reading
  each weight byte once; float32 accumulation, y rounded to x's dtype once;
- fp8_dequantize: W as a dense (N, K) float32 or bfloat16 tensor (prefill's temporary).

Numerics: every byte decodes exactly (subnormals, NaN), each weight is the float32 of the
reference dequantization; only the order of fp8_linear's float32 sum differs from a matmul's
(float32: within ~K * 2^-24 of the sum of |w x|; bfloat16 y: within one rounding of the
float32 result). The torch references below define the results; the wrappers check dtype,
shape, device and layout and raise ValueError naming the argument."""

import numpy as np
import torch

from kernels.cuda import runtime

SOURCE = "fp8_linear.cu"
DTYPES = (torch.float32, torch.bfloat16)
MAX_ROWS = 64  # x rows fp8_linear takes at most (its register tiles: MT below)
TILES = (1, 2, 4, 8, 16, 32, 64)  # kernels by x rows they hold (MT): the smallest >= M runs
THREADS = 128  # a linear block: 4 warps (fp8_linear.cu's TISON_FP8_WARPS)
DEQUANT_THREADS = 256
MAX_DEQUANT_BLOCKS = 65536  # beyond, the grid-stride loop gives each thread more chunks
CHUNK = 16  # bytes a lane loads at once on the vector path


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x (M, K) float32 or bfloat16, its rows possibly strided, M <= MAX_ROWS; weight (N, K)
    uint8 (float8_e4m3fn bits), contiguous; scale_inv float32 (ceil(N / bn), ceil(K / bk)),
    contiguous, block = (bn, bk); bias (N,) of x's dtype -> y (M, N) of x's dtype."""
    runtime.check(x, "fp8_linear x", DTYPES, 2, dense_from=1)
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"fp8_linear x: {M} rows, at most {MAX_ROWS} (dequantize for more)")
    N = _check_weight(weight, scale_inv, block, x.device, "fp8_linear", K)
    if bias is not None:
        runtime.check(bias, "fp8_linear bias", (x.dtype,), 1, x.device)
        if bias.shape[0] != N:
            raise ValueError(f"fp8_linear bias: shape {tuple(bias.shape)}, expected ({N},)")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    tile = next(t for t in TILES if t >= M)
    rows_per_block = THREADS // 32 * (4 if tile <= 2 else 2 if tile <= 8 else 1)  # warps x R
    vec = _vectorized(K, block[1], weight) and x.data_ptr() % 16 == 0
    vec = vec and (M == 1 or x.stride(0) * x.element_size() % 16 == 0)
    launch = runtime.function(SOURCE, f"tison_fp8_linear_m{tile}_{runtime.suffix(x.dtype)}")
    args = (x, np.int64(x.stride(0)), weight, scale_inv, y if bias is None else bias)
    args += (np.int32(bias is not None), y, np.int32(M), np.int32(N), np.int32(K))
    args += (np.int32(block[0]), np.int32(block[1]), np.int32(vec))
    launch((runtime.blocks(N, rows_per_block),), (THREADS,), args)
    return y


def fp8_dequantize(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """weight (N, K) uint8 with scale_inv as fp8_linear's -> (N, K) float32 or bfloat16 on
    weight's device: the float32 values rounded to dtype once."""
    if dtype not in DTYPES:
        raise ValueError(f"fp8_dequantize dtype: {dtype}, expected one of {list(DTYPES)}")
    K = weight.shape[1] if weight.dim() == 2 else 0
    N = _check_weight(weight, scale_inv, block, weight.device, "fp8_dequantize", K)
    out = torch.empty(N, K, dtype=dtype, device=weight.device)
    vec = _vectorized(K, block[1], weight)
    if out.numel():
        per = CHUNK if vec else 1
        grid = min(MAX_DEQUANT_BLOCKS, runtime.blocks(N * K // per, DEQUANT_THREADS))
        launch = runtime.function(SOURCE, f"tison_fp8_dequant_{runtime.suffix(dtype)}")
        args = (weight, scale_inv, out, np.int32(N), np.int32(K), np.int32(block[0]))
        launch((grid,), (DEQUANT_THREADS,), (*args, np.int32(block[1]), np.int32(vec)))
    return out


def reference_dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """The float32 (N, K) values of weight: torch's float8_e4m3fn conversion times each
    block's scale."""
    N, K = weight.shape
    bn, bk = block
    scale = scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:N, :K]  # (N, K)
    return weight.view(torch.float8_e4m3fn).float() * scale


def reference_fp8_linear(x, weight, scale_inv, block=(128, 128), bias=None) -> torch.Tensor:
    """What fp8_linear computes, in torch: a float32 matmul over the dequantized weight."""
    w = reference_dequantize(weight, scale_inv, block)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def _check_weight(weight, scale_inv, block, device, what: str, K: int) -> int:
    """Checks weight (N, K), scale_inv and block (bn, bk) for `what`; returns N."""
    if not (
        isinstance(block, tuple | list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{what} block: {block!r}, expected (rows, cols) of positive ints")
    runtime.check(weight, f"{what} weight", (torch.uint8,), 2, device)
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"{what} weight: shape {tuple(weight.shape)}, expected (N, {K})")
    runtime.check(scale_inv, f"{what} scale_inv", (torch.float32,), 2, device)
    blocks = (-(-N // block[0]), -(-K // block[1]))
    if tuple(scale_inv.shape) != blocks:
        raise ValueError(
            f"{what} scale_inv: shape {tuple(scale_inv.shape)}, expected {blocks} "
            f"(blocks of {block[0]}x{block[1]} over ({N}, {K}))"
        )
    return N


def _vectorized(K: int, bk: int, weight: torch.Tensor) -> bool:
    """Whether rows are read in 16-byte chunks: whole chunks a row and a scale block, and the
    weight 16-byte aligned."""
    return K % CHUNK == 0 and bk % CHUNK == 0 and weight.data_ptr() % CHUNK == 0
