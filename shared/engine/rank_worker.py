"""Rank r > 0 of a worker: builds its shard, then runs every step plan rank 0 sends, in order,
until told to stop. The last stage's TP rank 0 samples and sends the tokens back to rank 0.

    python -m shared.engine.rank_worker --rank R --port STORE_PORT --threads N --spec JSON"""

import argparse
import json
import logging
import sys

import torch

from shared.engine.config import EngineConfig
from shared.engine.kv_handoff import rank_pusher
from shared.engine.plan import decode_plan, encode_result
from shared.engine.runner import ModelRunner
from shared.engine.shard import build_shard
from shared.models.config import ModelConfig
from shared.parallel.comm import PLAN, RESULT, RankComm, open_store
from shared.parallel.cores import pin, rank_cores

log = logging.getLogger("tison.rank")


def build_runner(rank: int, port: int, spec: dict):
    """(runner, comm, on_plan) of this rank, once rank 0 and its peers are joined."""
    config = EngineConfig(**spec["engine"])
    shape = config.parallel
    store = open_store("127.0.0.1", port, shape.world_size, is_master=False)
    store.set(f"joined{rank}", "1")
    comm = RankComm(store, rank, shape, config.device)
    try:
        cfg = ModelConfig.from_dir(config.model_dir)
        stage = shape.stage_of(rank, cfg.num_layers)
        model, kv = build_shard(config, cfg, comm.tp, stage, spec["num_pages"], rank)
        runner = ModelRunner(model, kv, cfg.vocab_size, comm.tp, stage, comm)
    except Exception as e:
        store.set(f"ready{rank}", f"{type(e).__name__}: {e}")
        raise
    on_plan = None
    if config.kv_push:
        pusher = rank_pusher(kv, cfg, shape, rank)
        runner.on_layer_done, on_plan = pusher.on_layer, pusher.on_plan
    store.set(f"ready{rank}", "ok")
    return runner, comm, on_plan


def serve(runner: ModelRunner, comm: RankComm, on_plan=None) -> None:
    """Runs plans until the stop plan. on_plan(plan, runner) is called before each step
    (prefill workers register the step's KV targets there)."""
    replies = runner.stage.is_last and runner.tp.rank == 0 and comm.rank != 0
    while True:
        plan = decode_plan(comm.recv_bytes(0, PLAN))
        if plan.stop:
            break
        if on_plan is not None:
            on_plan(plan, runner)
        index, samples = runner.execute(plan.scheduler_output(), plan.rows)
        if replies:
            reply = encode_result(plan.micro_batch, index, samples, runner.busy_s)
            comm.send_bytes(reply, 0, RESULT)
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
    config = EngineConfig(**spec["engine"])
    if config.cpus:  # this rank's share of the worker's cores, one thread per core
        pin(rank_cores(config.cpus, config.parallel.world_size, args.rank))
    else:
        torch.set_num_threads(args.threads)
    runner, comm, on_plan = build_runner(args.rank, args.port, spec)
    try:
        serve(runner, comm, on_plan)
    finally:
        runner.kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
