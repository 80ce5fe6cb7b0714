"""Ranks 1..W-1 of a worker as child processes of rank 0 (`python -m shared.engine.rank_worker`),
joined over a loopback TCPStore. Each child dies with its parent (PR_SET_PDEATHSIG)."""

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import shared
from shared.engine.config import EngineConfig
from shared.errors import ProcessStartError
from shared.parallel.comm import RankComm, open_store
from shared.proc import die_with_parent

READY_TIMEOUT_S = 600.0
SECRET_ENV = "TISON_KV_SECRET"  # EngineConfig.kv_secret, for the ranks (not on command lines)


class RankProcesses:
    """Starts the other ranks; `join` connects rank 0 to them; `stop` ends them."""

    def __init__(
        self, config: EngineConfig, num_pages: int, threads: int, kv_groups: tuple[int, ...]
    ):
        self.shape = config.parallel
        self.device = config.rank_device(0)
        self.world_size = self.shape.world_size
        self.store = open_store("127.0.0.1", 0, self.world_size, is_master=True)
        spec = json.dumps(
            {
                "engine": config.to_json_dict(),
                "num_pages": num_pages,
                "kv_groups": kv_groups,  # capped chunked layers' page groups; () none
            }
        )
        root = str(Path(shared.__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        env["OMP_NUM_THREADS"] = str(threads)
        env[SECRET_ENV] = config.kv_secret
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shared.engine.rank_worker",
                    "--rank",
                    str(rank),
                    "--port",
                    str(self.store.port),
                    "--threads",
                    str(threads),
                    "--spec",
                    spec,
                ],
                env=env,
                preexec_fn=die_with_parent,
            )
            for rank in range(1, self.world_size)
        ]

    def join(self) -> RankComm:
        """Rank 0's groups, once every child has connected. They are made on a thread of their
        own while this one watches the children: a child that dies meanwhile fails the start
        naming it, at once, not after gloo's connect gives up (up to the store's 120 s, then
        with an error about a socket)."""
        self._wait_keys("joined")
        made: Future = Future()

        def make() -> None:
            try:
                made.set_result(RankComm(self.store, 0, self.shape, self.device))
            except BaseException as e:  # raised on the watching thread
                made.set_exception(e)

        threading.Thread(target=make, name="rank-groups", daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                return made.result(timeout=0.02)
            except TimeoutError:
                self._check_children("joined their groups", deadline)
            except Exception:  # a child gone is why: say so
                self._check_children("joined their groups", deadline)
                raise

    def wait_ready(self) -> None:
        """Until every child has loaded its shard; raises if one failed or exited."""
        self._wait_keys("ready")
        for rank in range(1, self.world_size):
            status = self.store.get(f"ready{rank}").decode()
            if status != "ok":
                raise ProcessStartError(f"rank {rank} failed to start: {status}")

    def _wait_keys(self, prefix: str) -> None:
        keys = [f"{prefix}{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.store.check(keys):
            self._check_children(prefix, deadline)
            time.sleep(0.02)

    def _check_children(self, what: str, deadline: float) -> None:
        """ProcessStartError where a child has exited, or the deadline (monotonic) passed."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise ProcessStartError(f"rank {rank} exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise ProcessStartError(f"ranks not {what} after {READY_TIMEOUT_S:.0f} s")

    def stop(self, comm: RankComm | None, stop_plan: bytes, timeout_s: float = 10.0) -> None:
        """Asks every child to exit (if joined), then kills those still running."""
        if comm is not None:
            try:
                comm.send_plan(stop_plan)
            except Exception:  # a rank already gone: the kill below covers it
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
