"""Test ranks as processes, as torch.multiprocessing.spawn starts them, but forked from one
server process that imported torch once (multiprocessing's forkserver) rather than each a
fresh interpreter importing it again: ~2 s a rank on a 2-core CI host."""

import multiprocessing

import torch.multiprocessing as mp

multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])


def spawn(fn, args: tuple, nprocs: int) -> None:
    """mp.spawn(fn, args=args, nprocs=nprocs): fn(rank, *args) in nprocs processes, joined;
    raises if one fails."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
