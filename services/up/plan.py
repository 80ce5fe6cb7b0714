"""What `tison up` runs: the child processes, their cores, and when to restart them. Pure: no
processes here."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

from services.up.placement import Placement, Request, place
from shared.parallel.cores import available_cores, format_cpulist


@dataclass(frozen=True)
class UpConfig:
    model_dir: Path
    dtype: str = "auto"
    device: str = "auto"  # every worker's --device
    # GPUs the workers may use (0: unknown). Enough for a GPU a rank: each worker its own
    # (--device cuda:FIRST), else they share the visible GPUs (each its part of the memory)
    gpus: int = 0
    gpu_memory_utilization: float = 0.9  # of each GPU, for the workers on it together
    enforce_eager: bool = False  # every worker: decode op by op (no graphs, no fused call)
    resident_codec: bool = False  # every worker: layer weights stay compressed on the device
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: int = 1
    decode_workers: int = 1
    mode: str = "auto"  # disaggregated | colocated (one engine does both) | auto (placement.py)
    nats_url: str = ""  # "" -> start an embedded nats-server
    kv_cache_bytes: int | None = None
    threads: int = 0  # torch threads per worker, unpinned (0: pinned, a thread per planned core)
    worker_args: tuple[str, ...] = ()  # extra flags passed to every worker
    prefill_tp: int = 1  # shape of each prefill worker (colocated workers take the decode one)
    prefill_pp: int = 1
    decode_tp: int = 1  # shape of each decode worker
    decode_pp: int = 1
    prefill_dp: int = 1  # data-parallel attention ranks of each prefill worker (--dp)
    decode_dp: int = 1  # ... of each decode (or colocated) worker
    ep: bool = False  # every worker: MoE experts spread whole over its TP ranks
    prefix_caching: bool = True  # every worker: computed full pages stay cached
    allow_oversubscribe: bool = False  # workers may run more ranks than CPU cores
    cores: tuple[int, ...] = field(default_factory=available_cores)  # the CPUs tison up may use
    cores_prefill: tuple[int, ...] = ()  # explicit cores of the prefill (or colocated) workers
    cores_decode: tuple[int, ...] = ()
    routing: str = "kv"  # the scheduler's --routing (services/scheduler/routing.py)
    batch_max_share: float | None = None  # the scheduler's --batch-max-share; None: its default
    tool_call_parser: str = "auto"  # the gateway's --tool-call-parser
    batch_runners: int | None = None  # the gateway's --batch-runners; None: its default

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("--prefill-workers and --decode-workers must be >= 1")
        shapes = [f"{role}_{dim}" for role in ("prefill", "decode") for dim in ("tp", "pp", "dp")]
        for flag in shapes:
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if self.batch_max_share is not None and not 0 < self.batch_max_share <= 1:
            raise ValueError(f"--batch-max-share must be in (0, 1], got {self.batch_max_share}")
        if self.batch_runners is not None and self.batch_runners < 0:
            raise ValueError(f"--batch-runners must be >= 0, got {self.batch_runners}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.gpus < 0:
            raise ValueError(f"--gpus must be >= 0, got {self.gpus}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")


@dataclass(frozen=True)
class ChildSpec:
    name: str  # shown in logs: scheduler, prefill-0, decode-1, gateway, ...
    args: tuple[str, ...]  # `tison` subcommand and flags (--nats-url is added at start)
    cores: tuple[int, ...] = ()  # the supervisor pins the child here; (): any core

    def argv(self, nats_url: str) -> list[str]:
        return [sys.executable, "-m", "services.cli", *self.args, "--nats-url", nats_url]


def placement(cfg: UpConfig) -> Placement:
    return place(
        Request(
            cores=cfg.cores,
            mode=cfg.mode,
            prefill_workers=cfg.prefill_workers,
            decode_workers=cfg.decode_workers,
            prefill_ranks=cfg.prefill_tp * cfg.prefill_pp * cfg.prefill_dp,
            decode_ranks=cfg.decode_tp * cfg.decode_pp * cfg.decode_dp,
            cores_prefill=cfg.cores_prefill,
            cores_decode=cfg.cores_decode,
            pinned=not cfg.threads,
            allow_oversubscribe=cfg.allow_oversubscribe,
        )
    )


def plan(cfg: UpConfig, where: Placement | None = None) -> list[ChildSpec]:
    """Scheduler first, workers next, gateway last (it answers /health once workers report)."""
    where = where or placement(cfg)
    model = ["--model", str(cfg.model_dir)]
    worker = [*model, "--dtype", cfg.dtype, *cfg.worker_args]
    if cfg.enforce_eager:
        worker.append("--enforce-eager")
    if cfg.resident_codec:
        worker.append("--resident-codec")
    if cfg.kv_cache_bytes:
        worker += ["--kv-cache-bytes", str(cfg.kv_cache_bytes)]
    if cfg.threads:
        worker += ["--threads", str(cfg.threads)]
    if cfg.allow_oversubscribe:
        worker.append("--allow-oversubscribe")
    if cfg.ep:
        worker.append("--ep")
    if not cfg.prefix_caching:
        worker.append("--no-prefix-caching")
    prefill = [*worker, "--tp", str(cfg.prefill_tp), "--pp", str(cfg.prefill_pp)]
    decode = [*worker, "--tp", str(cfg.decode_tp), "--pp", str(cfg.decode_pp)]
    prefill += ["--dp", str(cfg.prefill_dp)] if cfg.prefill_dp > 1 else []
    decode += ["--dp", str(cfg.decode_dp)] if cfg.decode_dp > 1 else []
    scheduler = ("scheduler", "--routing", cfg.routing)
    if cfg.batch_max_share is not None:
        scheduler += ("--batch-max-share", str(cfg.batch_max_share))
    children = [ChildSpec("scheduler", scheduler, where.services)]
    devices = worker_devices(cfg, where)
    for w, device in zip(where.workers, devices):
        args = [w.role, *(prefill if w.role == "prefill" else decode), *device]
        if w.cores:
            args += ["--cpus", format_cpulist(w.cores)]
        children.append(ChildSpec(w.name, tuple(args)))
    gateway = ("gateway", *model, "--host", cfg.host, "--port", str(cfg.port))
    if cfg.tool_call_parser != "auto":
        gateway += ("--tool-call-parser", cfg.tool_call_parser)
    if cfg.batch_runners is not None:
        gateway += ("--batch-runners", str(cfg.batch_runners))
    children.append(ChildSpec("gateway", gateway, where.services))
    return children


def worker_devices(cfg: UpConfig, where: Placement) -> list[list[str]]:
    """Each worker's device flags: GPUs of its own where cfg.gpus holds a GPU a rank (all
    visible to all workers: CUDA IPC), else the visible GPUs shared, each worker its part of
    the memory share."""
    if cfg.device == "cpu":
        return [["--device", "cpu"] for _ in where.workers]
    ranks = [
        cfg.prefill_tp * cfg.prefill_pp * cfg.prefill_dp
        if w.role == "prefill"
        else cfg.decode_tp * cfg.decode_pp * cfg.decode_dp
        for w in where.workers
    ]
    if cfg.gpus and sum(ranks) <= cfg.gpus:
        use = f"{cfg.gpu_memory_utilization:.4f}"
        firsts = [sum(ranks[:i]) for i in range(len(ranks))]
        return [["--device", f"cuda:{f}", "--gpu-memory-utilization", use] for f in firsts]
    share = f"{cfg.gpu_memory_utilization / len(where.workers):.4f}"
    return [["--device", cfg.device, "--gpu-memory-utilization", share] for _ in where.workers]


@dataclass
class RestartPolicy:
    """Exponential backoff per child: 1 s, 2 s, 4 s ... capped; reset after a long healthy run."""

    base_s: float = 1.0
    max_s: float = 30.0
    healthy_after_s: float = 60.0
    _failures: dict[str, int] = field(default_factory=dict)

    def delay(self, name: str, ran_for_s: float) -> float:
        """Seconds to wait before restarting `name`, which exited after running `ran_for_s`."""
        failures = 0 if ran_for_s >= self.healthy_after_s else self._failures.get(name, 0)
        self._failures[name] = failures + 1
        return min(self.max_s, self.base_s * 2**failures)
