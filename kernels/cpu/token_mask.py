"""Grammar masks on logits (token_mask.c): the tokens a row's bitmask disallows set to -inf."""

import torch

from kernels.cpu import library
from kernels.cpu.checks import check


def token_mask_(x: torch.Tensor, row_ids: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets x[row_ids[r], t] = -inf, in place, for each token t < V whose bit (bit t % 32 of
    word t // 32) is clear in bitmask[r]: x (B, V) logits (strided rows allowed), row_ids (R,)
    int64, bitmask (R, W) int32 with W >= ceil(V / 32), bits past V ignored. After
    library.usable(x)."""
    rows, d = x.shape
    n = row_ids.shape[0]
    check("token_mask x", x, x.dtype, rows, d)
    check("token_mask row_ids", row_ids, torch.int64, n)
    if bitmask.dim() != 2:
        raise ValueError(f"token_mask bitmask: expected (R, W), got shape {tuple(bitmask.shape)}")
    check("token_mask bitmask", bitmask, torch.int32, n, bitmask.shape[1])
    if bitmask.shape[1] * 32 < d:
        raise ValueError(
            f"token_mask bitmask: {bitmask.shape[1]} words cover fewer than {d} tokens"
        )
    bad = library.functions["tk_token_mask", x.dtype](
        x.data_ptr(), x.stride(0), rows, row_ids.data_ptr(), bitmask.data_ptr(),
        bitmask.stride(0), n, d, torch.get_num_threads(),
    )  # fmt: skip
    if bad:
        raise ValueError(f"token_mask row_ids: not all in [0, {rows})")
