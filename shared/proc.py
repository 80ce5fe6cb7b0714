"""Child-process helpers shared by `tison up` and the NATS server runner."""

import ctypes
import functools
import os
import signal
import subprocess
import time

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends the child SIGKILL if its parent dies (Linux), so a killed
    `tison up` leaves no orphans. Elsewhere a no-op; a clean stop still terminates children."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def child_setup(cores: tuple[int, ...] = ()):
    """preexec_fn: die_with_parent, and run on `cores` (all its threads inherit them)."""
    return functools.partial(_setup, tuple(cores))


def _setup(cores: tuple[int, ...]) -> None:
    die_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> list[subprocess.Popen]:
    """SIGTERM to each (in the given order), then SIGKILL whatever is still running after
    `timeout_s`. Returns the processes that had to be killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline, killed = time.monotonic() + timeout_s, []
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(proc)
    return killed


def process_age_s() -> float | None:
    """Seconds since this process was forked, from /proc (Linux; None elsewhere): roughly
    the time a service spent starting the interpreter and importing before its first line."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in (...) may hold spaces
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
