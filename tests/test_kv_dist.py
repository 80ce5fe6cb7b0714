"""The dist KV transport (shared/transfer/dist.py) on gloo over loopback: pages move byte-exact
from a sender in another process and `finish` returns once they are in the pool; a wrong secret
is refused with a clear error, in the store and in the group; frames outside a request's pages
are dropped while the pair goes on; a broken pair fails its request only; close() ends every
thread. test_kv_handoff.py runs it between prefill and decode workers of different shapes,
test_parallel_services.py between real workers."""

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as torch_dist

from shared.engine.shard import rank_kv_spec, rank_pools, rank_shm_path
from shared.kv.cache import KVCache
from shared.kv.spec import MHAKVSpec, MLAKVSpec
from shared.parallel.shape import ParallelConfig
from shared.protocol import KVPool
from shared.transfer import auth, dist, dist_pair
from shared.transfer.base import KVTarget, LayerKV, host_id
from shared.transfer.dist_pair import SENDER, SERVER
from shared.transfer.handoff import KVHandoff
from shared.transfer.pools import map_pools

from waiting import wait_until

SECRET = b"test-secret"
NUM_PAGES, PAGE = 8, 4
SPECS = {
    "mha": MHAKVSpec(3, PAGE, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    "mla": MLAKVSpec(3, PAGE, kv_lora_rank=16, rope_dim=8, dtype=torch.bfloat16),
}
DECODE = ParallelConfig(2, 1, allow_oversubscribe=True)  # MHA: a head each; MLA: both whole
REQUESTS = {"a": (2, 5), "b": (7, 0, 3)}  # request id -> its reserved pages


@pytest.fixture
def pools(tmp_path):
    """The decode worker's rank pools, in files: (their KVRankPools, their KVCaches)."""
    caches = {}

    def make(spec):
        base = tmp_path / "pool"
        caches[spec] = [
            KVCache(rank_kv_spec(spec, DECODE, r), NUM_PAGES, rank_shm_path(base, r))
            for r in range(DECODE.world_size)
        ]
        return rank_pools(spec, DECODE, base), caches[spec]

    yield make
    for kvs in caches.values():
        for kv in kvs:
            kv.close()


def reserved(request_id: str, layer: int, slots: torch.Tensor) -> bool:
    """The decode worker's check: slots in the pages reserved for the request."""
    pages = REQUESTS.get(request_id, ())
    return bool(torch.isin(slots // PAGE, torch.tensor(pages, dtype=torch.long)).all())


@contextlib.contextmanager
def serving(spec, ranks, allowed=reserved):
    server = dist.DistKVServer(spec, map_pools(spec, ranks), SECRET, allowed)
    address = asyncio.run(server.start())
    try:
        yield server, KVPool(spec.layout, "another-host", ranks, dist=address)
    finally:
        asyncio.run(server.close())


def frames(spec, request_id: str, pages) -> list[LayerKV]:
    """A request's KV, every layer and unit, its last page all but full: random, the same in
    every process."""
    gen = torch.Generator().manual_seed(sum(map(ord, request_id)))
    tokens = len(pages) * PAGE - 1
    slots = spec.slots(pages, 0, tokens)
    units = (0, spec.num_units)
    return [
        LayerKV(layer, units, slots, torch.randn(shape, generator=gen).to(spec.dtype))
        for layer in range(spec.num_layers)
        for shape in [spec.payload_shape(layer, tokens, units)]
    ]


def assert_in_pools(spec, ranks, caches, request_id: str) -> None:
    """Every decode rank holds its part of the request's KV, byte for byte."""
    for desc, kv in zip(ranks, caches):
        for frame in frames(spec, request_id, REQUESTS[request_id]):
            got = kv.spec.read(kv.data, frame.layer, frame.slots, (0, kv.spec.num_units))
            want = spec.narrow(frame.payload, frame.layer, frame.units, tuple(desc.units))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (desc, frame.layer)


def send_requests(kind: str, ranks, address: str) -> int:
    """Another process: a prefill rank sends both requests; after each `finish` the decode
    pools (mapped here, as shm files) must hold the request's KV. Returns the bytes sent."""
    spec = SPECS[kind]
    pool = KVPool(spec.layout, "another-host", ranks, dist=address)
    mapped = map_pools(spec, ranks)
    sender, sent = dist.DistSender(SECRET), 0
    for rid, pages in REQUESTS.items():
        target = KVTarget(rid, pages, pool, dist.NAME)
        for frame in frames(spec, rid, pages):
            sent += sender.send_layer(target, frame)
        sender.finish(target)
        assert_in_pools(spec, ranks, mapped, rid)
    sender.close()
    return sent


def slowly_reserved(request_id: str, layer: int, slots: torch.Tensor) -> bool:
    """A server that lags its sender: `finish` must wait for the last frame's write."""
    time.sleep(0.05)
    return reserved(request_id, layer, slots)


@pytest.mark.parametrize("kind", SPECS.keys())
def test_pages_arrive_byte_exact_from_another_process(pools, kind):
    spec = SPECS[kind]
    ranks, caches = pools(spec)
    with serving(spec, ranks, slowly_reserved) as (server, pool):
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
            sent = child.submit(send_requests, kind, ranks, pool.dist).result(timeout=60)
        got = {rid: server.take_received(rid) for rid in REQUESTS}
    for rid in REQUESTS:
        assert_in_pools(spec, ranks, caches, rid)
    token_bytes = spec.page_size_bytes // PAGE
    assert got == {rid: (len(pages) * PAGE - 1) * token_bytes for rid, pages in REQUESTS.items()}
    assert sum(got.values()) == sent == server.bytes_received


def send(sender, spec, pool, request_id: str, pages=None) -> None:
    pages = pages or REQUESTS[request_id]
    target = KVTarget(request_id, pages, pool, dist.NAME)
    for frame in frames(spec, request_id, pages):
        sender.send_layer(target, frame)
    sender.finish(target)


def test_a_wrong_secret_is_refused_before_any_group_and_the_next_sender_served(
    pools, monkeypatch, caplog
):
    spec = SPECS["mha"]
    ranks, caches = pools(spec)
    built = []  # ranks that built a group
    real = dist_pair.process_group
    monkeypatch.setattr(dist_pair, "process_group", lambda *a: built.append(a[1]) or real(*a))
    with serving(spec, ranks) as (server, pool):
        started = time.monotonic()
        with pytest.raises(auth.SecretRefusedError, match="refused the secret"):
            send(dist.DistSender(b"wrong", timeout_s=5), spec, pool, "a")
        assert time.monotonic() - started < 5
        wait_until(lambda: "failed authentication" in caplog.text, 5, "the server's warning")
        assert built == []
        sender = dist.DistSender(SECRET)
        send(sender, spec, pool, "a")
        sender.close()
        assert server.take_received("a") > 0 and sorted(built) == [SERVER, SENDER]
    assert_in_pools(spec, ranks, caches, "a")


def test_a_group_peer_without_the_secret_is_dropped(pools, caplog):
    """Whoever takes the sender's place in the group's own meeting must answer too."""
    spec = SPECS["mla"]
    ranks, _ = pools(spec)
    with serving(spec, ranks) as (server, pool):
        host, port = pool.dist.rsplit(":", 1)
        client = torch_dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        store = torch_dist.PrefixStore(f"pair/{client.add(dist_pair.PAIRS, 1)}", client)
        store.set("answer", auth.answer(SECRET, store.get("nonce")))
        assert store.get("verdict") == auth.ACCEPTED
        group = dist_pair.process_group(store, SENDER, 2, "cpu", timedelta(seconds=5))
        nonce = torch.empty(auth.NONCE_BYTES, dtype=torch.uint8)
        dist_pair.exchange(group, SERVER, [], nonce)
        dist_pair.exchange(group, SERVER, [torch.zeros(auth.NONCE_BYTES, dtype=torch.uint8)])
        with pytest.raises(RuntimeError):  # the server closed the pair
            header = torch.tensor([dist.DONE, 0, 0, 0, 0, 0, 0])
            dist_pair.exchange(group, SERVER, [header], torch.zeros(1, dtype=torch.int64))
        assert "its group's peer failed authentication" in caplog.text
        assert server.bytes_received == 0


def test_frames_outside_the_reserved_pages_are_dropped_and_the_pair_goes_on(pools, caplog):
    spec = SPECS["mha"]
    ranks, caches = pools(spec)
    with serving(spec, ranks) as (server, pool):
        sender = dist.DistSender(SECRET)
        send(sender, spec, pool, "x", pages=(1, 4))  # no pages reserved for it
        send(sender, spec, pool, "b", pages=(1,))  # not its pages
        send(sender, spec, pool, "a")  # the same pair
        assert server.take_received("x") == server.take_received("b") == 0
        assert server.take_received("a") == server.bytes_received > 0
        assert caplog.text.count("outside request 'x'") == spec.num_layers
        sender.close()
    for kv in caches:
        rows = kv.spec.read(kv.data, 0, spec.slots((1, 4), 0, 2 * PAGE), (0, 1))
        assert not rows.any(), "a page nobody reserved was written"


def test_a_broken_pair_fails_its_request_and_the_next_meets_the_server_again(pools):
    spec = SPECS["mla"]
    ranks, caches = pools(spec)
    with serving(spec, ranks) as (server, pool):
        sender = dist.DistSender(SECRET)
        send(sender, spec, pool, "a")
        with server._lock:  # the connection breaks under the pair
            groups = list(server._groups.values())
        for group in groups:
            dist_pair.abort(group)
        with pytest.raises(RuntimeError):
            send(sender, spec, pool, "b")
        send(sender, spec, pool, "b")
        sender.close()
    assert_in_pools(spec, ranks, caches, "a")
    assert_in_pools(spec, ranks, caches, "b")


def test_close_ends_every_thread_and_pair(pools):
    spec = SPECS["mha"]
    ranks, _ = pools(spec)
    before = set(threading.enumerate())
    server = dist.DistKVServer(spec, map_pools(spec, ranks), SECRET, reserved)
    pool = KVPool(spec.layout, host_id(), ranks, dist=asyncio.run(server.start()))
    sender = dist.DistSender(SECRET, timeout_s=5)
    send(sender, spec, pool, "a")  # its pair now waits for the next frame
    host, port = pool.dist.rsplit(":", 1)
    idle = torch_dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    idle.add(dist_pair.PAIRS, 1)  # a pair nobody answers for
    threads = lambda: [t for t in threading.enumerate() if t.name.startswith("dist-kv")]
    wait_until(lambda: len(threads()) == 3, 5, "the watcher and both pairs' threads")
    started = time.monotonic()
    asyncio.run(server.close())
    assert time.monotonic() - started < 1.5
    assert set(threading.enumerate()) <= before
    with pytest.raises(RuntimeError):  # its pair is gone
        send(sender, spec, pool, "a")


def test_dist_is_chosen_by_name_only(tmp_path):
    spec = SPECS["mha"]
    prefill = ParallelConfig(1, 1)
    kv = KVCache(rank_kv_spec(spec, prefill, 0), NUM_PAGES)
    ranks = rank_pools(spec, prefill, tmp_path / "missing")  # not on this host
    both = KVPool(spec.layout, host_id(), ranks, tcp="h:1", dist="h:2")

    def handoff(transport, secret=SECRET):
        return KVHandoff.of_rank(kv, spec, prefill, 0, transport, secret)

    assert handoff("auto").transport_to(both) == "tcp"
    assert handoff("dist").transport_to(both) == "dist"
    with pytest.raises(ValueError, match="its dist server: none"):
        handoff("dist").transport_to(KVPool(spec.layout, host_id(), ranks, tcp="h:1"))
    with pytest.raises(ValueError, match="is a KV secret set"):
        handoff("dist", secret=None).transport_to(both)
