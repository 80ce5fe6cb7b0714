"""What `tison up` runs: the child processes and when to restart them. Pure: no processes here."""

import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class UpConfig:
    model_dir: Path
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_workers: int = 1
    decode_workers: int = 1
    colocated: bool = False  # one engine doing prefill and decode per worker (the baseline)
    nats_url: str = ""  # "" -> start an embedded nats-server
    kv_cache_bytes: int | None = None
    threads: int = 0  # torch threads per worker (0: torch's default)
    worker_args: tuple[str, ...] = ()  # extra flags passed to every worker
    prefill_tp: int = 1  # shape of each prefill worker (colocated workers take the decode one)
    prefill_pp: int = 1
    decode_tp: int = 1  # shape of each decode worker
    decode_pp: int = 1
    allow_oversubscribe: bool = False  # workers may run more ranks than CPU cores

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("--prefill-workers and --decode-workers must be >= 1")
        for flag in ("prefill_tp", "prefill_pp", "decode_tp", "decode_pp"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")


@dataclass(frozen=True)
class ChildSpec:
    name: str  # shown in logs: scheduler, prefill-0, decode-1, gateway, ...
    args: tuple[str, ...]  # `tison` subcommand and flags (--nats-url is added at start)

    def argv(self, nats_url: str) -> list[str]:
        return [sys.executable, "-m", "services.cli", *self.args, "--nats-url", nats_url]


def plan(cfg: UpConfig) -> list[ChildSpec]:
    """Scheduler first, workers next, gateway last (it answers /health once workers report)."""
    model = ["--model", str(cfg.model_dir)]
    worker = [*model, "--dtype", cfg.dtype, *cfg.worker_args]
    if cfg.kv_cache_bytes:
        worker += ["--kv-cache-bytes", str(cfg.kv_cache_bytes)]
    if cfg.threads:
        worker += ["--threads", str(cfg.threads)]
    if cfg.allow_oversubscribe:
        worker.append("--allow-oversubscribe")
    prefill = [*worker, "--tp", str(cfg.prefill_tp), "--pp", str(cfg.prefill_pp)]
    decode = [*worker, "--tp", str(cfg.decode_tp), "--pp", str(cfg.decode_pp)]
    children = [ChildSpec("scheduler", ("scheduler",))]
    if cfg.colocated:
        children += [
            ChildSpec(f"colocated-{i}", ("colocated", *decode)) for i in range(cfg.prefill_workers)
        ]
    else:
        children += [
            ChildSpec(f"prefill-{i}", ("prefill", *prefill)) for i in range(cfg.prefill_workers)
        ]
        children += [
            ChildSpec(f"decode-{i}", ("decode", *decode)) for i in range(cfg.decode_workers)
        ]
    children.append(
        ChildSpec("gateway", ("gateway", *model, "--host", cfg.host, "--port", str(cfg.port)))
    )
    return children


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
