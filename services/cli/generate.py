"""`tison generate`: one completion from a model folder, printed alone on stdout."""

import argparse
import sys

from shared.errors import InvalidRequestError, TisonError
from shared.parallel.cores import parse_cpulist


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model/--dtype, shared by every command that runs a model."""
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """--device/--gpu-memory-utilization/--enforce-eager/--resident-codec, shared by every
    command that runs a model (EngineConfig's device, gpu_memory_utilization, decode_graphs and
    resident_codec)."""
    parser.add_argument(
        "--device", default="auto",
        help="cpu, cuda (rank r on the r-th visible GPU), cuda:N, or auto (cuda where torch "
        "sees a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="share of each GPU for weights, activations and the KV pool (default 0.9)",
    )  # fmt: skip
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="decode op by op: without CUDA graphs, and on a CPU without the fused decoder "
        "(debugging)",
    )
    parser.add_argument(
        "--resident-codec", action="store_true",
        help="a compressed folder's layer weights stay compressed on the device, each layer's "
        "decoded just before it runs (one rank; eager decode steps)",
    )  # fmt: skip


def device_options(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments of add_device_options' flags."""
    return dict(
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        decode_graphs="off" if args.enforce_eager else "auto",
        resident_codec=args.resident_codec,
    )


def add_parallel_options(parser: argparse.ArgumentParser) -> None:
    """--tp/--pp/--pp-layers/--ep/--dp/--allow-oversubscribe, shared by every command that runs
    a model."""
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument(
        "--pp-layers", type=_counts, default=None, help="layers per stage, e.g. 3,1 (default: even)"
    )
    parser.add_argument(
        "--ep",
        action="store_true",
        help="expert parallelism: MoE layers spread whole experts over the --tp ranks",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel attention ranks, each with its own requests and KV pool; MoE "
        "layers spread whole experts over them (with --tp 1 --pp 1)",
    )
    parser.add_argument(
        "--allow-oversubscribe", action="store_true", help="allow more ranks than CPU cores"
    )


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 3,1, got {text!r}") from None


def cpulist_arg(text: str) -> tuple[int, ...]:
    """--cpus and the like: "0-3,8" -> (0, 1, 2, 3, 8)."""
    try:
        return parse_cpulist(text)
    except InvalidRequestError as e:
        raise argparse.ArgumentTypeError(e.problem) from None


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from shared.default_model import default_model_dir

    return str(default_model_dir())


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="complete one prompt offline")
    add_model_options(p)
    add_device_options(p)
    add_parallel_options(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message (chat template)"
    )
    p.add_argument("prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from shared.engine.llm import LLM
    from shared.sampling.params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        parallel = dict(
            tp=args.tp,
            pp=args.pp,
            pp_layers=args.pp_layers,
            ep=args.ep,
            dp=args.dp,
            allow_oversubscribe=args.allow_oversubscribe,
        )
        options = {**parallel, **device_options(args)}
        with LLM(resolve_model(args.model), dtype=args.dtype, **options) as llm:
            if args.chat:
                out = llm.chat([[{"role": "user", "content": args.prompt}]], params)[0]
            else:
                out = llm.generate(args.prompt, params)[0]
    except TisonError as e:
        print(f"tison generate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(out.text + ("\n" if not out.text.endswith("\n") else ""))
    return 0
