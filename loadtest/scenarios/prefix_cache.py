"""Prefix caching: the agent workload against the cache on, off and with round-robin routing.

One run, every configuration started first (`tison up`, 1 prefill + 1 decode worker unless
told otherwise), then loaded in paired rounds (loadtest.paired's order), each round with a
fresh workload (seed + round) so that no round finds the one before it in the cache:

- kv: prefix cache on (the default), `--routing kv`;
- off: `--no-prefix-caching` (the baseline of the ratios);
- rr: cache on, `--routing round-robin` (with one prefill worker it routes as kv does);
- plain: `tison up` with no flag of its own (not run unless asked: for servers without them).

Workloads: `agent` (sessions of turns resending their history, Poisson session starts) on
every configuration, and a no-reuse `random` one (prompts of the agent turns' lengths, fresh
tokens) on all but rr. Per configuration: TTFT p50/p99 (and p50 by turn), their ratios to
cache-off, the prefix hit rate and the prefill tokens computed, from the counters of
loadtest.scenarios.prefix_counters before and after each load ("n/a" when no service
exports them). Target: agent TTFT p50 <= 0.3x cache-off at >= 80 % hit rate; no-reuse TTFT
p50 <= 1.1x cache-off.

    python -m loadtest.scenarios.prefix_cache [--sessions 8 --turns 4 ...] [--out DIR]
"""

import argparse
import json
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from loadtest.paired import round_order
from loadtest.runner import Load
from loadtest.scenarios.cluster import Cluster
from loadtest.scenarios.common import bench, build_small_llama, wait_serving, warm_up
from loadtest.scenarios.prefix_counters import metrics_urls, prefix_use, scrape
from loadtest.scenarios.prefix_report import CONFIGS, NO_REUSE_SKIPS, Measured, write
from loadtest.target import Target
from loadtest.workloads import AgentWorkload, LengthDist, PromptMaker, RequestSpec, agent_sessions
from shared.default_model import default_model_dir
from shared.tokenizer.tokenizer import Tokenizer


def agent_workload(tokenizer: Tokenizer, args, seed: int) -> AgentWorkload:
    maker = PromptMaker(tokenizer, np.random.default_rng(seed))
    ins, outs = LengthDist.parse(args.input_len), LengthDist.parse(str(args.output_len))
    return agent_sessions(
        maker, args.sessions, args.turns, args.prefix_len, args.num_prefixes, ins, outs
    )


def no_reuse_specs(tokenizer: Tokenizer, work: AgentWorkload, seed: int) -> list[RequestSpec]:
    """A request per agent turn, of that turn's prompt length (system prompt, history and user
    message, the history's outputs counted at max_tokens) in fresh random tokens."""
    maker = PromptMaker(tokenizer, np.random.default_rng(seed + 10_000))
    specs = []
    for s in work.sessions:
        length = len(s.prefix_ids)
        for turn in s.turns:
            length += len(turn.token_ids)
            text = maker.text(length)
            specs.append(RequestSpec(text, turn.max_tokens, maker.count(text)))
            length += turn.max_tokens
    return [specs[i] for i in maker.rng.permutation(len(specs)).tolist()]


def check_fits(model: Path, work: AgentWorkload) -> None:
    """Refuse lengths past the model's context (the bundled model has 512 positions)."""
    max_len = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    longest = max(
        len(s.prefix_ids) + sum(len(t.token_ids) + t.max_tokens for t in s.turns)
        for s in work.sessions
    )
    if max_len and longest + 16 > max_len:  # 16: outputs may re-encode a little longer
        sys.exit(f"the last turns reach ~{longest} tokens; {model.name} has {max_len} positions")


def measure(target: Target, urls: list[str], work, load: Load, label: str, text: str, args):
    before = scrape(urls)
    report = bench(target, work, [load], label, text, args.max_duration, command=args.command)
    return Measured(report, prefix_use(before, scrape(urls)))


def start(stack: ExitStack, tmp: Path, model: Path, names: list[str], args) -> dict:
    """Every configuration's `tison up`, warmed up -> name -> (target, metrics URLs)."""
    sides = {}
    shape = ["--prefill-workers", str(args.prefill_workers)]
    shape += ["--decode-workers", str(args.decode_workers), *shlex.split(args.up_args)]
    warm = [RequestSpec("warm up the shapes " * 8, 8, 40)] * 2
    for name in names:
        c = stack.enter_context(Cluster(tmp / name))
        url = c.up(model, *CONFIGS[name][1], *shape)
        target = Target(url, model.name, ignore_eos=True, timeout_s=args.max_duration)
        wait_serving(target)
        warm_up(target, warm)
        sides[name] = (target, metrics_urls(url, c.workdir / "up.log"))
    return sides


def run_all(sides: dict, tokenizer: Tokenizer, args) -> dict[str, dict[str, list[Measured]]]:
    """name -> workload ("agent", "random") -> one Measured a round."""
    names = list(sides)
    results: dict = {name: {"agent": [], "random": []} for name in names}
    agent_load = Load(args.rate)
    random_load = Load(args.rate * args.turns, args.sessions)
    for r in range(args.rounds):
        work = agent_workload(tokenizer, args, args.seed + r)
        specs = no_reuse_specs(tokenizer, work, args.seed + r)
        plan = [("agent", work, agent_load, n) for n in round_order(names, r)]
        plan += [
            ("random", specs, random_load, n)
            for n in round_order(names, r)
            if n not in NO_REUSE_SKIPS
        ]
        for kind, load_work, load, name in plan:
            target, urls = sides[name]
            label = f"{CONFIGS[name][0]}, {kind}, round {r + 1} of {args.rounds}"
            text = f"{kind}: {describe(args)}"
            results[name][kind].append(measure(target, urls, load_work, load, label, text, args))
    return results


def describe(args) -> str:
    return (
        f"{args.sessions} sessions x {args.turns} turns, system prompt {args.prefix_len} tokens "
        f"({args.num_prefixes} distinct), + {args.input_len} user tokens and {args.output_len} "
        f"out per turn, Poisson {args.rate:g} sessions/s"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="kv,off,rr", help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--num-prefixes", type=int, default=1)
    ap.add_argument("--input-len", default="64", help="user tokens a turn (a length distribution)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens a turn")
    ap.add_argument("--rate", type=float, default=1.0, help="session starts/s (Poisson)")
    ap.add_argument("--rounds", type=int, default=1, help="paired rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=1)
    ap.add_argument("--up-args", default="", help="more `tison up` flags for every configuration")
    ap.add_argument("--max-duration", type=float, default=300.0, help="seconds per load")
    ap.add_argument(
        "--bundled", action="store_true", help="serve the bundled model (512 positions)"
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse (or build) the small Llama")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results/prefix_cache"))
    args = ap.parse_args()
    args.names = [n for n in args.configs.split(",") if n]
    if not args.names or any(n not in CONFIGS for n in args.names):
        ap.error(f"--configs: a comma list of {', '.join(CONFIGS)}")
    args.command = "python -m loadtest.scenarios.prefix_cache " + shlex.join(sys.argv[1:])
    return args


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="tison-prefix-") as tmp, ExitStack() as stack:
        if args.bundled:
            model = default_model_dir()
        else:
            model = build_small_llama(args.model_dir or Path(tmp) / "small-llama")
        tokenizer = Tokenizer.from_dir(model)
        check_fits(model, agent_workload(tokenizer, args, args.seed))
        sides = start(stack, Path(tmp), model, args.names, args)
        results = run_all(sides, tokenizer, args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(write(results, args, describe(args), args.out))
    print(f"`{args.command}` — results in {args.out}")


if __name__ == "__main__":
    main()
