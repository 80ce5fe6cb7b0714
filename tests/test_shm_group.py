"""Shared-memory collectives of same-host CPU ranks (shared/parallel/shm_group.py) on 2 and 3
real processes: every collective equals gloo's on the same inputs, through the slots and, for
parts too large for them, through the fallback that every rank takes together; a peer whose
process is gone fails the waiting rank with a clear error; TISON_CPU_COLLECTIVES=gloo turns
them off. The engines' parallel tests (test_parallel.py, test_moe_models.py) run through them
too, and once with gloo alone."""

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shared.parallel import shm_group
from shared.parallel.group import TPGroup, process_group

from services_harness import free_port
from spawning import spawn


def inputs(rank: int, size: int, rows: int):
    """This rank's tensors, integer-valued (sums exact in any order)."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-8, 8, (rows, 6), generator=g).float()
    send = [(rank + d) % 3 for d in range(size)]  # rows for rank d, some none
    return x, send


def collectives(group: TPGroup, rank: int, size: int, rows: int) -> dict:
    x, send = inputs(rank, size, rows)
    recv = [inputs(s, size, rows)[1][rank] for s in range(size)]
    counts = torch.tensor(send)
    out = {
        "all_reduce_f32": group.all_reduce(x.clone()),
        "all_reduce_bf16": group.all_reduce(x.to(torch.bfloat16)).float(),
        "all_gather_last_dim": group.all_gather_last_dim(x),
        "all_gather_rows": group.all_gather_rows(x[: rank + 1], [s + 1 for s in range(size)]),
        "counts": group.all_to_all(counts, [1] * size, [1] * size),
        "all_to_all": group.all_to_all(x[: sum(send)], send, recv),
    }
    return {k: v.tolist() for k, v in out.items()}


def _rank(rank: int, size: int, port: int, slot_bytes: int, out_dir) -> None:
    fits = slot_bytes == shm_group.SLOT_BYTES  # then no process group to fall back on
    shm_group.SLOT_BYTES = slot_bytes
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=30))
    pg = process_group(store, rank, size, "cpu", timedelta(seconds=30))
    shm = shm_group.open_group(store, "coll", rank, size)
    assert shm is not None
    results = {}
    shm_only = TPGroup(rank, size, None if fits else pg, shm=shm)
    for name, group in (("gloo", TPGroup(rank, size, pg)), ("shm", shm_only)):
        # twice: the second pass reuses both sets of slots
        results[name] = [collectives(group, rank, size, rows) for rows in (5, 5)]
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(
    "slot_bytes", [shm_group.SLOT_BYTES, 64], ids=["in slots", "too large: gloo"]
)
def test_every_collective_equals_gloo_s(tmp_path, size, slot_bytes):
    spawn(_rank, args=(size, free_port(), slot_bytes, tmp_path), nprocs=size)
    for rank in range(size):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results["shm"] == results["gloo"]
        x, _ = inputs(rank, size, 5)
        assert (
            results["shm"][0]["all_reduce_f32"]
            == sum(inputs(r, size, 5)[0] for r in range(size)).tolist()
        )


def _gone(rank: int, port: int, collective: str, out_dir) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    shm = shm_group.open_group(store, "coll", rank, 2)
    if rank == 1:
        return  # exits: rank 0 waits for it in vain
    try:
        getattr(shm, collective)(torch.ones(4))
    except RuntimeError as e:
        (out_dir / "error").write_text(str(e))


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather_last_dim"])  # C, Python
def test_a_peer_that_is_gone_fails_the_waiting_rank(tmp_path, collective):
    spawn(_gone, args=(free_port(), collective, tmp_path), nprocs=2)
    assert "step 1: rank 1's process is gone" in (tmp_path / "error").read_text()


def test_gloo_alone_where_asked(monkeypatch):
    monkeypatch.setenv(shm_group.ENV_VAR, "gloo")
    store = dist.HashStore()
    assert shm_group.open_group(store, "coll", 0, 2) is None
    assert store.get("coll/shm") == b""  # the other ranks read that and use gloo too


def test_no_room_in_dev_shm_leaves_the_ranks_on_gloo(monkeypatch):
    """The mapping's memory is taken when it is made: a full /dev/shm (a container's 64 MiB)
    is found then, and every rank uses gloo, instead of a fault mid-step."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_group.os, "posix_fallocate", full)
    store = dist.HashStore()
    assert shm_group.open_group(store, "coll", 0, 2) is None
    assert store.get("coll/shm") == b""
