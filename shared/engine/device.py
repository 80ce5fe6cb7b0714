"""Where a rank's tensors live (EngineConfig.device): the CPU, or one GPU per rank.

`auto` is CUDA when torch sees a GPU, else the CPU. With `cuda`, rank r of a worker takes the
r-th visible GPU (CUDA_VISIBLE_DEVICES chooses which those are, as with vLLM), so a T x P
worker needs T x P of them; with `cuda:N` rank r takes GPU N + r (`tison up` gives each worker
its own GPUs so: every worker sees all of them, as CUDA IPC between workers needs). A GPU's
memory is planned as vLLM plans it: `gpu_memory_utilization` of each GPU is the rank's budget
for its weights, the reserve (activations, workspaces) and its part of the KV pool
(shared/engine/footprint.py sizes the pool from what is left)."""

import logging

import torch

from shared.errors import InvalidRequestError

log = logging.getLogger(__name__)
KINDS = ("auto", "cpu", "cuda")  # EngineConfig.device, or cuda:N


def resolve(device: str) -> str:
    """The device a config names, `auto` decided; InvalidRequestError naming `device` when it
    is unknown or its GPU is not there."""
    kind, _, index = device.partition(":")
    if kind not in KINDS or (index and (kind != "cuda" or not index.isdigit())):
        raise InvalidRequestError("device", f"must be one of {', '.join(KINDS)} or cuda:N")
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidRequestError(
                "device", "cuda: torch sees no GPU (a CPU build of torch, or no driver)"
            )
        if index and int(index) >= count:
            raise InvalidRequestError("device", f"{device}: torch sees {count} GPU(s)")
    return device


def rank_device(device: str, rank: int, world_size: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or GPU first + rank (cuda:first; cuda: first 0)."""
    if device == "cpu":
        return torch.device("cpu")
    first = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if first + world_size > count:
        raise InvalidRequestError(
            "device",
            f"{device}: {world_size} rank(s) need a GPU each from GPU {first} on; torch sees "
            f"{count}",
        )
    return torch.device("cuda", first + rank)


def use(device: torch.device) -> None:
    """Makes a GPU this process's current one (NCCL, cupy and torch's default follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def memory_budget(device: torch.device, utilization: float) -> int:
    """Bytes a rank may hold on its GPU: `utilization` of the GPU's memory, but never more than
    is free now beside what this process holds (other processes keep theirs)."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    budget = min(int(total * utilization), free + held)
    log.info(
        "%s: %.1f GiB total, %.1f GiB free; budget %.1f GiB (gpu_memory_utilization %.2f)",
        device, total / 2**30, free / 2**30, budget / 2**30, utilization,
    )  # fmt: skip
    return budget
