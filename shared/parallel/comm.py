"""The links of one rank of a worker: a world group for point-to-point messages (step plans,
hidden states, results), its stage's tensor-parallel group and, with --dp, the data-parallel
group of all ranks. Groups are ProcessGroup objects built over a loopback TCPStore, not the
process-global default group, so one process may hold several engines (tests) one after
another. Messages are msgpack bytes or tensors, never pickle. The TP and DP groups' backend
follows the device (group.process_group), and on CPUs their collectives go through shared
memory first (shm_group.py). Step plans and results, CPU bytes, go through rings in shared
memory first (shm_ring.py), then the world group, gloo on every device; hidden states between
stages through a ring too between CPU ranks, and on a group of the device's backend between
GPUs (NCCL: they never visit host memory)."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.parallel.group import SINGLE, TPGroup, process_group
from shared.parallel.shape import ParallelConfig
from shared.parallel.shm_group import ShmGroup, open_group
from shared.parallel.shm_ring import open_ring

PLAN, HIDDEN, RESULT = 1, 2, 3  # message tags: rank 0 -> all, stage -> next stage, last -> 0
IDLE_TIMEOUT = timedelta(days=30)  # ranks wait for the next plan as long as the worker lives
# shm_ring.py's rings: messages a writer may run ahead of its readers, besides P micro-batches,
# and each kind's slot (larger messages go over gloo)
RING_SLOTS = 4
PLAN_BYTES = 512 << 10  # a plan of a batch's new prompts (~60k tokens)
HIDDEN_BYTES = 2 << 20  # (2, T, H) hidden states and residual: 32 bf16 rows of 16k
RESULT_BYTES = 256 << 10  # samples (and a few prompts' logprobs)


def open_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """Rank 0 passes port 0 and reads `.port`; the others connect to it."""
    return dist.TCPStore(
        host, port, world_size, is_master, timeout=timedelta(seconds=120), wait_for_workers=False
    )


class RankComm:
    """One rank's groups and rings. Sends do not wait for their receiver (a ring's writer only
    once it is RING_SLOTS + P messages ahead): rank 0 never waits for a busy later stage."""

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
        # (a --dp rank is stage 0 of a whole model of its own)
        stage, tp_rank = rank // shape.tp % shape.pp, rank % shape.tp
        self._open_rings(store, stage)
        self.hidden = self.world  # stage -> next stage: on the device's backend
        if self.device.type != "cpu" and shape.pp > 1:
            hidden = dist.PrefixStore("hidden", store)
            self.hidden = process_group(hidden, rank, shape.world_size, device, IDLE_TIMEOUT)
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

    def _open_rings(self, store, stage: int) -> None:
        """This rank's rings (shm_ring.py; None: the messages go over gloo): rank 0's step plans
        to every rank, a CPU stage's hidden states to the next stage's rank of the same TP rank,
        the last stage's results to rank 0. Each opens after the one it waits on (stage s's
        from stage s - 1 first), so that their rendezvous never wait in a circle."""
        shape, rank = self.shape, self.rank
        slots = shape.pp + RING_SLOTS
        everyone = tuple(range(shape.world_size))
        self._plans = open_ring(store, "step plan", everyone, rank, slots, PLAN_BYTES)
        self._from_previous = self._to_next = self._results = None
        tp = shape.tp
        if self.device.type == "cpu" and stage > 0:
            pair = (rank - tp, rank)
            self._from_previous = open_ring(
                store, f"hidden states of rank {rank - tp}", pair, rank, slots, HIDDEN_BYTES
            )
        if self.device.type == "cpu" and stage < shape.pp - 1:
            pair = (rank, rank + tp)
            self._to_next = open_ring(
                store, f"hidden states of rank {rank}", pair, rank, slots, HIDDEN_BYTES
            )
        last = shape.rank_of(shape.pp - 1, 0)
        if shape.pp > 1 and rank in (0, last):
            self._results = open_ring(store, "step result", (last, 0), rank, slots, RESULT_BYTES)

    def _shm(self, store, rank: int, size: int) -> ShmGroup | None:
        """A group's shared-memory collectives, for CPU ranks (all of a worker's are on one
        host)."""
        return open_group(store, "coll", rank, size) if self.device.type == "cpu" else None

    def send_plan(self, plan: bytes) -> None:
        """Rank 0: a step plan to every other rank."""
        if not _through(self._plans, plan):
            for rank in range(1, self.shape.world_size):
                self.send_bytes(plan, rank, PLAN)

    def recv_plan(self) -> bytes | bytearray:
        """Rank r > 0: rank 0's next step plan."""
        plan = self._from(self._plans)
        return self.recv_bytes(0, PLAN) if plan is None else plan

    def send_result(self, result: bytes) -> None:
        """The last stage's TP rank 0: a step's result to rank 0."""
        if not _through(self._results, result):
            self.send_bytes(result, 0, RESULT)

    def recv_result(self) -> bytes | bytearray:
        """Rank 0: the last stage's next step result."""
        result = self._from(self._results)
        last = self.shape.rank_of(self.shape.pp - 1, 0)
        return self.recv_bytes(last, RESULT) if result is None else result

    def send_hidden(self, x: torch.Tensor) -> None:
        """A tensor on this rank's device (hidden states) to the next stage's rank of this TP
        rank."""
        x = x.contiguous()
        ring = self._to_next  # CPU ranks only: a tensor on the CPU
        if ring is None or not ring.send(x.view(-1).view(torch.uint8).numpy()):
            self._send(self.hidden, x, self.rank + self.shape.tp, HIDDEN)

    def recv_hidden(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """What the previous stage's rank of this TP rank sent with send_hidden."""
        data = self._from(self._from_previous)
        if data is not None:
            return torch.frombuffer(data, dtype=dtype).view(shape)
        out = torch.empty(shape, dtype=dtype, device=self.device)
        return self._recv(self.hidden, out, self.rank - self.shape.tp, HIDDEN)

    def _from(self, ring) -> bytearray | None:
        """The ring's next message (None: no ring, or it comes over gloo), its wait counted."""
        if ring is None:
            return None
        start = time.perf_counter()
        try:
            return ring.recv()
        finally:
            self.wait_s += time.perf_counter() - start

    def send_bytes(self, data: bytes, dst: int, tag: int) -> None:
        self._send(self.world, torch.tensor([len(data)], dtype=torch.int64), dst, tag)
        self._send(self.world, torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag)

    def recv_bytes(self, src: int, tag: int) -> bytes:
        header = self._recv(self.world, torch.empty(1, dtype=torch.int64), src, tag)
        out = torch.empty(int(header[0]), dtype=torch.uint8)
        return self._recv(self.world, out, src, tag).numpy().tobytes()

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


def _through(ring, message) -> bool:
    """Whether the ring took the message (False: no ring, or send it over gloo now)."""
    return ring is not None and ring.send(message)
