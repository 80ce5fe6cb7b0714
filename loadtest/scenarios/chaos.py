"""Chaos against a real `tison up` (issue #23): `tison up` on the bundled model; for each victim
in turn (decode, prefill, scheduler, gateway, nats-server) a burst: `--streams` streaming
completions (`ignore_eos`, `--max-tokens`) and, once tokens flow on them, `--late` more with a
268-token prompt sent 20 ms before the `kill -9` of the victim (its pid found among `tison
up`'s children by command line), so that some are at the gateway, the scheduler or a prefill
worker when it dies. Per victim it records how every stream in flight ended (finish reason,
error text, dropped connection) and when, polls a fresh completion (a new ~270-token prompt: a
prefill worker must compute it) until one succeeds, then waits until the workers'
`tison_kv_pages_used` (the gateway's /metrics, from heartbeats) are back to their idle values.

Then NATS down for `--nats-down-s` (default 180; 0 skips it): `tison up` restarts its
nats-server at once, so the supervisor is stopped (SIGSTOP) before the nats-server is killed
and continued (SIGCONT) after the outage; it then restarts NATS on the same port. While it is
stopped it restarts nothing, and this script reads its children's output pipes in its place
(into `<workdir>/outage.log`), so that no child blocks on a full pipe. The outage's recovery
and pages are timed from the SIGCONT.

Bounds (the issue's): a stream the kill ends, ends within 10 s of the kill with an error naming
what died (for the gateway: the connection drops); one the victim did not serve may finish
normally; a completion succeeds within 15 s of the kill (of NATS's return for the outage); no
page stays used (every role's pages back to baseline within 30 s of the streams' end). Writes
a JSON report, prints a Markdown table; logs are in `--workdir` (up.log: every child's lines,
prefixed with its name; nats/nats-server.log).

    python -m loadtest.scenarios.chaos [--victims decode,prefill,scheduler,gateway,nats]
        [--nats-down-s 180] [--streams 8] [--out results/chaos.json]
"""

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import aiohttp

from loadtest.scenarios.chaos_streams import (
    FINISHED,
    HUNG,
    StreamEnd,
    names_victim,
    pages_used,
    poll_until_served,
    stream,
)
from loadtest.scenarios.cluster import Cluster, http_status
from shared.default_model import default_model_dir

VICTIMS = ("decode", "prefill", "scheduler", "gateway", "nats")
END_BOUND_S, RECOVERY_BOUND_S, PAGES_LIMIT_S = 10.0, 15.0, 30.0
LATE_PROMPT = " ".join(str(n) for n in range(150))  # 268 tokens of the bundled tokenizer
LATE_LEAD_S = 0.02  # the late streams are sent this long before the kill
STREAM_LIMIT_S = 120.0  # a stream still open this long after it started is hung
RECOVERY_LIMIT_S = 120.0  # polling for a completion gives up after this


def child_pid(up_pid: int, victim: str) -> int | None:
    """The pid of `tison up`'s child `victim`: `python -m services.cli <victim> ...`, or the
    nats-server binary for "nats"."""
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(up_pid)], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        pid, args = line.strip().split(" ", 1)
        argv = args.split()
        if victim == "nats" and Path(argv[0]).name == "nats-server":
            return int(pid)
        if argv[1:4] == ["-m", "services.cli", victim]:
            return int(pid)
    return None


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    lines = [line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line]
    return lines[0] if lines else "unknown"


def by_role(used: dict[str, float]) -> dict[str, float]:
    """role -> pages used, from pages_used's role/worker -> pages used."""
    roles: dict[str, float] = {}
    for key, value in used.items():
        role = key.split("/", 1)[0]
        roles[role] = roles.get(role, 0.0) + value
    return roles


async def wait_pages(
    url: str, baseline: dict[str, float], limit_s: float, seen: dict | None = None
) -> float | None:
    """time.monotonic() when every role of `baseline` reports again and uses no more pages
    than at baseline (None: not within `limit_s`); `seen` keeps the last pages read."""
    deadline = time.monotonic() + limit_s
    seen = {} if seen is None else seen
    while time.monotonic() < deadline:
        used = await asyncio.to_thread(pages_used, url)
        if used is not None:
            seen.clear()
            seen.update(used)
            roles = by_role(used)
            if set(roles) >= set(baseline) and all(roles[r] <= baseline[r] for r in baseline):
                return time.monotonic()
        await asyncio.sleep(0.5)
    return None


async def wait_ready(url: str, up_pid: int, limit_s: float = 120.0) -> None:
    """Until /health is 200 and every child runs (a restarted one included)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        pids = [child_pid(up_pid, v) for v in VICTIMS]
        if all(pids) and await asyncio.to_thread(http_status, url + "/health") == 200:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"tison up not healthy with all children within {limit_s} s")


async def until_tokens_flow(states: list[StreamEnd], tasks: list, limit_s: float) -> None:
    """Until every stream still open has had a token (or `limit_s` passed)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all(s.first_token_at or t.done() for s, t in zip(states, tasks)):
            return
        await asyncio.sleep(0.01)


class PipeDrain:
    """While `tison up` is stopped (SIGSTOP), reads its children's output pipes in its place,
    into `<workdir>/outage.log`, so that a child logging more than a pipe holds (nats-py logs
    a traceback at every reconnect attempt) does not block on its next write. The pipes'
    read ends are opened anew through /proc/<child>/fd/1."""

    def __init__(self, up_pid: int, log_path: Path):
        self.log_path = log_path
        self._fds: dict[str, int] = {}  # child -> the read end of its output pipe
        for name in VICTIMS[:-1]:  # the nats-server writes to its own file
            if (pid := child_pid(up_pid, name)) is not None:
                self._fds[name] = os.open(f"/proc/{pid}/fd/1", os.O_RDONLY | os.O_NONBLOCK)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PipeDrain":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for fd in self._fds.values():
            os.close(fd)

    def _run(self) -> None:
        with open(self.log_path, "ab") as log:
            while not self._stop.wait(0.2):
                for name, fd in self._fds.items():
                    with contextlib.suppress(OSError):  # EAGAIN: nothing more now
                        while data := os.read(fd, 1 << 16):
                            log.writelines(f"[{name}] ".encode() + x for x in data.splitlines(True))


def start_streams(ctx: dict, bodies: list[dict]) -> tuple[list[StreamEnd], list]:
    states = [StreamEnd(HUNG) for _ in bodies]
    tasks = [
        asyncio.create_task(stream(ctx["session"], ctx["url"], body, STREAM_LIMIT_S, state))
        for body, state in zip(bodies, states)
    ]
    return states, tasks


async def one_kill(ctx: dict, victim: str, down_s: float) -> dict:
    """Burst, kill -9 `victim` (NATS kept down `down_s` with the supervisor stopped), measure.
    The burst: `--streams` streams decoding at the kill, and `--late` with a longer prompt sent
    LATE_LEAD_S before it (at the gateway, the scheduler or a prefill worker when it comes)."""
    url, up_pid, args = ctx["url"], ctx["up_pid"], ctx["args"]
    common = {"model": ctx["model"], "ignore_eos": True, "stream": True}
    states, tasks = start_streams(
        ctx,
        [
            {**common, "prompt": f"Story {i}:", "max_tokens": args.max_tokens}
            for i in range(args.streams)
        ],
    )
    await until_tokens_flow(states, tasks, 30.0)
    pid = child_pid(up_pid, victim)
    late_states, late_tasks = start_streams(
        ctx, [{**common, "prompt": LATE_PROMPT, "max_tokens": 32}] * args.late
    )
    await asyncio.sleep(LATE_LEAD_S)
    states, tasks = states + late_states, tasks + late_tasks
    in_flight = [s for s, t in zip(states, tasks) if not t.done()]
    if down_s:
        os.kill(up_pid, signal.SIGSTOP)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    back_at = killed_at
    if down_s:
        try:
            with PipeDrain(up_pid, Path(args.workdir) / "outage.log"):
                await asyncio.sleep(down_s)
        finally:
            os.kill(up_pid, signal.SIGCONT)
            back_at = time.monotonic()
    recovered_at = await poll_until_served(ctx["session"], url, ctx["model"], RECOVERY_LIMIT_S)
    await asyncio.gather(*tasks)
    seen: dict[str, float] = {}
    freed_at = await wait_pages(url, ctx["baseline"], PAGES_LIMIT_S, seen)
    row = summarize(victim, pid, in_flight, killed_at, back_at, recovered_at, freed_at, down_s)
    row["pages_used_last"] = seen
    return row


def summarize(victim, pid, in_flight, killed_at, back_at, recovered_at, freed_at, down_s) -> dict:
    """One victim's row: the streams' ends, the bounds and whether each held."""
    hit = [s for s in in_flight if s.kind != FINISHED]
    end_s = [round(s.ended_at - killed_at, 3) for s in hit]
    recovery_s = None if recovered_at is None else round(recovered_at - back_at, 3)
    row = {
        "victim": victim if not down_s else f"nats down {down_s:.0f} s",
        "pid": pid,
        "in_flight": len(in_flight),
        "tokens_before_end": [s.num_tokens for s in in_flight],
        "ends": dict(Counter(s.kind for s in in_flight)),
        "errors": sorted({s.detail for s in hit}),
        "kill_to_end_s": end_s,
        "kill_to_end_all_s": [round(s.ended_at - killed_at, 3) for s in in_flight],
        "max_kill_to_end_s": max(end_s, default=0.0),
        "truthful": all(names_victim(s, victim) for s in in_flight),
        "recovery_s": recovery_s,
        "recovery_from_kill_s": None
        if recovered_at is None
        else round(recovered_at - killed_at, 3),
        "pages_back_s": None if freed_at is None else round(freed_at - back_at, 3),
    }
    row["pass_end"] = row["max_kill_to_end_s"] <= END_BOUND_S and all(
        s.kind != HUNG for s in in_flight
    )
    row["pass_recovery"] = recovery_s is not None and recovery_s <= RECOVERY_BOUND_S
    row["pass_pages"] = freed_at is not None
    row["pass"] = row["pass_end"] and row["truthful"] and row["pass_recovery"] and row["pass_pages"]
    return row


def table(rows: list[dict]) -> str:
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    head = (
        "| victim | in flight | ends | error texts | max kill→end s (≤10) | truthful "
        "| recovery s (≤15) | pages back (s) | verdict |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ends = ", ".join(f"{k} {n}" for k, n in sorted(r["ends"].items()))
        errors = "; ".join(e.replace("|", "/")[:90] for e in r["errors"]) or "-"
        recovery = "never" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        pages = "no" if r["pages_back_s"] is None else f"yes ({r['pages_back_s']:.1f})"
        lines.append(
            f"| {r['victim']} | {r['in_flight']} | {ends} | {errors} "
            f"| {r['max_kill_to_end_s']:.2f} {verdict(r['pass_end'])} "
            f"| {'yes' if r['truthful'] else 'no'} | {recovery} {verdict(r['pass_recovery'])} "
            f"| {pages} | {verdict(r['pass'])} |"
        )
    return "\n".join(lines)


async def run(args: argparse.Namespace, url: str, up_pid: int) -> list[dict]:
    model = default_model_dir().name
    async with aiohttp.ClientSession() as session:
        ctx = {"url": url, "up_pid": up_pid, "args": args, "model": model, "session": session}
        await wait_ready(url, up_pid)
        await poll_until_served(session, url, model, 30.0)  # warm: the first request's costs
        ctx["baseline"] = by_role(await asyncio.to_thread(pages_used, url) or {})
        rows = []
        steps = [(v, 0.0) for v in args.victims]
        if args.nats_down_s:
            steps.append(("nats", args.nats_down_s))
        for victim, down_s in steps:
            await wait_ready(url, up_pid)
            await wait_pages(url, ctx["baseline"], PAGES_LIMIT_S)
            print(f"killing {victim} (down {down_s:.0f} s)", flush=True)
            rows.append(await one_kill(ctx, victim, down_s))
            print(json.dumps(rows[-1]), flush=True)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--victims", default=",".join(VICTIMS))
    parser.add_argument("--nats-down-s", type=float, default=180.0)
    parser.add_argument("--streams", type=int, default=8, help="streams decoding at the kill")
    parser.add_argument("--late", type=int, default=4, help="streams sent just before the kill")
    parser.add_argument("--max-tokens", type=int, default=480, help="per stream (model: 512)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tison-chaos"))
    args = parser.parse_args()
    args.victims = [v for v in args.victims.split(",") if v]
    if unknown := set(args.victims) - set(VICTIMS):
        parser.error(f"unknown victims {sorted(unknown)}; choose from {VICTIMS}")
    started = time.time()
    shutil.rmtree(args.workdir, ignore_errors=True)  # its logs and NATS store are this run's
    with Cluster(args.workdir) as cluster:
        url = cluster.up(default_model_dir(), "--state-dir", str(args.workdir / "nats"))
        rows = asyncio.run(run(args, url, cluster.procs["up"].pid))
    report = {
        "cpu": cpu_model(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average": os.getloadavg(),
        "streams": args.streams,
        "late_streams": args.late,
        "max_tokens": args.max_tokens,
        "bounds_s": {"end": END_BOUND_S, "recovery": RECOVERY_BOUND_S, "pages": PAGES_LIMIT_S},
        "workdir": str(args.workdir),
        "victims": rows,
    }
    print(f"\nCPU: {report['cpu']}\n\n{table(rows)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
