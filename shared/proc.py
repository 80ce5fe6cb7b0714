"""Child-process helpers shared by `tison up` and the NATS server runner."""

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends the child SIGKILL if its parent dies (Linux), so a killed
    `tison up` leaves no orphans. Elsewhere a no-op; a clean stop still terminates children."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
