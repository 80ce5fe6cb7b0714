"""The links of one rank of a worker: a world group for point-to-point messages (step plans,
hidden states, results), its stage's tensor-parallel group and, with --dp, the data-parallel
group of all ranks. Groups are ProcessGroup objects built over a loopback TCPStore, not the
process-global default group, so one process may hold several engines (tests) one after
another. Messages are msgpack bytes or tensors, never pickle. The TP and DP groups' backend
follows the device (group.process_group), and on CPUs their collectives go through shared
memory first (shm_group.py); the world group carries the msgpack plans, CPU bytes,
so it is gloo on every device; hidden states between stages go on a group of the device's
backend (NCCL between GPUs: they never visit host memory)."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.parallel.group import SINGLE, TPGroup, process_group
from shared.parallel.plan_channel import open_channel
from shared.parallel.shape import ParallelConfig
from shared.parallel.shm_group import ShmGroup, open_group

PLAN, HIDDEN, RESULT = 1, 2, 3  # message tags: rank 0 -> all, stage -> next stage, last -> 0
IDLE_TIMEOUT = timedelta(days=30)  # ranks wait for the next plan as long as the worker lives


def open_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """Rank 0 passes port 0 and reads `.port`; the others connect to it."""
    return dist.TCPStore(
        host, port, world_size, is_master, timeout=timedelta(seconds=120), wait_for_workers=False
    )


class RankComm:
    """One rank's groups. Sends are asynchronous: rank 0 never waits for a busy later stage."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        shape: ParallelConfig,
        device: torch.device | str = "cpu",  # this rank's: the TP and hidden groups follow it
    ):
        self.rank, self.shape = rank, shape
        self.device = torch.device(device)
        world = dist.PrefixStore("world", store)
        self.world = process_group(world, rank, shape.world_size, "cpu", IDLE_TIMEOUT)
        # rank 0's step plans to the others (plan_channel.py); None: over self.world
        self.plans = open_channel(store, rank, shape.world_size)
        self.hidden = self.world  # stage -> next stage: on the device's backend
        if self.device.type != "cpu" and shape.pp > 1:
            hidden = dist.PrefixStore("hidden", store)
            self.hidden = process_group(hidden, rank, shape.world_size, device, IDLE_TIMEOUT)
        stage, tp_rank = divmod(rank, shape.tp)
        group = shm = None
        if shape.tp > 1:
            tp_store = dist.PrefixStore(f"tp{stage}", store)
            group = process_group(tp_store, tp_rank, shape.tp, device, IDLE_TIMEOUT)
            shm = self._shm(tp_store, tp_rank, shape.tp)
        self.dp = SINGLE  # the data-parallel ranks (T = P = 1: every rank), with --dp
        if shape.dp > 1:
            dp_store = dist.PrefixStore("dp", store)
            dp_group = process_group(dp_store, rank, shape.dp, device, IDLE_TIMEOUT)
            dp_shm = self._shm(dp_store, rank, shape.dp)
            self.dp = TPGroup(rank, shape.dp, dp_group, shm=dp_shm)
        experts = self.dp if shape.dp > 1 else None
        self.tp = TPGroup(tp_rank, shape.tp, group, shape.ep, experts, shm)
        self._sends: list[tuple[object, torch.Tensor]] = []  # (work, buffer kept alive)
        self.wait_s = 0.0  # seconds blocked receiving: this rank's idle time (benchmarks)

    def _shm(self, store, rank: int, size: int) -> ShmGroup | None:
        """A group's shared-memory collectives, for CPU ranks (all of a worker's are on one
        host)."""
        return open_group(store, "coll", rank, size) if self.device.type == "cpu" else None

    def send_plan(self, plan: bytes) -> None:
        """Rank 0: a step plan to every other rank, through shared memory where it fits."""
        if self.plans is None or not self.plans.send(plan):
            for rank in range(1, self.shape.world_size):
                self.send_bytes(plan, rank, PLAN)

    def recv_plan(self) -> bytes:
        """Rank r > 0: rank 0's next step plan."""
        plan = None if self.plans is None else self.plans.recv()
        return self.recv_bytes(0, PLAN) if plan is None else plan

    def send_bytes(self, data: bytes, dst: int, tag: int) -> None:
        self._send(self.world, torch.tensor([len(data)], dtype=torch.int64), dst, tag)
        self._send(self.world, torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)

    def recv_bytes(self, src: int, tag: int) -> bytes:
        header = self._recv(self.world, torch.empty(1, dtype=torch.int64), src, tag)
        out = torch.empty(int(header[0]), dtype=torch.uint8)
        return self._recv(self.world, out, src, tag).numpy().tobytes()

    def send_tensor(self, x: torch.Tensor, dst: int, tag: int) -> None:
        """A tensor on this rank's device (hidden states) to rank dst."""
        self._send(self.hidden, x.contiguous(), dst, tag)

    def recv_tensor(self, shape, dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        """What send_tensor sent, on this rank's device."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return self._recv(self.hidden, out, src, tag)

    def _recv(self, group, out: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        group.recv([out], src, tag).wait()
        self.wait_s += time.perf_counter() - start
        return out

    def _send(self, group, x: torch.Tensor, dst: int, tag: int) -> None:
        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]
        self._sends.append((group.send([x], dst, tag), x))

    def flush(self) -> None:
        """Waits until every send so far was received."""
        for work, _ in self._sends:
            work.wait()
        self._sends = []
