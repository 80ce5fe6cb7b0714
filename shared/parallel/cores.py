"""CPU core sets: the `--cpus 0-3,8` syntax, the order that keeps SMT siblings together, each
rank's share of a worker's cores, and pinning a process to its share."""

import os
from pathlib import Path

from shared.errors import InvalidRequestError

CPU_SYSFS = Path("/sys/devices/system/cpu")


def parse_cpulist(text: str, flag: str = "--cpus") -> tuple[int, ...]:
    """ "0-3,8" -> (0, 1, 2, 3, 8), the Linux cpulist format (as in `taskset -c`)."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if first < 0 or last < first:
                raise ValueError
            cores += range(first, last + 1)
    except ValueError:
        raise InvalidRequestError(
            flag, f"expected a CPU list such as 0-3,8; got {text!r}"
        ) from None
    if len(set(cores)) != len(cores):
        raise InvalidRequestError(flag, f"lists a CPU twice: {text!r}")
    return tuple(cores)


def format_cpulist(cores: tuple[int, ...] | list[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8"."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def available_cores() -> tuple[int, ...]:
    """The CPUs this process may run on, SMT siblings next to each other (package, core id)."""

    def topology(cpu: int) -> tuple[int, int, int]:
        base = CPU_SYSFS / f"cpu{cpu}" / "topology"
        try:
            package = int((base / "physical_package_id").read_text())
            core = int((base / "core_id").read_text())
        except (OSError, ValueError):
            return (0, cpu, cpu)
        return (package, core, cpu)

    return tuple(sorted(os.sched_getaffinity(0), key=topology))


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: this thread only
        return [0]


def rank_cores(cores: tuple[int, ...], world_size: int, rank: int) -> tuple[int, ...]:
    """Rank `rank`'s share of a worker's cores: contiguous, as even as possible; with fewer cores
    than ranks (oversubscribed), ranks take the cores in turn."""
    if len(cores) < world_size:
        return (cores[rank % len(cores)],)
    share, extra = divmod(len(cores), world_size)
    start = rank * share + min(rank, extra)
    return cores[start : start + share + (rank < extra)]


def pin(cores: tuple[int, ...]) -> int:
    """Runs this process on `cores`, with one torch and OpenMP thread per core. Every thread it
    has is moved (the mask is per thread, and new threads inherit their creator's); returns the
    thread count."""
    import torch

    try:
        for tid in _threads():
            try:
                os.sched_setaffinity(tid, cores)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    except OSError as e:
        raise InvalidRequestError(
            "--cpus", f"cannot run on CPUs {format_cpulist(cores)}: {e.strerror}"
        ) from None
    torch.set_num_threads(len(cores))
    return len(cores)
