"""The all-reduce of a tensor-parallel group's same-host ranks through shared memory
(all_reduce.c), for shared/parallel/shm_group.py's op-by-op collectives and the fused decoder
(decode_layer.py), which run the same C code and so give the same bits."""

import ctypes

import torch

from kernels.cpu import library


class ShmReduce(ctypes.Structure):
    """kernels.h's `shm_reduce`: a group's mapping (step counters and flags, pids, two sets of
    slots), this rank, its last published step (whose owner this is), the failed step's status
    (`error`), and the sync library's post and wait functions."""

    _fields_ = [
        ("lines", ctypes.c_void_p),
        ("pids", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("line", ctypes.c_int64),
        ("slot_bytes", ctypes.c_int64),
        ("rank", ctypes.c_int64),
        ("size", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("error", ctypes.c_int64),
        ("timeout_s", ctypes.c_double),
        ("post", ctypes.c_void_p),
        ("wait", ctypes.c_void_p),
    ]


def takes(x: torch.Tensor, slot_bytes: int) -> bool:
    """Whether all_reduce takes x: a contiguous CPU float32 or bfloat16 tensor that fits a
    slot, where the C kernels run."""
    return (
        x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and x.numel() * x.element_size() <= slot_bytes
        and library.usable(x)
    )


def all_reduce(group: ShmReduce, x: torch.Tensor) -> None:
    """x (as `takes` says) summed over the group's ranks in place, in float32 in rank order,
    rounded once. RuntimeError naming the step where a peer is gone or late."""
    fn = library.kernel("tk_all_reduce", x.dtype)
    if fn(ctypes.byref(group), x.data_ptr(), x.numel(), torch.get_num_threads()) != 0:
        raise RuntimeError(failure(group))


def failure(group: ShmReduce) -> str:
    """What its failed step's status (`error`) says."""
    status, size = group.error, group.size
    if status == -2 - size:
        why = "a peer's part went to the process group (the ranks disagree on the step)"
    elif status == -1 - size:
        why = "timed out"
    else:
        why = f"rank {-1 - status}'s process is gone"
    return f"shared-memory collective, step {group.step}: {why}"
