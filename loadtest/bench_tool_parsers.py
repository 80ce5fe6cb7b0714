"""The tool-call parsers' cost on the gateway's event loop: each family's output of one call
with ~16 KB of arguments, and ~18 KB of plain content, parsed whole and streamed in deltas of
4 characters (about a token each). The figures are medians over the repeats.

    python -m loadtest.bench_tool_parsers [--repeats 5]
"""

import argparse
import json
import statistics
import time

from shared.tool_calls import PARSERS

ARGS = json.dumps({"code": "x = 1\n" * 2000, "numbers": list(range(500))})
CALLS = {
    "llama3_json": f'{{"name": "run", "parameters": {ARGS}}}',
    "hermes": f'<tool_call>\n{{"name": "run", "arguments": {ARGS}}}\n</tool_call>',
    "mistral": f"[TOOL_CALLS]run[ARGS]{ARGS}",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>run\n"
    f"```json\n{ARGS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.run:0"
    f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_calls_section_end|>",
}
CONTENT = "The quick brown fox jumps over the lazy dog. " * 400
DELTA_CHARS = 4


def parse_ms(family: str, text: str) -> float:
    start = time.perf_counter()
    PARSERS[family]([]).parse(text)
    return (time.perf_counter() - start) * 1e3


def feed_us(family: str, text: str) -> float:
    """Microseconds per delta of a whole stream, finish included."""
    parser = PARSERS[family]([])
    start = time.perf_counter()
    for i in range(0, len(text), DELTA_CHARS):
        parser.feed(text[i : i + DELTA_CHARS])
    parser.finish()
    return (time.perf_counter() - start) * 1e6 / -(-len(text) // DELTA_CHARS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'parser':<12} {'parse call':>11} {'feed call':>10} {'feed content':>13}")
    for family, text in CALLS.items():
        runs = range(args.repeats)
        parse = statistics.median(parse_ms(family, text) for _ in runs)
        call = statistics.median(feed_us(family, text) for _ in runs)
        content = statistics.median(feed_us(family, CONTENT) for _ in runs)
        print(f"{family:<12} {parse:>8.2f} ms {call:>7.1f} us {content:>10.1f} us")


if __name__ == "__main__":
    main()
