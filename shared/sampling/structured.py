"""Structured outputs: the spec a request carries (`SamplingParams.structured`) and its
compilation to an llguidance grammar, which the engine's matchers (shared/engine/grammars.py)
turn into a next-token mask each step.

llguidance, not xgrammar: no runtime dependencies (xgrammar pulls transformers, triton and
tvm-ffi), grammars checked without a tokenizer, Lark and GBNF both. xgrammar fills a mask
about 3x faster on this CPU (loadtest/bench_grammar.py), which at ~10-80 us a row is a few
per cent of a batch-32 decode step either way, and runs beside the forward pass.
"""

import functools
import json
from dataclasses import dataclass

import llguidance

from shared.errors import InvalidRequestError

JSON, REGEX, CHOICE, GRAMMAR = "json", "regex", "choice", "grammar"
KINDS = (JSON, REGEX, CHOICE, GRAMMAR)
# JSON comes out compact (no free whitespace between tokens): a weak or random model cannot
# wander in whitespace forever (vLLM's disable-any-whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT = '{"type": "object"}'  # JSON with value "": OpenAI's json_object


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match; the gateway builds it from OpenAI's response_format or
    vLLM's guided_* fields (and from a forced tool call's parameters schema).

    kind JSON: value is a JSON schema as JSON text, "" for any JSON object (json_object).
    kind REGEX: value is a regular expression (Rust `regex` syntax), matched whole.
    kind CHOICE: value is a JSON list of strings; the output is exactly one of them.
    kind GRAMMAR: value is a context-free grammar in llguidance's Lark syntax, or in llama.cpp's
    GBNF (`root ::= ...`, as vLLM's guided_grammar users send), converted to Lark.
    """

    kind: str
    value: str


def validate(spec: StructuredOutput, field: str) -> None:
    """Raises InvalidRequestError(field, ...) when `spec` is malformed or llguidance cannot
    compile it. Needs no tokenizer; compiled specs are cached, so a repeat costs a lookup."""
    if not isinstance(spec, StructuredOutput):
        raise InvalidRequestError(field, "must be a StructuredOutput")
    if not (isinstance(spec.kind, str) and isinstance(spec.value, str)):
        raise InvalidRequestError(field, "kind and value must be strings")
    _, problem = _compile(spec)
    if problem:
        raise InvalidRequestError(field, problem)


def grammar_of(spec: StructuredOutput, field: str) -> str:
    """The llguidance grammar (its JSON text) of a valid spec; InvalidRequestError if not."""
    validate(spec, field)
    return _compile(spec)[0]


@functools.lru_cache(maxsize=512)
def _compile(spec: StructuredOutput) -> tuple[str, str]:
    """(grammar, "") or ("", what is wrong)."""
    if spec.kind not in KINDS:
        return "", f"kind must be one of {', '.join(KINDS)}, got {spec.kind!r}"
    try:
        grammar = _grammar(spec)
    except ValueError as e:
        return "", str(e)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    return ("", f"cannot compile the {spec.kind}: {problem.strip()}") if problem else (grammar, "")


def _grammar(spec: StructuredOutput) -> str:
    if spec.kind == JSON:
        schema = spec.value or ANY_OBJECT
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=JSON_OPTIONS)
    if spec.kind == CHOICE:
        try:
            choices = json.loads(spec.value)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice must be a JSON list of non-empty strings")
        if not choices:
            raise ValueError("choice must list at least one string")
        return llguidance.grammar_from("choice", spec.value)
    if not spec.value:
        raise ValueError(f"the {spec.kind} is empty")
    if spec.kind == REGEX:
        return llguidance.grammar_from("regex", spec.value)
    return llguidance.grammar_from("grammar", spec.value)  # GBNF goes through any_to_lark


__all__ = ["CHOICE", "GRAMMAR", "JSON", "REGEX", "StructuredOutput", "grammar_of", "validate"]
