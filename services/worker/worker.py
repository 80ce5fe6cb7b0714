"""A model-running worker process: prefill, decode, or both over one engine (colocated)."""

import asyncio
import contextlib
import logging
import os
import uuid
from pathlib import Path

import nats
import torch

from services.worker.config import WorkerConfig
from services.worker.decode import DecodeRole
from services.worker.handoff import Handoff
from services.worker.kv_push import KVPusher
from services.worker.loop import EngineLoop
from services.worker.prefill import PrefillRole
from shared import protocol, subjects
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv_handoff import (
    RANKS_ENDPOINT,
    RankPool,
    describe_ranks,
    model_layout,
    rank_pusher,
)
from shared.engine.shard import rank_shm_path
from shared.protocol import HeartbeatMsg
from shared.tokenizer.tokenizer import Tokenizer
from shared.transfer import shm, tcp
from shared.transfer.base import host_id, slots

log = logging.getLogger(__name__)
SHM_PREFIX = "tison-kv-"


def build_engine(config: WorkerConfig, shm_path: Path | None) -> LLMEngine:
    engine_config = EngineConfig(
        model_dir=config.model_dir,
        dtype=config.dtype,
        page_size=config.page_size,
        kv_cache_bytes=config.kv_cache_bytes,
        num_pages=config.num_pages,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        kv_shm_path=shm_path,
        tp=config.tp,
        pp=config.pp,
        pp_layers=config.pp_layers,
        allow_oversubscribe=config.allow_oversubscribe,
        cpus=config.cpus,
        kv_push=config.role != "decode",
    )
    eos = Tokenizer.from_dir(config.model_dir).eos_token_ids
    return LLMEngine(engine_config, extra_eos_ids=eos)


async def run_worker(config: WorkerConfig, stop: asyncio.Event) -> None:
    """Serves the configured role(s) until `stop` is set."""
    ids = config.role_ids()
    shm_path = None
    if "decode" in ids:
        remove_stale_pools(config.shm_dir)
        shm_path = config.shm_dir / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    engine = await asyncio.to_thread(build_engine, config, shm_path)
    secret = config.kv_secret.encode() or None
    roles: list = []
    loop = EngineLoop(engine, lambda outputs: _dispatch(roles, outputs))
    nc = await nats.connect(
        config.nats_url, name=f"tison-{config.worker_id}", max_reconnect_attempts=-1
    )
    layout = model_layout(engine.model_config, engine.config.page_size, engine.dtype)
    endpoints = {"layout": layout, "host": host_id()}
    single = engine.config.parallel.world_size == 1
    tcp_server = None
    try:
        if "decode" in ids:
            decode_endpoints = dict(endpoints, **{shm.ENDPOINT: str(shm_path)})
            decode_endpoints[RANKS_ENDPOINT] = _rank_pools(engine, shm_path)
            if secret and single:  # TCP: one-rank decode workers only
                tcp_server = tcp.TcpKVServer(engine.kv.data, secret, _reserved_check(engine))
                decode_endpoints[tcp.ENDPOINT] = await tcp_server.start(config.kv_host)
            roles.append(DecodeRole(nc, loop, ids["decode"], decode_endpoints))
        if "prefill" in ids:
            pusher = _handoff(engine, secret, config.kv_transport, layout)
            engine.runner.on_layer_done = pusher.on_layer
            engine.executor.plan_extras = pusher.ranks.plan_extras
            roles.append(PrefillRole(nc, loop, ids["prefill"], pusher, ids.get("decode")))
        for role in roles:
            await role.subscribe()
        tasks = [
            asyncio.create_task(loop.run()),
            asyncio.create_task(_heartbeats(nc, config, engine, roles, endpoints, tcp_server)),
        ]
        log.info("worker %s serving %s", config.worker_id, ", ".join(ids.values()))
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, loop.handlers.cancel_all(), return_exceptions=True)
    finally:
        if tcp_server is not None:
            await tcp_server.close()
        with contextlib.suppress(Exception):
            await nc.drain()
        await asyncio.to_thread(engine.close)


def _handoff(engine: LLMEngine, secret, transport: str, layout: str) -> Handoff:
    shape = engine.config.parallel
    single = None
    if shape.world_size == 1:
        single = KVPusher(engine.kv, secret, transport)
    ranks = rank_pusher(engine.kv, engine.model_config, shape, 0)
    return Handoff(single, ranks, layout, transport)


def _rank_pools(engine: LLMEngine, shm_path: Path) -> str:
    """Each rank's layers, heads and pool file, for prefill workers of any shape."""
    shape, cfg = engine.config.parallel, engine.model_config
    return describe_ranks(
        [
            RankPool.of(cfg, shape, rank, str(rank_shm_path(shm_path, rank)))
            for rank in range(shape.world_size)
        ]
    )


async def _dispatch(roles: list, outputs) -> None:
    for role in roles:
        await role.on_outputs(outputs)


def _reserved_check(engine: LLMEngine):
    def allowed(request_id: str, dst: torch.Tensor) -> bool:
        req = engine.scheduler.reserved.get(request_id)
        if req is None or len(dst) == 0:
            return False
        mine = slots(
            req.page_ids, 0, len(req.page_ids) * engine.kv.spec.page_size, engine.kv.spec.page_size
        )
        return bool(torch.isin(dst, mine).all())

    return allowed


async def _heartbeats(
    nc, config: WorkerConfig, engine: LLMEngine, roles, endpoints, tcp_server
) -> None:
    while True:
        load = engine_load(engine)
        for role in roles:
            pusher = getattr(role, "pusher", None)
            moved = (pusher.bytes_sent, pusher.seconds) if pusher else (0, 0.0)
            if tcp_server is not None and role.role == "decode":
                moved = (tcp_server.bytes_received, tcp_server.seconds)
            beat = HeartbeatMsg(
                worker_id=role.worker_id,
                role=role.role,
                model=config.name,
                max_model_len=engine.max_model_len,
                interval_s=config.heartbeat_s,
                page_size=engine.config.page_size,
                endpoints=getattr(role, "endpoints", endpoints),
                kv_transfer_bytes=moved[0],
                kv_transfer_seconds=moved[1],
                local_prefill=role.role == "decode",
                **load,
            )
            await nc.publish(subjects.heartbeat(role.role, role.worker_id), protocol.encode(beat))
        await asyncio.sleep(config.heartbeat_s)


def engine_load(engine: LLMEngine) -> dict:
    sched = engine.scheduler
    queued = sum(
        r.num_prompt_tokens - min(r.num_computed_tokens, r.num_prompt_tokens)
        for r in list(sched.waiting)
    )
    return dict(
        queued_tokens=queued,
        running_seqs=len(sched.running) + len(sched.reserved),
        decoding_seqs=len(sched.running),
        free_pages=engine.allocator.num_free,
        total_pages=engine.allocator.num_pages,
    )


def remove_stale_pools(shm_dir: Path) -> None:
    """Unlinks KV pool files left by decode workers that died (kill -9) on this host."""
    for path in shm_dir.glob(f"{SHM_PREFIX}*"):
        pid = path.name[len(SHM_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                path.unlink()
