"""Step plans through shared memory (shared/parallel/plan_channel.py) between real processes:
every plan arrives once, in order, byte for byte, through the ring (wrapping it while the
reader lags, so rank 0 waits for room) and, for plans larger than a slot, over gloo in the
same order; a reader that is gone fails rank 0's send with a clear error instead of a hang;
TISON_CPU_COLLECTIVES=gloo sends every plan over gloo."""

import json
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.parallel import plan_channel
from shared.parallel.comm import RankComm
from shared.parallel.shape import ParallelConfig

from services_harness import free_port

SLOT = 4096  # the tests' slots: small, so that some plans go over gloo
SIZES = [10, SLOT - 8, SLOT - 7, 1, 3 * SLOT] + [100 + i for i in range(3 * plan_channel.SLOTS)]


def plan(i: int, size: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def _rank(rank: int, size: int, port: int, out_dir, gloo: bool) -> None:
    if gloo:
        os.environ["TISON_CPU_COLLECTIVES"] = "gloo"
    plan_channel.SLOT_BYTES = SLOT
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
    comm = RankComm(store, rank, ParallelConfig(tp=size, allow_oversubscribe=True))
    assert (comm.plans is None) == gloo
    if rank == 0:
        for i, n in enumerate(SIZES):
            comm.send_plan(plan(i, n))
        comm.flush()
        return
    time.sleep(0.5)  # rank 0 fills the ring and waits for room
    got = [comm.recv_plan() == plan(i, n) for i, n in enumerate(SIZES)]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.parametrize("size,gloo", [(2, False), (3, False), (2, True)])
def test_every_plan_arrives_once_in_order(tmp_path, size, gloo):
    mp.spawn(_rank, args=(size, free_port(), tmp_path, gloo), nprocs=size)
    for rank in range(1, size):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [True] * len(SIZES)


def _gone(rank: int, port: int, out_dir) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    comm = RankComm(store, rank, ParallelConfig(tp=2, allow_oversubscribe=True))
    if rank == 1:
        return  # exits: the ring fills up with no one reading
    try:
        for i in range(plan_channel.SLOTS + 1):
            comm.send_plan(plan(i, 10))
    except RuntimeError as e:
        (out_dir / "error").write_text(str(e))


def test_a_reader_that_is_gone_fails_the_send_once_the_ring_is_full(tmp_path):
    mp.spawn(_gone, args=(free_port(), tmp_path), nprocs=2)
    error = (tmp_path / "error").read_text()
    assert error == f"step plan {plan_channel.SLOTS + 1}: rank 1's process is gone"
