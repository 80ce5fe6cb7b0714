"""`tison batch`: OpenAI batch JSONL over NATS JetStream, no HTTP (services/batch).

  tison batch submit FILE.jsonl [--endpoint /v1/chat/completions] [--wait]
  tison batch status ID          tison batch list
  tison batch results ID [-o OUT.jsonl] [--errors] [--wait]
  tison batch cancel ID

The gateways run the lines (their batch runners); results land in JetStream as they end."""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from services import nats_client
from services.batch import jsonl
from services.batch.objects import batch_object
from services.batch.store import BatchError, Batches, Counts
from shared.batch_messages import ENDPOINTS, FAILED

WIDTH = 30  # characters of the progress bar


def register(subparsers) -> None:
    p = subparsers.add_parser("batch", help="batch jobs over NATS (OpenAI batch JSONL)")
    nats = argparse.ArgumentParser(add_help=False)  # every action takes them, after its name
    nats.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    nats_client.add_flags(nats)
    actions = p.add_subparsers(dest="action", required=True)

    def action(name: str, text: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, help=text, parents=[nats])

    submit = action("submit", "upload a JSONL file and start its batch")
    submit.add_argument("file", type=Path)
    submit.add_argument("--endpoint", default=ENDPOINTS[0], choices=ENDPOINTS)
    submit.add_argument("--wait", action="store_true", help="show progress until it ends")
    for name, text in (("status", "a batch as JSON"), ("cancel", "stop a batch")):
        action(name, text).add_argument("id")
    action("list", "the batches, newest first")
    results = action("results", "the output lines (JSONL)")
    results.add_argument("id")
    results.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    results.add_argument("--errors", action="store_true", help="the failed lines instead")
    results.add_argument("--wait", action="store_true", help="until every line has a result")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    options = nats_client.NatsClientOptions.from_args(args)
    try:
        return asyncio.run(_run(args, options))
    except BatchError as e:
        print(f"tison batch: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tison batch: {e}", file=sys.stderr)
        return 2


async def _run(args: argparse.Namespace, options) -> int:
    nc = await nats_client.connect_nats(args.nats_url, "tison-batch", options)
    try:
        batches = Batches(nc)
        await batches.ensure()
        return await ACTIONS[args.action](batches, args)
    finally:
        await nc.close()


async def _submit(batches: Batches, args) -> int:
    batch = await batches.submit(args.file.read_bytes(), args.endpoint, filename=args.file.name)
    print(batch.id)
    if args.wait:
        await _progress(batches, batch.id)
    return 0


async def _status(batches: Batches, args) -> int:
    batch, counts = await batches.refresh(args.id)
    print(json.dumps(batch_object(batch, counts), indent=2))
    return 0


async def _list(batches: Batches, args) -> int:
    for batch in await batches.recent():
        counts = await batches.counts(batch)
        print(f"{batch.id}  {batch.status:11}  {counts.done}/{counts.total}  {batch.endpoint}")
    return 0


async def _cancel(batches: Batches, args) -> int:
    batch = await batches.cancel(args.id)
    print(f"{batch.id} {batch.status}")
    return 0


async def _results(batches: Batches, args) -> int:
    if args.wait:
        await _progress(batches, args.id)
    results = [r for r in await batches.results(args.id) if r.failed == args.errors]
    data = jsonl.dumps_lines([jsonl.output_line(r) for r in results])
    if args.output is None:
        sys.stdout.buffer.write(data)
    else:
        args.output.write_bytes(data)
        print(f"{len(results)} lines -> {args.output}", file=sys.stderr)
    return 0


async def _progress(batches: Batches, batch_id: str) -> None:
    """A progress bar on stderr, fed by the results as they land, until the batch ends."""
    started = time.monotonic()
    batch, counts = await batches.refresh(batch_id)
    done = failed = 0
    async for result in batches.follow(batch_id):
        done += 1
        failed += result.failed
        _draw(Counts(batch.total, done - failed, failed), time.monotonic() - started)
    batch, counts = await batches.refresh(batch_id)
    _draw(counts, time.monotonic() - started)
    print(f"\n{batch.id} {batch.status}", file=sys.stderr)
    if batch.status == FAILED:  # an expired or cancelled batch has the results it got
        raise BatchError("id", f"batch {batch_id} failed: {batch.error}")


def _draw(counts: Counts, elapsed_s: float) -> None:
    filled = WIDTH * counts.done // max(counts.total, 1)
    bar = "#" * filled + "." * (WIDTH - filled)
    line = f"[{bar}] {counts.done}/{counts.total} failed {counts.failed} {elapsed_s:.1f}s"
    print("\r" + line, end="", file=sys.stderr, flush=True)


ACTIONS = {
    "submit": _submit,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "results": _results,
}
