"""Prefill side of the KV handoff, one per rank of a prefill worker of any shape: after each
layer of a forward pass, the rank writes the new KV of its layers and units (heads) of every
request bound for a decode worker into that worker's reserved pages, over shm, TCP or
torch.distributed (dist), to each decode rank that holds them. Single-rank and T x P workers
run the same code.

Rank 0 registers targets (`add`, from the PrefillAssignMsg) and tells the other ranks of new and
dropped ones in its step plans (`plan_extras` -> `on_plan`), so a target is parsed once per rank.

Acknowledgement is causal: a rank writes a layer's KV before its stage passes the hidden states
on, and at a request's last layer on that rank it waits for the transport's acknowledgement
(TCP, dist), all before the last stage's logits all-gather. So once rank 0 holds a request's
first token, every rank's KV of it is in the decode worker's pool.

With data-parallel ranks (--dp) a rank sends the KV of its own requests only (the runner shows
it no others). Rank 0 holds every target still: at a request's finish it forgets one another
rank completed, and tells the others to forget it too (the final hidden states' all-gather
orders that rank's acknowledgement before the first token)."""

import logging
import time
from pathlib import Path

from shared.kv.cache import KVCache
from shared.kv.spec import KVSpec
from shared.parallel.shape import ParallelConfig
from shared.protocol import KVPool
from shared.transfer import cuda_ipc, dist, shm, tcp
from shared.transfer.base import KVSender, KVTarget, LayerKV, host_id
from shared.transfer.error_board import ErrorBoard
from shared.wire import from_plain, to_plain

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", shm.NAME, tcp.NAME, dist.NAME, cuda_ipc.NAME)


class KVHandoff:
    """Owns one rank's targets and senders; counts bytes and seconds."""

    def __init__(
        self,
        kv: KVCache,
        spec: KVSpec,
        layers: tuple[int, int],
        units: tuple[int, int],
        writes: bool,
        reports: bool,
        announces: bool,
        transport: str = "auto",
        secret: bytes | None = None,
        data_parallel: bool = False,  # --dp: each rank completes its own requests only
        board: ErrorBoard | None = None,  # with several ranks: their failures reach rank 0
    ):
        if transport not in TRANSPORTS:
            raise ValueError(f"KV transport must be one of {TRANSPORTS}, got {transport!r}")
        self.kv, self.spec = kv, spec  # this rank's pool; the whole model's spec
        self.layers, self.units = layers, units  # global [first, end) of this rank
        self.writes = writes  # False on a replica of units another rank sends
        self.reports = reports  # rank 0: keeps each request's outcome for `finish`
        self.announces = announces  # rank 0 of several: tells the others in plans
        self.data_parallel = data_parallel
        self.board = board
        self.transport = transport
        self.host = host_id()
        self.senders: dict[str, KVSender] = {shm.NAME: shm.ShmSender(spec)}
        if kv.device.type == "cuda":  # GPU pools of a decode worker on this node
            self.senders[cuda_ipc.NAME] = cuda_ipc.CudaIpcSender(spec)
        if secret:
            self.senders[tcp.NAME] = tcp.TcpSender(secret)
            self.senders[dist.NAME] = dist.DistSender(secret)
        self.targets: dict[str, KVTarget] = {}
        self.errors: dict[str, str] = {}  # request id -> why its transfer failed
        self.results: dict[str, str | None] = {}  # rank 0: finished requests -> error or None
        self.bytes_sent, self.seconds = 0, 0.0
        self._new: dict[str, list] = {}  # rank 0: targets the other ranks have not seen yet
        self._gone: list[str] = []  # rank 0: targets dropped since the last plan
        self._step: dict[str, tuple] = {}  # this step: request id -> (target, src, dst, last)
        # request id -> (tokens its decode worker holds already, tokens of its KV sent so far)
        self._sent: dict[str, tuple[int, int]] = {}

    @classmethod
    def of_rank(
        cls,
        kv: KVCache,
        spec: KVSpec,
        shape: ParallelConfig,
        rank: int,
        transport,
        secret,
        board: ErrorBoard | None = None,
    ) -> "KVHandoff":
        stage = shape.stage_of(rank, spec.num_layers)
        end = spec.num_layers if stage.end_layer is None else stage.end_layer
        tp_rank = rank % shape.tp
        units = spec.rank_units(tp_rank, shape.tp)
        writes = spec.writes(tp_rank, shape.tp)
        layers = (stage.start_layer, end)
        announces = rank == 0 and shape.world_size > 1
        dp = shape.dp > 1
        return cls(
            kv, spec, layers, units, writes, rank == 0, announces, transport, secret, dp, board
        )

    def transport_to(self, pool: KVPool) -> str:
        """The transport that reaches `pool`; ValueError naming why none does."""
        if pool.layout != self.spec.layout:
            raise ValueError(f"KV layout {pool.layout} != this worker's {self.spec.layout}")
        same_host = pool.host == self.host and all(
            rank.shm and Path(rank.shm).exists() for rank in pool.ranks
        )
        if same_host and self.transport in ("auto", shm.NAME):
            return shm.NAME
        gpu_pools = pool.host == self.host and all(rank.cuda_ipc for rank in pool.ranks)
        if (
            gpu_pools
            and cuda_ipc.NAME in self.senders
            and self.transport in ("auto", cuda_ipc.NAME)
        ):
            return cuda_ipc.NAME
        # auto takes it between GPU workers (NCCL); between CPU workers TCP moves the same
        # bytes with less machinery, so there it is chosen by name only
        on_gpu = self.kv.device.type == "cuda"
        asked = self.transport == dist.NAME or (self.transport == "auto" and on_gpu)
        if pool.dist and dist.NAME in self.senders and asked:
            return dist.NAME
        if pool.tcp and tcp.NAME in self.senders and self.transport in ("auto", tcp.NAME):
            return tcp.NAME
        raise ValueError(
            f"no {self.transport} KV transport reaches the decode worker "
            f"(same host: {same_host}, its TCP server: {pool.tcp or 'none'}, its dist server: "
            f"{pool.dist or 'none'}; is a KV secret set?)"
        )

    def add(
        self,
        request_id: str,
        page_ids,
        pool: KVPool | None,
        held: int = 0,
        chunk_page_ids=(),
        chunk_first_page: int = 0,
    ) -> None:
        """Rank 0: registers a request's destination, whose pages hold the KV of its first
        `held` tokens already (the decode worker's cached prefix: never sent), and where the
        decode worker caps chunked layers, their pages (KVTarget's); ValueError if no
        transport reaches it."""
        if pool is None:
            raise ValueError("the decode worker sent no KV pool")
        target = KVTarget(
            request_id, tuple(page_ids), pool, self.transport_to(pool),
            tuple(map(tuple, chunk_page_ids)), chunk_first_page,
        )  # fmt: skip
        self.targets[request_id] = target
        self._sent[request_id] = (held, held)
        if self.announces:
            self._new[request_id] = [
                list(page_ids), to_plain(pool), held, to_plain(target.chunk_page_ids),
                chunk_first_page,
            ]  # fmt: skip

    def plan_extras(self, out) -> dict:
        """Rank 0: what the other ranks learn with this step's plan."""
        extras = {"new": self._new, "gone": self._gone}
        self._new, self._gone = {}, []
        return extras

    def on_plan(self, push: dict) -> None:
        """Ranks > 0: the targets rank 0 added and dropped since its previous plan."""
        for rid in push.get("gone", ()):
            self.targets.pop(rid, None)
            self._sent.pop(rid, None)
        for rid, (pages, plain, held, chunk_pages, chunk_first) in push.get("new", {}).items():
            pool = from_plain(KVPool, plain)
            self._sent[rid] = (held, held)
            try:
                transport = self.transport_to(pool)
                self.targets[rid] = KVTarget(
                    rid,
                    tuple(pages),
                    pool,
                    transport,
                    tuple(map(tuple, chunk_pages)),
                    chunk_first,
                )
            except ValueError as e:  # rank 0 reached it
                log.warning("request %s: %s", rid, e)
                if self.board is not None:
                    self.board.post(rid, f"KV transfer failed on a rank: {e}")

    def on_layer(self, layer: int, out) -> None:
        """After global layer `layer` of this rank's part of step `out` wrote its KV."""
        if not self.targets:
            return
        start = time.perf_counter()
        if layer == self.layers[0]:  # the first layer of a step: work out its slots once
            self._step = self._step_slots(out)
        if self.writes:
            for rid, (target, full, chunked, _) in self._step.items():
                if rid not in self.errors:
                    group = target.groups.get(layer, 0)
                    src, dst = (chunked[0], chunked[1][group - 1]) if group else full
                    if len(dst):
                        self._send(target, layer, src, dst)
        if layer == self.layers[1] - 1:
            for target, _, _, last in self._step.values():
                if last:
                    self._complete(target)
        self.seconds += time.perf_counter() - start

    def _send(self, target: KVTarget, layer: int, src, dst) -> None:
        local = (0, self.units[1] - self.units[0])
        try:
            payload = self.kv.spec.read(self.kv.data, layer - self.layers[0], src, local)
            sent = LayerKV(layer, self.units, dst, payload)
            self.bytes_sent += self.senders[target.transport].send_layer(target, sent)
        except Exception as e:  # the decode worker went away: fail this request only
            self.errors[target.request_id] = f"KV transfer failed: {e}"

    def _complete(self, target: KVTarget) -> None:
        """The request's last chunk passed this rank: wait for its bytes, forget the target."""
        rid = target.request_id
        if self.writes and rid not in self.errors:
            try:
                self.senders[target.transport].finish(target)
            except Exception as e:
                self.errors[rid] = f"KV transfer failed: {e}"
        self.targets.pop(rid, None)
        self._sent.pop(rid, None)
        error = self.errors.pop(rid, None)
        if self.reports:
            self.results[rid] = error
        elif error:
            log.warning("request %s: %s", rid, error)
            if self.board is not None:
                self.board.post(rid, error)

    def _step_slots(self, out) -> dict:
        """Source and destination slots of every pushed request's tokens not sent yet, up to
        this step's end: this step's, and with its first chunk the prefix it found cached
        (computed by earlier requests, already in this rank's pages); never those the decode
        worker's pages hold already (its own cached prefix, shared with other requests).
        Separately those of the decode worker's capped chunked layers: the same tokens from
        its first chunked page on, into each page group's pages."""
        step = {}
        for s in out.scheduled:
            target = self.targets.get(s.request.request_id)
            if target is not None:
                rid, end = target.request_id, s.start + s.num_tokens
                held, sent = self._sent.get(rid, (0, 0))
                start = max(held, min(sent, s.start))  # min: recomputed after a preemption
                if start >= end:  # this chunk's tokens are all there already
                    continue
                pages = s.request.page_ids
                full = (
                    self.spec.slots(pages, start, end),
                    self.spec.slots(target.page_ids, start, end),
                )
                chunked = None
                if target.chunk_page_ids:
                    first = max(start, target.chunk_first_page * self.spec.page_size)
                    chunked = self._chunk_slots(pages, target, first, max(first, end))
                step[rid] = (target, full, chunked, s.samples)
                self._sent[rid] = (held, end)
        return step

    def _chunk_slots(self, pages, target: KVTarget, start: int, end: int):
        """(source slots, each page group's destination slots) of tokens [start, end) of the
        capped chunked layers."""
        shift = target.chunk_first_page * self.spec.page_size  # dst: counted from its first page
        dst = [
            self.spec.slots(group, start - shift, end - shift) for group in target.chunk_page_ids
        ]
        return self.spec.slots(pages, start, end), dst

    def finish(self, request_id: str) -> str | None:
        """Rank 0, once the request's last chunk came back: None, or why its KV is not all in
        place (on this rank; the decode worker checks the others' byte counts over TCP). With
        data-parallel ranks, another rank's request is complete: its target is forgotten
        here and, with the next plan, on the other ranks."""
        posted = None if self.board is None else self.board.take(request_id)
        if request_id in self.results:
            if self.data_parallel and self.announces:  # the other ranks hold its target too
                self._gone.append(request_id)
            return self.results.pop(request_id) or posted
        completed = self.data_parallel and request_id in self.targets  # by its rank
        self._forget(request_id)
        return posted if completed else "no KV target"

    def drop(self, request_id: str) -> None:
        """Rank 0: forgets a request (cancelled, failed); the other ranks with the next plan."""
        if self.board is not None:  # what a rank posted for it, if any, goes too
            self.board.take(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.results.pop(request_id, None)
        self.errors.pop(request_id, None)
        self._sent.pop(request_id, None)
        if self.targets.pop(request_id, None) is not None and self.announces:
            if self._new.pop(request_id, None) is None:
                self._gone.append(request_id)

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
