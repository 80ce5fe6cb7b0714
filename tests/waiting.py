"""Waiting for a state in tests: poll it until a deadline rather than sleep a fixed time.

A fixed sleep is too short on a busy machine (the test fails or, worse, passes on a stale
state) and too long everywhere else. A deadline only matters when the state never comes:
the test then fails naming what it waited for.
"""

import asyncio
import inspect
import time

POLL_S = 0.05


def wait_until(predicate, timeout: float, what: str, interval: float = POLL_S):
    """predicate()'s first true value, checked every `interval` s; AssertionError naming
    `what` once `timeout` s have passed without one."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)  # the poll interval
    return value


async def until(predicate, timeout: float, what: str, interval: float = POLL_S):
    """wait_until on the event loop; predicate() may return an awaitable (an async check)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)  # the poll interval
