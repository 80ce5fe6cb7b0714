"""A model-running worker process: prefill, decode, or both over one engine (colocated)."""

import asyncio
import contextlib
import functools
import logging
import os
import uuid
from pathlib import Path

import torch

from services.nats_client import connect_nats
from services.runtime import freeze_heap
from services.worker.config import WorkerConfig
from services.worker.decode import DecodeRole
from services.worker.kv_events import KVEventsPublisher
from services.worker.loop import EngineLoop
from services.worker.peer_weights import Weights, WeightsAnnouncer, resolve_weights
from services.worker.prefill import PrefillRole
from shared import protocol, subjects
from shared.engine.config import EngineConfig
from shared.engine.device import resolve as resolve_device
from shared.engine.engine import LLMEngine
from shared.engine.shard import rank_pools
from shared.protocol import HeartbeatMsg, KVPool, PrefixStats
from shared.tokenizer.tokenizer import Tokenizer
from shared.transfer import dist, tcp
from shared.transfer.base import host_id
from shared.transfer.pools import map_pools

log = logging.getLogger(__name__)
SHM_PREFIX = "tison-kv-"


def build_engine(config: WorkerConfig, shm_path: Path | None, weights: Weights) -> LLMEngine:
    engine_config = EngineConfig(
        model_dir=weights.model_dir,
        dtype=config.dtype,
        device=config.device,
        gpu_memory_utilization=config.gpu_memory_utilization,
        decode_graphs="off" if config.enforce_eager else "auto",
        resident_codec=config.resident_codec,
        page_size=config.page_size,
        kv_cache_bytes=config.kv_cache_bytes,
        memory_bytes=config.memory_bytes,
        enable_prefix_caching=config.enable_prefix_caching,
        num_pages=config.num_pages,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        kv_shm_path=shm_path,
        tp=config.tp,
        pp=config.pp,
        pp_layers=config.pp_layers,
        ep=config.ep,
        dp=config.dp,
        allow_oversubscribe=config.allow_oversubscribe,
        cpus=config.cpus,
        kv_push=config.role != "decode",
        kv_transport=config.kv_transport,
        kv_secret=config.kv_secret,
        weights_peer=weights.peer,
        weights_timeout_s=config.weights_timeout_s,
    )
    eos = Tokenizer.from_dir(weights.model_dir).eos_token_ids
    return LLMEngine(engine_config, extra_eos_ids=eos)


async def run_worker(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Serves the configured role(s) until `stop` is set."""
    ids = config.role_ids()
    shm_path = None
    if "decode" in ids and resolve_device(config.device) == "cpu":  # a GPU pool: cuda_ipc
        remove_stale_pools(config.shm_dir)
        shm_path = config.shm_dir / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    weights = await resolve_weights(config)
    engine = await asyncio.to_thread(build_engine, config, shm_path, weights)
    freeze_heap()
    secret = config.kv_secret.encode() or None
    roles: list = []
    loop = EngineLoop(engine, lambda outputs: _dispatch(roles, outputs))
    nc = await connect_nats(config.nats_url, f"tison-{config.worker_id}", config.nats)
    announcer = None
    kv_servers: dict = {}  # transport name -> the decode worker's server of it (with a secret)
    try:
        if secret and not weights.peer:  # weights on disk: served to new workers of the model
            announcer = await WeightsAnnouncer.start(nc, config, weights.model_dir)
        if "decode" in ids:  # a CPU pool in shared memory, or GPU pools' CUDA IPC handles
            handles = engine.executor.pool_handles() if shm_path is None else ()
            shape, groups = engine.config.parallel, engine.kv_groups
            ranks = rank_pools(engine.kv_spec, shape, shm_path, handles, groups)
            if secret:
                kv_servers = _kv_servers(engine, ranks, secret)
            at = {
                name: await server.start(config.kv_host, toward=config.nats_url)
                for name, server in kv_servers.items()
            }
            tcp_at, dist_at = at.get(tcp.NAME, ""), at.get(dist.NAME, "")
            # one pool of all ranks; with --dp, one a rank: a request's pages are in one
            layout, host = engine.kv_spec.layout, host_id()
            parts = [ranks] if shape.dp == 1 else [(rank,) for rank in ranks]
            pools = tuple(KVPool(layout, host, part, tcp_at, dist_at) for part in parts)
            servers, lease = tuple(kv_servers.values()), config.reservation_lease_s
            roles.append(DecodeRole(nc, loop, ids["decode"], pools, servers, lease))
        if "prefill" in ids:
            roles.append(PrefillRole(nc, loop, ids["prefill"], engine.handoff, ids.get("decode")))
        for role in roles:
            await role.subscribe()
        # The engine's events are read between steps, by its loop: it is their one owner.
        events = functools.partial(loop.call, engine.kv_events)
        kv_events = KVEventsPublisher(nc, ids, events, config.heartbeat_s)
        await kv_events.subscribe()
        tasks = [
            asyncio.create_task(loop.run()),
            asyncio.create_task(_heartbeats(nc, config, engine, roles, tuple(kv_servers.values()))),
            asyncio.create_task(kv_events.run()),
        ]
        log.info("worker %s serving %s", config.worker_id, ", ".join(ids.values()))
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, loop.handlers.cancel_all(), return_exceptions=True)
    finally:
        for server in kv_servers.values():
            await server.close()
        if announcer is not None:
            await asyncio.to_thread(announcer.close)
        with contextlib.suppress(Exception):
            await nc.drain()
        await asyncio.to_thread(engine.close)


async def _dispatch(roles: list, outputs) -> None:
    for role in roles:
        await role.on_outputs(outputs)


def _kv_servers(engine: LLMEngine, ranks, secret: bytes) -> dict:
    """The decode worker's network KV servers by transport, not started: each writes frames
    into every rank's pool and counts each request's bytes (DecodeRole sums them)."""
    pools = map_pools(engine.kv_spec, ranks, own={0: engine.kv})
    allowed = _reserved_check(engine)
    rank_of = engine.dp_rank if engine.config.dp > 1 else None  # a request's pages: one rank's
    return {
        tcp.NAME: tcp.TcpKVServer(engine.kv_spec, pools, secret, allowed, rank_of),
        dist.NAME: dist.DistKVServer(engine.kv_spec, pools, secret, allowed, rank_of),
    }


def _reserved_check(engine: LLMEngine):
    """Whether slots of a KV frame of a layer lie in pages reserved for its request (KV
    servers): a capped chunked layer's in its page group's."""
    page_size = engine.kv_spec.page_size

    def allowed(request_id: str, layer: int, dst: torch.Tensor) -> bool:
        pages = engine.reserved_pages(request_id, layer)
        if pages is None or len(dst) == 0:
            return False
        return bool(torch.isin(dst // page_size, torch.as_tensor(pages)).all())

    return allowed


async def _heartbeats(nc, config: WorkerConfig, engine: LLMEngine, roles, kv_servers) -> None:
    while True:
        load = engine.load()
        prefix = PrefixStats(**engine.prefix_stats())
        for role in roles:
            handoff = getattr(role, "handoff", None)
            moved = (handoff.bytes_sent, handoff.seconds) if handoff else (0, 0.0)
            if kv_servers and role.role == "decode":
                moved = (
                    sum(s.bytes_received for s in kv_servers),
                    sum(s.seconds for s in kv_servers),
                )
            beat = HeartbeatMsg(
                worker_id=role.worker_id,
                role=role.role,
                model=config.name,
                max_model_len=engine.max_model_len,
                interval_s=config.heartbeat_s,
                page_size=engine.config.page_size,
                kv_transfer_bytes=moved[0],
                kv_transfer_seconds=moved[1],
                local_prefill=role.role == "decode",
                prefix=prefix,
                dropped_messages=protocol.DROPPED.total(),
                **load,
            )
            await nc.publish(subjects.heartbeat(role.role, role.worker_id), protocol.encode(beat))
        await asyncio.sleep(config.heartbeat_s)


def remove_stale_pools(shm_dir: Path) -> None:
    """Unlinks KV pool files left by decode workers that died (kill -9) on this host."""
    for path in shm_dir.glob(f"{SHM_PREFIX}*"):
        pid = path.name[len(SHM_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()
