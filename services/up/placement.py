"""Which cores each process of `tison up` runs on. Pure: the machine's cores come in, a plan
comes out; the workers pin themselves to theirs (`--cpus`), the supervisor pins the rest.

Policy: from 6 cores up the gateway, scheduler and NATS get a core of their own (two from
32), so that no worker's OpenMP thread waits on them; below that they share the prefill
workers' cores (a prefill is throughput, a decode step is every stream's ITL). The
workers split the other cores, each rank at least one: decode half (memory-bound, it stops
scaling first), prefill the rest (compute-bound). With too few cores to give every rank of a
prefill and a decode worker its own, `auto` runs colocated (unless told to oversubscribe)."""

from dataclasses import dataclass

from shared.parallel.cores import format_cpulist, rank_cores

MODES = ("auto", "disaggregated", "colocated")


@dataclass(frozen=True)
class WorkerCores:
    name: str  # prefill-0, decode-1, colocated-0
    role: str  # prefill | decode | colocated
    cores: tuple[int, ...]  # (): not pinned


@dataclass(frozen=True)
class Placement:
    mode: str  # disaggregated | colocated
    workers: tuple[WorkerCores, ...]
    services: tuple[int, ...]  # cores of the gateway, scheduler and NATS; (): any core
    reason: str  # why this mode, shown at start

    def describe(self) -> list[str]:
        """The plan as `tison up` prints it at start."""
        lines = [f"mode: {self.mode} ({self.reason})"]
        for w in self.workers:
            lines.append(f"{w.name}: {_cores_text(w.cores)}")
        lines.append(f"gateway, scheduler, NATS: {_cores_text(self.services)}")
        return lines


def _cores_text(cores: tuple[int, ...]) -> str:
    if not cores:
        return "any core"
    return f"CPU {format_cpulist(cores)} ({len(cores)} thread{'s' * (len(cores) > 1)})"


def service_core_count(num_cores: int) -> int:
    return 0 if num_cores < 6 else 1 if num_cores < 32 else 2


@dataclass(frozen=True)
class Request:
    """What the user asked of `tison up` that bears on placement."""

    cores: tuple[int, ...]  # the cores tison up may use, SMT siblings adjacent
    mode: str = "auto"
    prefill_workers: int = 1
    decode_workers: int = 1  # colocated: prefill_workers workers, each of the decode shape
    prefill_ranks: int = 1  # tp x pp of each prefill worker
    decode_ranks: int = 1
    cores_prefill: tuple[int, ...] = ()  # explicit cores of all prefill (or colocated) workers
    cores_decode: tuple[int, ...] = ()
    pinned: bool = True  # False: every process runs anywhere (`--threads N`)
    allow_oversubscribe: bool = False


def place(req: Request) -> Placement:
    if req.mode not in MODES:
        raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {req.mode!r}")
    if not req.cores:
        raise ValueError("no CPU cores to run on")
    for flag, chosen in (
        ("--cores-prefill", req.cores_prefill),
        ("--cores-decode", req.cores_decode),
    ):
        stray = set(chosen) - set(req.cores)
        if stray:
            raise ValueError(f"{flag}: CPU {format_cpulist(sorted(stray))} not available here")
    mode, reason = _mode(req)
    names = _names(mode, req)
    if not req.pinned:
        workers = tuple(WorkerCores(name, role, ()) for name, role in names)
        return Placement(mode, workers, (), reason + "; unpinned: --threads")
    services, free = _split_services(req)
    if mode == "colocated":
        blocks = {"colocated": req.cores_prefill or free}
    else:
        blocks = _split_roles(req, free)
    workers = []
    for role, block in blocks.items():
        mine = [name for name, r in names if r == role]
        ranks = req.decode_ranks if role in ("decode", "colocated") else req.prefill_ranks
        if len(block) < len(mine) * ranks and not req.allow_oversubscribe:
            raise ValueError(
                f"{len(block)} cores cannot give {len(mine)} {role} worker(s) of {ranks} rank(s) "
                "a core per rank (fewer workers, --mode colocated, or --allow-oversubscribe)"
            )
        for i, name in enumerate(mine):
            workers.append(WorkerCores(name, role, rank_cores(tuple(block), len(mine), i)))
    if not services and mode == "disaggregated":  # no core of their own: prefill's, not decode's
        services = tuple(sorted({c for w in workers if w.role == "prefill" for c in w.cores}))
    return Placement(mode, tuple(workers), services, reason)


def _mode(req: Request) -> tuple[str, str]:
    if req.mode != "auto":
        return req.mode, "asked"
    if req.cores_prefill or req.cores_decode:
        return "disaggregated", "cores given per role"
    need = req.prefill_workers * req.prefill_ranks + req.decode_workers * req.decode_ranks
    if len(req.cores) < need and not req.allow_oversubscribe:
        return (
            "colocated",
            f"{len(req.cores)} core(s): too few for a core per prefill and decode rank",
        )
    return "disaggregated", f"{len(req.cores)} cores"


def _names(mode: str, req: Request) -> list[tuple[str, str]]:
    if mode == "colocated":
        return [(f"colocated-{i}", "colocated") for i in range(req.prefill_workers)]
    return [(f"prefill-{i}", "prefill") for i in range(req.prefill_workers)] + [
        (f"decode-{i}", "decode") for i in range(req.decode_workers)
    ]


def _split_services(req: Request) -> tuple[tuple[int, ...], list[int]]:
    """(service cores, the cores left to workers). With both roles' cores given, the services
    get the rest (when there is a rest)."""
    if req.cores_prefill and req.cores_decode:
        chosen = set(req.cores_prefill) | set(req.cores_decode)
        rest = tuple(c for c in req.cores if c not in chosen)
        return rest, [c for c in req.cores if c in chosen]
    n = service_core_count(len(req.cores))
    services = req.cores[len(req.cores) - n :] if n else ()
    return services, list(req.cores[: len(req.cores) - n])


def _split_roles(req: Request, free: list[int]) -> dict[str, tuple[int, ...]]:
    if req.cores_prefill and req.cores_decode:
        if set(req.cores_prefill) & set(req.cores_decode) and not req.allow_oversubscribe:
            raise ValueError("--cores-prefill and --cores-decode overlap")
        return {"prefill": req.cores_prefill, "decode": req.cores_decode}
    if req.cores_prefill or req.cores_decode:
        given = "prefill" if req.cores_prefill else "decode"
        chosen = req.cores_prefill or req.cores_decode
        rest = tuple(c for c in free if c not in chosen)
        other = "decode" if given == "prefill" else "prefill"
        return {given: chosen, other: rest}
    need_prefill, need_decode = (
        req.prefill_workers * req.prefill_ranks,
        req.decode_workers * req.decode_ranks,
    )
    if len(free) < need_prefill + need_decode and not req.allow_oversubscribe:
        raise ValueError(
            f"{len(free)} cores cannot give {need_prefill} prefill and {need_decode} decode "
            "rank(s) a core each (fewer workers or ranks, --mode colocated, or "
            "--allow-oversubscribe)"
        )
    decode = max(need_decode, len(free) // 2)
    decode = min(decode, max(len(free) - need_prefill, 0))
    if req.allow_oversubscribe and decode in (0, len(free)):  # too few for both: share them
        return {"prefill": tuple(free), "decode": tuple(free)}
    return {
        "prefill": tuple(free[: len(free) - decode]),
        "decode": tuple(free[len(free) - decode :]),
    }
