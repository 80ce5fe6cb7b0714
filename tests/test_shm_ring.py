"""Messages through shared-memory rings (shared/parallel/shm_ring.py) between real processes,
as RankComm sends them: step plans from rank 0 to 1 and 2 other ranks, hidden states from a
stage to the next and results back to rank 0. Every message arrives once, in order, byte for
byte, through the ring (wrapping it while the reader lags, so the writer waits for room) and,
for messages larger than a slot, over gloo in the same order; a reader that is gone fails
the writer with a clear error instead of a hang; TISON_CPU_COLLECTIVES=gloo sends everything
over gloo."""

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shared.parallel import comm as comm_module
from shared.parallel.comm import RankComm
from shared.parallel.shape import ParallelConfig

from services_harness import free_port
from spawning import spawn

SLOT = 4096  # the tests' slots: small, so that some messages go over gloo
SLOTS = 1 + comm_module.RING_SLOTS  # a ring's slots at P = 1
SIZES = [10, SLOT - 8, SLOT - 7, 1, 3 * SLOT] + [100 + i for i in range(3 * SLOTS)]


def message(i: int, size: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def hidden(i: int, rows: int) -> torch.Tensor:
    return torch.arange(2 * rows * 64, dtype=torch.float32).view(2, rows, 64).bfloat16() + i


def _rank(rank: int, size: int, port: int, out_dir, gloo: bool, pp: int) -> None:
    if gloo:
        os.environ["TISON_CPU_COLLECTIVES"] = "gloo"
    for name in ("PLAN_BYTES", "HIDDEN_BYTES", "RESULT_BYTES"):
        setattr(comm_module, name, SLOT)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
    shape = ParallelConfig(tp=size // pp, pp=pp, allow_oversubscribe=True)
    comm = RankComm(store, rank, shape)
    assert (comm._plans is None) == gloo
    rows = [1, 8, 15, 16, 40, 2, 3, 4, 5, 6, 7]  # (2, rows, 64) bf16: 256 bytes a row
    if rank == 0:
        for i, n in enumerate(SIZES):
            comm.send_plan(message(i, n))
        if pp > 1:
            for i, n in enumerate(rows):
                comm.send_hidden(hidden(i, n))
            got = [comm.recv_result() == message(i, n) for i, n in enumerate(SIZES)]
            (out_dir / "results.json").write_text(json.dumps(got))
        comm.flush()
        return
    time.sleep(0.5)  # the writer fills the ring and waits for room
    got = [comm.recv_plan() == message(i, n) for i, n in enumerate(SIZES)]
    if pp > 1:
        got += [
            torch.equal(comm.recv_hidden((2, n, 64), torch.bfloat16), hidden(i, n))
            for i, n in enumerate(rows)
        ]
        for i, n in enumerate(SIZES):
            comm.send_result(message(i, n))
        comm.flush()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(got))


@pytest.mark.parametrize(
    "size,gloo,pp", [(2, False, 1), (3, False, 1), (2, True, 1), (2, False, 2), (2, True, 2)]
)
def test_every_message_arrives_once_in_order(tmp_path, size, gloo, pp):
    spawn(_rank, args=(size, free_port(), tmp_path, gloo, pp), nprocs=size)
    for rank in range(1, size):
        assert set(json.loads((tmp_path / f"rank{rank}.json").read_text())) == {True}
    if pp > 1:
        assert json.loads((tmp_path / "results.json").read_text()) == [True] * len(SIZES)


def _gone(rank: int, port: int, out_dir) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    comm = RankComm(store, rank, ParallelConfig(tp=2, allow_oversubscribe=True))
    if rank == 1:
        return  # exits: the ring fills up with no one reading
    try:
        for i in range(SLOTS + 1):
            comm.send_plan(message(i, 10))
    except RuntimeError as e:
        (out_dir / "error").write_text(str(e))


def test_a_reader_that_is_gone_fails_the_writer_once_the_ring_is_full(tmp_path):
    spawn(_gone, args=(free_port(), tmp_path), nprocs=2)
    assert (tmp_path / "error").read_text() == f"step plan {SLOTS + 1}: rank 1's process is gone"
