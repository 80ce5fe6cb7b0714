"""The KV handoff moves pages between prefill and decode workers of different shapes, over shm,
TCP and dist, byte for byte: MLA (one latent replicated on every TP rank), MHA (heads split
across ranks) and a pool whose layer groups differ. Real pools (files in a temporary folder),
real TCP and dist servers and senders; no model: each prefill rank's pool is filled with random
KV."""

import asyncio
import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from shared.engine.plan import PlannedSeq
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.engine.shard import rank_kv_spec, rank_pools, rank_shm_path
from shared.kv import cache
from shared.kv.cache import KVCache
from shared.kv.layer_groups import LayerGroupKVSpec
from shared.kv.spec import MHAKVSpec, MLAKVSpec
from shared.parallel.shape import ParallelConfig
from shared.protocol import KVPool
from shared.transfer import dist, tcp
from shared.transfer.base import host_id
from shared.transfer.error_board import ErrorBoard
from shared.transfer.handoff import KVHandoff
from shared.transfer.pools import map_pools

from services_harness import free_port

SECRET = b"test-secret"
NUM_PAGES, PAGE = 8, 4
PROMPT = 10  # tokens: two steps, [0, 6) then [6, 10)
SRC_PAGES, DST_PAGES = [5, 1, 6], [2, 7, 0]
SPECS = {
    "mla": MLAKVSpec(4, PAGE, kv_lora_rank=16, rope_dim=8, dtype=torch.bfloat16),
    "mha": MHAKVSpec(4, PAGE, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    "groups": LayerGroupKVSpec(
        (
            ((0, 2), MHAKVSpec(2, PAGE, 2, 8, torch.bfloat16)),
            ((1, 3), MHAKVSpec(2, PAGE, 2, 4, torch.bfloat16)),
        )
    ),
}
SHAPES = {  # (prefill, decode) as (tp, pp)
    "tp2->tp1": ((2, 1), (1, 1)),
    "tp1->tp2": ((1, 1), (2, 1)),
    "tp2pp2->tp1": ((2, 2), (1, 1)),
    "tp1->tp2pp2": ((1, 1), (2, 2)),
}


def shape(tp_pp) -> ParallelConfig:
    return ParallelConfig(*tp_pp, allow_oversubscribe=True)


SERVERS = {"tcp": tcp.TcpKVServer, "dist": dist.DistKVServer}


class ServerThread:
    """A decode worker's KV server of a transport on an event loop of its own."""

    def __init__(self, transport, spec, ranks, own=None):
        server = SERVERS[transport]
        self.server = server(spec, map_pools(spec, ranks, own), SECRET, self.allowed)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.address = self._run(self.server.start())

    @staticmethod
    def allowed(request_id, layer, slots) -> bool:
        return request_id == "r" and bool(torch.isin(slots // PAGE, torch.tensor(DST_PAGES)).all())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def close(self):
        self._run(self.server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def steps():
    seq = PlannedSeq("r", 0, list(range(PROMPT)), SRC_PAGES, False)
    return [
        SchedulerOutput([ScheduledRequest(seq, 0, 6, False)]),
        SchedulerOutput([ScheduledRequest(seq, 6, 4, True)]),
    ]


def prefill_ranks(spec, prefill: ParallelConfig, transport: str, board=None):
    gen = torch.Generator().manual_seed(0)
    ranks = []
    for rank in range(prefill.world_size):
        kv = KVCache(rank_kv_spec(spec, prefill, rank), NUM_PAGES)
        kv.data.copy_(torch.randn(kv.data.shape, generator=gen))
        ranks.append(KVHandoff.of_rank(kv, spec, prefill, rank, transport, SECRET, board))
    return ranks


def run_prefill(handoffs: list[KVHandoff], pool: KVPool) -> str | None:
    """What a prefill worker's ranks do: rank 0 adds the target, each plan tells the others,
    each rank calls on_layer after each of its layers (stage order)."""
    handoffs[0].add("r", DST_PAGES, pool)
    for out in steps():
        extras = handoffs[0].plan_extras(out)
        for h in handoffs[1:]:
            h.on_plan(extras)
        for h in sorted(handoffs, key=lambda h: h.layers[0]):
            for layer in range(*h.layers):
                h.on_layer(layer, out)
    return handoffs[0].finish("r")


def expected(spec, handoffs, layer: int) -> torch.Tensor:
    """The whole layer's KV of the prompt, assembled from the writing prefill ranks."""
    src = spec.slots(SRC_PAGES, 0, PROMPT)
    parts = [
        (h.units, h.kv.spec.read(h.kv.data, layer - h.layers[0], src, (0, h.units[1] - h.units[0])))
        for h in handoffs
        if h.writes and h.layers[0] <= layer < h.layers[1]
    ]
    parts.sort(key=lambda p: p[0])
    if isinstance(spec, MLAKVSpec):
        assert len(parts) == 1  # one replica writes
        return parts[0][1]
    return torch.cat([p for _, p in parts], dim=2)  # (2, n, heads, hd)


@pytest.mark.parametrize("transport", ["shm", "tcp", "dist"])
@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("kind", SPECS.keys())
def test_pages_arrive_byte_exact_between_shapes(tmp_path, kind, shapes, transport):
    spec = SPECS[kind]
    prefill, decode = shape(shapes[0]), shape(shapes[1])
    base = tmp_path / "pool"
    pools = [
        KVCache(rank_kv_spec(spec, decode, r), NUM_PAGES, rank_shm_path(base, r))
        for r in range(decode.world_size)
    ]
    ranks = rank_pools(spec, decode, base)
    server = ServerThread(transport, spec, ranks) if transport in SERVERS else None
    at = {transport: server.address} if server else {}
    pool = KVPool(spec.layout, host_id(), ranks, at.get("tcp", ""), at.get("dist", ""))
    handoffs = prefill_ranks(spec, prefill, transport)
    try:
        assert run_prefill(handoffs, pool) is None
        if server is not None:  # every rank's part arrived, and nothing twice
            token_bytes = spec.page_size_bytes // PAGE
            assert server.server.take_received("r") == PROMPT * token_bytes
    finally:
        for h in handoffs:
            h.close()
        if server is not None:
            server.close()
    dst = spec.slots(DST_PAGES, 0, PROMPT)
    for desc, kv in zip(ranks, pools):
        for layer in range(*desc.layers):
            whole = expected(spec, handoffs, layer)
            got = kv.spec.read(kv.data, layer - desc.layers[0], dst, (0, kv.spec.num_units))
            want = spec.narrow(whole, layer, (0, spec.num_units), tuple(desc.units))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (desc, layer)
        others = [p for p in range(NUM_PAGES) if p not in DST_PAGES]
        for layer in range(kv.spec.num_layers):
            rows = kv.spec.read(kv.data, layer, spec.slots(others, 0, len(others) * PAGE), (0, 1))
            assert not rows.any(), "a page nobody reserved was written"
    for kv in pools:
        kv.close()


def test_a_pool_without_room_in_shared_memory(tmp_path, monkeypatch):
    """/dev/shm too small for the pool (a container's 64 MiB): rank 0 of a decode worker keeps
    it in process memory and a prefill worker on the same host sends over TCP, byte exact;
    another rank fails at once, naming the fix (not a SIGBUS at a later KV write)."""
    spec = SPECS["mha"]
    monkeypatch.setattr(cache, "free_bytes", lambda folder: 4096)
    base = tmp_path / "pool"
    with pytest.raises(OSError, match="does not fit the 0 MiB free .* --shm-size"):
        KVCache(spec, NUM_PAGES, base)
    kv = KVCache(spec, NUM_PAGES, base, shm_optional=True)
    assert kv.shm_path is None and not base.exists()
    ranks = rank_pools(spec, shape((1, 1)), base)  # as the worker names them
    server = ServerThread("tcp", spec, ranks, own={0: kv})
    pool = KVPool(spec.layout, host_id(), ranks, tcp=server.address)
    handoffs = prefill_ranks(spec, shape((1, 1)), "auto")
    try:
        assert handoffs[0].transport_to(pool) == "tcp"
        assert run_prefill(handoffs, pool) is None
    finally:
        handoffs[0].close()
        server.close()
    dst = spec.slots(DST_PAGES, 0, PROMPT)
    for layer in range(spec.num_layers):
        got = kv.spec.read(kv.data, layer, dst, (0, spec.num_units))
        assert torch.equal(got, expected(spec, handoffs, layer))


@pytest.mark.parametrize("shapes", [((2, 1), (1, 1)), ((1, 2), (2, 1))], ids=["tp2", "pp2"])
def test_a_failure_on_another_rank_fails_the_request_on_rank_0(tmp_path, shapes):
    """Over shm no decode worker counts bytes: a prefill rank > 0 whose writes failed posts
    why on the ranks' store (a real TCPStore), and rank 0's finish returns it; with no
    failure it returns None and the store holds nothing."""
    spec = SPECS["mha"]
    prefill, decode = shape(shapes[0]), shape(shapes[1])
    base = tmp_path / "pool"
    pools = [
        KVCache(rank_kv_spec(spec, decode, r), NUM_PAGES, rank_shm_path(base, r))
        for r in range(decode.world_size)
    ]
    pool = KVPool(spec.layout, host_id(), rank_pools(spec, decode, base))
    store = TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))
    board = ErrorBoard(store)
    handoffs = prefill_ranks(spec, prefill, "shm", board)
    try:
        assert run_prefill(handoffs, pool) is None
        assert not store.check(["kv_error/r"])

        def broken(target, kv):
            raise OSError("its mapping is gone")

        handoffs[1].senders["shm"].send_layer = broken
        assert run_prefill(handoffs, pool) == "KV transfer failed: its mapping is gone"
        assert not store.check(["kv_error/r"])  # taken
    finally:
        for h in handoffs:
            h.close()
        for kv in pools:
            kv.close()


def test_a_layout_mismatch_or_an_unreachable_pool_fails_the_request_at_add(tmp_path):
    spec = SPECS["mha"]
    [handoff] = prefill_ranks(spec, shape((1, 1)), "auto")
    ranks = rank_pools(spec, shape((1, 1)), tmp_path / "missing")
    other = MHAKVSpec(4, PAGE, 2, 16, torch.bfloat16).layout
    with pytest.raises(ValueError, match="layout"):
        handoff.add("r", DST_PAGES, KVPool(other, host_id(), ranks))
    with pytest.raises(ValueError, match="no auto KV transport"):
        handoff.add("r", DST_PAGES, KVPool(spec.layout, host_id(), ranks))  # file missing
    with pytest.raises(ValueError, match="no KV pool"):
        handoff.add("r", DST_PAGES, None)
    assert handoff.finish("r") == "no KV target"
    handoff.close()


def test_a_broken_decode_pool_fails_that_request_only(tmp_path):
    spec = SPECS["mla"]
    base = tmp_path / "pool"
    kv = KVCache(rank_kv_spec(spec, shape((1, 1)), 0), NUM_PAGES, base)
    pool = KVPool(spec.layout, host_id(), rank_pools(spec, shape((1, 1)), base))
    handoffs = prefill_ranks(spec, shape((1, 1)), "shm")
    kv.close()
    base.write_bytes(b"")  # the decode worker's pool is gone: nothing can be mapped
    error = run_prefill(handoffs, pool)
    assert error and error.startswith("KV transfer failed")
    assert not handoffs[0].targets and not handoffs[0].results


def test_data_parallel_prefill_ranks_send_their_own_requests_then_forget_every_target(tmp_path):
    """--dp 2: request a is rank 0's, b rank 1's, their prompts in the same page ids of each
    rank's pool. Each rank sends its own request's KV (the runner shows it no other); after
    rank 0 finishes both, and its next plan, no rank holds a target."""
    spec = SPECS["mha"]
    base = tmp_path / "pool"
    kv = KVCache(rank_kv_spec(spec, shape((1, 1)), 0), NUM_PAGES, base)
    pool = KVPool(spec.layout, host_id(), rank_pools(spec, shape((1, 1)), base))
    handoffs = prefill_ranks(spec, ParallelConfig(dp=2, allow_oversubscribe=True), "shm")
    dst = {"a": DST_PAGES, "b": [3, 4, 5]}
    for rid, pages in dst.items():
        handoffs[0].add(rid, pages, pool)
    tokens = list(range(PROMPT))
    seqs = [PlannedSeq(rid, 0, tokens, SRC_PAGES, True, dp_rank=r) for r, rid in enumerate(dst)]
    out = SchedulerOutput([ScheduledRequest(seq, 0, PROMPT, True) for seq in seqs])
    handoffs[1].on_plan(handoffs[0].plan_extras(out))
    for rank, h in enumerate(handoffs):
        own = SchedulerOutput([s for s in out.scheduled if s.request.dp_rank == rank])
        for layer in range(*h.layers):
            h.on_layer(layer, own)
    assert [handoffs[0].finish(rid) for rid in dst] == [None, None]
    handoffs[1].on_plan(handoffs[0].plan_extras(SchedulerOutput()))
    assert not any(h.targets or h._sent for h in handoffs)
    src = spec.slots(SRC_PAGES, 0, PROMPT)
    for h, (rid, pages) in zip(handoffs, dst.items()):
        for layer in range(spec.num_layers):
            want = h.kv.spec.read(h.kv.data, layer, src, (0, spec.num_units))
            got = kv.spec.read(kv.data, layer, spec.slots(pages, 0, PROMPT), (0, spec.num_units))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (rid, layer)
    for h in handoffs:
        h.close()
    kv.close()
