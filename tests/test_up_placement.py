"""`tison up`'s core plan (services/up/placement.py): disjoint core sets covering the machine,
the mode it picks, overrides and their errors; and workers that really run on their cores."""

import pytest

from services.up.placement import Request, place, service_core_count
from shared.errors import InvalidRequestError
from shared.parallel.cores import format_cpulist, parse_cpulist, rank_cores


def cores_of(placement) -> dict[str, tuple[int, ...]]:
    return {w.name: w.cores for w in placement.workers}


def assert_disjoint(placement) -> None:
    sets = [set(w.cores) for w in placement.workers] + [set(placement.services)]
    seen: set[int] = set()
    for s in sets:
        assert not (s & seen), f"overlap in {placement}"
        seen |= s


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 16, 32, 64])
@pytest.mark.parametrize("workers", [(1, 1), (2, 1), (1, 3)])
def test_plan_gives_disjoint_core_sets_that_cover_the_machine(n, workers):
    cores = tuple(range(n))
    p, d = workers
    if n < p + d:
        return
    placement = place(Request(cores, prefill_workers=p, decode_workers=d))
    assert placement.mode == "disaggregated"
    workers = [set(w.cores) for w in placement.workers]
    assert sum(map(len, workers)) == len(set().union(*workers))  # workers never share a core
    used = set(placement.services).union(*(w.cores for w in placement.workers))
    assert used == set(cores)  # nothing idle
    if service_core_count(n):
        assert len(placement.services) == service_core_count(n)
        assert_disjoint(placement)
    else:  # the services share the prefill workers' cores, never decode's
        prefill = {c for w in placement.workers if w.role == "prefill" for c in w.cores}
        assert set(placement.services) == prefill
    assert all(w.cores for w in placement.workers)
    prefill = sum(len(w.cores) for w in placement.workers if w.role == "prefill")
    decode = sum(len(w.cores) for w in placement.workers if w.role == "decode")
    assert decode >= d and prefill >= p
    if n >= 2 * max(p, d) + service_core_count(n):
        assert abs(prefill - decode) <= 1  # an even split when both roles fit


def test_two_cores_one_each_and_services_beside_prefill():
    placement = place(Request((0, 1)))
    assert cores_of(placement) == {"prefill-0": (0,), "decode-0": (1,)}
    assert placement.services == (0,)
    text = "\n".join(placement.describe())
    assert "prefill-0: CPU 0 (1 thread)" in text and "NATS: CPU 0" in text


def test_one_core_or_too_few_runs_colocated():
    placement = place(Request((5,)))
    assert placement.mode == "colocated"
    assert cores_of(placement) == {"colocated-0": (5,)}
    # two ranks per worker on two cores: not enough for prefill and decode
    assert place(Request((0, 1), prefill_ranks=2, decode_ranks=2)).mode == "colocated"


def test_colocated_workers_share_the_cores_evenly():
    placement = place(Request(tuple(range(8)), mode="colocated", prefill_workers=2))
    assert cores_of(placement) == {"colocated-0": (0, 1, 2, 3), "colocated-1": (4, 5, 6)}
    assert placement.services == (7,)


def test_explicit_cores_and_the_rest():
    both = place(Request(tuple(range(8)), cores_prefill=(0, 1), cores_decode=(2, 3, 4)))
    assert cores_of(both) == {"prefill-0": (0, 1), "decode-0": (2, 3, 4)}
    assert both.services == (5, 6, 7)  # what the workers were not given
    one = place(Request(tuple(range(8)), cores_decode=(0,)))
    assert cores_of(one) == {"decode-0": (0,), "prefill-0": (1, 2, 3, 4, 5, 6)}
    assert one.services == (7,)
    assert_disjoint(one)


def test_bad_plans_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--cores-prefill: CPU 9 not available"):
        place(Request((0, 1), cores_prefill=(9,)))
    with pytest.raises(ValueError, match="overlap"):
        place(Request((0, 1, 2), cores_prefill=(0, 1), cores_decode=(1, 2)))
    with pytest.raises(ValueError, match="2 cores cannot give 1 prefill and 2 decode rank"):
        place(Request((0, 1), mode="disaggregated", decode_ranks=2))
    with pytest.raises(ValueError, match="a core per rank"):
        place(Request((0, 1, 2), mode="colocated", prefill_workers=2, decode_ranks=2))
    with pytest.raises(ValueError, match="--mode"):
        place(Request((0, 1), mode="fast"))
    shared = place(Request((0,), mode="disaggregated", allow_oversubscribe=True))
    assert cores_of(shared) == {"prefill-0": (0,), "decode-0": (0,)}


def test_threads_flag_means_unpinned():
    placement = place(Request((0, 1), pinned=False))
    assert all(w.cores == () for w in placement.workers) and placement.services == ()


def test_cpulists_and_rank_shares():
    assert parse_cpulist("0-3,8") == (0, 1, 2, 3, 8)
    assert format_cpulist((8, 0, 1, 2, 3)) == "0-3,8"
    for bad in ("", "3-1", "a", "1,1", "-2"):
        with pytest.raises(InvalidRequestError, match="--cpus"):
            parse_cpulist(bad)
    assert [rank_cores((0, 1, 2, 3, 4), 2, r) for r in range(2)] == [(0, 1, 2), (3, 4)]
    assert [rank_cores((0, 1), 4, r) for r in range(4)] == [(0,), (1,), (0,), (1,)]
