"""Weights on 2 MiB pages. Decoding streams every weight once per step; on 4 KiB pages the
TLB misses cost ~15-20% of a batch-1 step here. Where the kernel hands out transparent huge
pages only on request (THP mode "madvise", the common default), glibc's malloc asks for them
when the `glibc.malloc.hugetlb=1` tunable is set, which is read at process start: so the
process starts itself again once, with the tunable, before anything is allocated."""

import os
import sys
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wants_restart(environ: dict[str, str] | None = None) -> bool:
    """Whether this process should restart with the tunable: Linux, THP in "madvise" mode,
    and the tunable not yet set (so a restarted process never restarts again)."""
    environ = os.environ if environ is None else environ
    if sys.platform != "linux" or TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        return "[madvise]" in THP_MODE.read_text()
    except OSError:
        return False


def restart_with_huge_pages() -> None:
    """Replaces this process by the same command line with the tunable set, if it is wanted;
    otherwise returns. Call before torch or the model is loaded."""
    if not wants_restart():
        return
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    env = {**os.environ, "GLIBC_TUNABLES": ":".join([*tunables, TUNABLE])}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
