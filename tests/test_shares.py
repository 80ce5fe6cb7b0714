"""How a team's threads take a linear's groups as they go (kernels/cpu/shares.h), driven one
take at a time through shares.c's walk: every unit taken once whoever takes it, an owner from
its run's front a chunk at a time, a thread with nothing left half of another's rest from the
back, and nothing from a run not yet started."""

import random

import pytest
import torch

from kernels.cpu import library

from compilers import needs_compiler

pytestmark = needs_compiler


def walk(units: int, threads: int, who: list[int], started: int | None = None) -> list:
    """Take i by thread who[i] -> its [lo, hi), or None where it found nothing."""
    order = torch.tensor(who, dtype=torch.int32)
    taken = torch.zeros(2 * len(who), dtype=torch.int64)
    status = library.kernel("tk_shares_walk")(
        units, threads, threads if started is None else started, order.data_ptr(), len(who),
        taken.data_ptr(),
    )  # fmt: skip
    assert status == 0
    pairs = taken.view(-1, 2).tolist()
    return [None if lo == -1 else (lo, hi) for lo, hi in pairs]


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("units", [0, 1, 3, 7, 64, 1001])
def test_every_unit_is_taken_once_whoever_takes_it(threads, units):
    """A random order of takes, then one more look by each thread: while any unit is left a
    take finds some (each takes at least one), so the last looks find none; the runs taken
    cover each unit exactly once, each a non-empty run inside the loop."""
    rng = random.Random(threads * 10_000 + units)
    order = [rng.randrange(threads) for _ in range(units + 4 * threads)] + list(range(threads))
    taken = walk(units, threads, order)
    assert taken[-threads:] == [None] * threads
    covered = [0] * units
    for run in taken:
        if run is None:
            continue
        lo, hi = run
        assert 0 <= lo < hi <= units
        for u in range(lo, hi):
            covered[u] += 1
    assert covered == [1] * units


def test_an_owner_takes_its_front_a_chunk_at_a_time():
    """Thread 0 of 2 on 40 units: its run is [0, 20), taken from the front in equal chunks
    (the last one what is left), then nothing of its own."""
    taken = walk(40, 2, [0] * 8, started=1)
    chunk = taken[0][1] - taken[0][0]
    assert 1 <= chunk < 20
    runs = [r for r in taken if r is not None]
    assert runs[0] == (0, chunk)
    assert all(b[0] == a[1] for a, b in zip(runs, runs[1:]))  # in order, back to back
    assert all(hi - lo == chunk for lo, hi in runs[:-1]) and runs[-1][1] == 20
    assert taken[len(runs) :] == [None] * (8 - len(runs))


def test_a_thread_with_nothing_left_takes_half_of_anothers_rest_from_the_back():
    """2 threads on 40 units: thread 1 empties its run [20, 40) while thread 0 has taken one
    chunk of [0, 20); thread 1 then takes the back half of what thread 0 has left, then half of
    the rest, while thread 0 goes on from its front."""
    first = walk(40, 2, [0])
    chunk = first[0][1]
    own = -(-20 // chunk)  # thread 1's takes of its own run
    taken = walk(40, 2, [0] + [1] * own + [1, 1, 0])
    rest = (chunk, 20)
    half = (rest[1] - rest[0]) // 2
    assert taken[own + 1] == (20 - half, 20)
    second = (20 - half - (20 - half - chunk) // 2, 20 - half)
    assert taken[own + 2] == second
    assert taken[own + 3] == (chunk, min(2 * chunk, second[0]))


def test_a_run_not_yet_started_has_nothing_to_take():
    """Shares start empty (and every loop leaves them so: the first test's last looks find
    nothing): a thread that looks at another's run before its owner has started it finds
    nothing there, and takes only its own."""
    taken = walk(40, 2, [0] * 10, started=1)
    runs = [r for r in taken if r is not None]
    assert runs[-1][1] == 20 and all(hi <= 20 for _, hi in runs)
    assert walk(40, 2, [1, 0], started=0) == [None, None]


def test_a_thread_outside_the_team_is_refused():
    order = torch.tensor([2], dtype=torch.int32)
    taken = torch.zeros(2, dtype=torch.int64)
    fn = library.kernel("tk_shares_walk")
    assert fn(10, 2, 2, order.data_ptr(), 1, taken.data_ptr()) == -1
    assert fn(10, 0, 0, order.data_ptr(), 0, taken.data_ptr()) == -1
