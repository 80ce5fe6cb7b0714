"""Rank r > 0 of a worker: builds its shard, then runs every step plan rank 0 sends, in order,
until told to stop. The last stage's TP rank 0 samples and sends the tokens (and the prompt
logprobs) back to rank 0.

    python -m shared.engine.rank_worker --rank R --port STORE_PORT --threads N --spec JSON"""

import argparse
import json
import logging
import os
import sys

import torch

from shared.engine import device as devices
from shared.engine.config import EngineConfig
from shared.engine.executor import pool_handle, rank_handoff, stage_runner
from shared.engine.plan import decode_plan, encode_result
from shared.engine.ranks import SECRET_ENV
from shared.engine.runner import ModelRunner
from shared.engine.shard import build_shard, model_kv_spec
from shared.models.config import ModelConfig
from shared.parallel.comm import RankComm, open_store
from shared.parallel.cores import pin, rank_cores
from shared.sampling.token_mask import ready
from shared.transfer.handoff import KVHandoff

log = logging.getLogger("tison.rank")


def build_runner(rank: int, port: int, spec: dict):
    """(runner, comm, handoff) of this rank, once rank 0 and its peers are joined."""
    secret = os.environ.get(SECRET_ENV, "")  # not on the command line, where ps shows it
    config = EngineConfig(**spec["engine"], kv_secret=secret)
    shape = config.parallel
    devices.use(config.rank_device(rank))
    store = open_store("127.0.0.1", port, shape.world_size, is_master=False)
    store.set(f"joined{rank}", "1")
    comm = RankComm(store, rank, shape, config.rank_device(rank))
    try:
        cfg = ModelConfig.from_dir(config.model_dir)
        stage = shape.stage_of(rank, cfg.num_layers)
        model, kv = build_shard(
            config, cfg, comm.tp, stage, spec["num_pages"], rank, tuple(spec["kv_groups"])
        )
        kv_spec = model_kv_spec(cfg, config.page_size, kv.spec.dtype)
        handoff = rank_handoff(config, kv_spec, kv, rank, store)
        hook = None if handoff is None else handoff.on_layer
        runner = stage_runner(
            config, cfg, model, kv, spec["num_pages"], comm.tp, stage, comm, hook, comm.dp
        )
    except Exception as e:
        store.set(f"ready{rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"kv_ipc{rank}", pool_handle(kv))  # a GPU decode worker advertises it
    store.set(f"ready{rank}", "ok")
    return runner, comm, handoff


def serve(runner: ModelRunner, comm: RankComm, handoff: KVHandoff | None = None) -> None:
    """Runs plans until the stop plan. A prefill worker's handoff learns of new and dropped
    KV targets from each plan before its step."""
    replies = runner.samples and comm.rank != 0
    while True:
        plan = decode_plan(comm.recv_plan())
        if plan.stop:
            break
        if handoff is not None:
            handoff.on_plan(plan.push)
        masks = None if plan.masks is None else ready(plan.masks)
        index, samples, prompt = runner.execute(plan.scheduler_output(), plan.rows, masks)
        if replies:
            reply = encode_result(plan.micro_batch, index, samples, runner.busy_s, prompt)
            comm.send_result(reply)
    comm.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rank_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--spec", required=True, help="JSON: engine config and pool size")
    args = parser.parse_args(argv)
    logging.basicConfig(level="INFO", format=f"%(asctime)s rank{args.rank} %(message)s")
    spec = json.loads(args.spec)
    config = EngineConfig(**spec["engine"], kv_secret=os.environ.get(SECRET_ENV, ""))
    if config.cpus:  # this rank's share of the worker's cores, one thread per core
        pin(rank_cores(config.cpus, config.parallel.world_size, args.rank))
    else:
        torch.set_num_threads(args.threads)
    runner, comm, handoff = build_runner(args.rank, args.port, spec)
    try:
        serve(runner, comm, handoff)
    finally:
        if handoff is not None:
            handoff.close()
        runner.kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
