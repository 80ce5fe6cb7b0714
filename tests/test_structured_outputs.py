"""Structured outputs on the engine: JSON schemas, regexes, choices and grammars constrain what a
tiny random-weight model writes (its own choices would be noise), in mixed batches, with seeds,
over two pipeline stages and across a prefill/decode handoff; matchers and pages are freed."""

import json
import re

import jsonschema
import pytest
from tokenizers import Tokenizer

from shared.engine.request import FinishReason
from shared.errors import InvalidRequestError
from shared.sampling.params import SamplingParams
from shared.sampling.structured import CHOICE, GRAMMAR, JSON, REGEX, StructuredOutput, validate

from engine_helpers import make_prompts, new_engine, run_all

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": -3, "maximum": 250},
        "done": {"type": "boolean"},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
    },
    "required": ["color", "count", "done", "name"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput(JSON, json.dumps(SCHEMA))
REGEX_SPEC = StructuredOutput(REGEX, r"[a-c]{2,4}-[0-9]{3}")
CHOICES = ["alpha", "beta", "gamma delta"]
CHOICE_SPEC = StructuredOutput(CHOICE, json.dumps(CHOICES))
LARK = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'
GBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]?'
TUPLE = re.compile(r"\([0-9]{1,2}(,[0-9]{1,2})*\)")


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = new_engine(tiny_llama)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


def _params(spec, seed=0, **options) -> SamplingParams:
    options.setdefault("max_tokens", 120)
    return SamplingParams(temperature=1.0, seed=seed, structured=spec, **options)


def _run(engine, jobs: dict[str, tuple[list[int], SamplingParams]]):
    """Runs the jobs (id -> (prompt, params)) together: {id: (text ids, finish reason)}."""
    requests = {rid: engine.add_request(rid, p, params) for rid, (p, params) in jobs.items()}
    run_all(engine)
    assert engine.num_pages_used == 0 and len(engine.grammars) == 0
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in requests.items()}


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_json_schema_holds_for_100_samples_at_temperature_1(engine, tokenizer):
    prompts = make_prompts([5] * 100, seed=1)
    for start in range(0, 100, 32):
        jobs = {
            f"j{i}": (prompts[i], _params(JSON_SPEC, seed=i))
            for i in range(start, min(start + 32, 100))
        }
        for rid, (ids, reason) in _run(engine, jobs).items():
            assert reason == FinishReason.STOP, (rid, _text(tokenizer, ids))
            jsonschema.validate(json.loads(_text(tokenizer, ids)), SCHEMA)


def test_any_json_object(engine, tokenizer):
    spec = StructuredOutput(JSON, "")
    jobs = {
        f"o{i}": (p, _params(spec, seed=i, max_tokens=200))
        for i, p in enumerate(make_prompts([4] * 6))
    }
    outputs = _run(engine, jobs).values()
    assert any(reason == FinishReason.STOP for _, reason in outputs)
    for ids, reason in outputs:
        if reason == FinishReason.STOP:
            assert isinstance(json.loads(_text(tokenizer, ids)), dict)
        else:  # cut by max_tokens: still the start of an object
            assert reason == FinishReason.LENGTH and _text(tokenizer, ids).startswith("{")


def test_regex_choice_and_grammars_match_exactly(engine, tokenizer):
    specs = {
        "regex": (REGEX_SPEC, re.compile(REGEX_SPEC.value)),
        "choice": (CHOICE_SPEC, re.compile("|".join(map(re.escape, CHOICES)))),
        "lark": (StructuredOutput(GRAMMAR, LARK), TUPLE),
        "gbnf": (StructuredOutput(GRAMMAR, GBNF), TUPLE),
    }
    prompts = make_prompts([6] * 8, seed=2)
    jobs = {
        f"{name}{i}": (prompts[i], _params(spec, seed=i))
        for name, (spec, _) in specs.items()
        for i in range(8)
    }
    for rid, (ids, reason) in _run(engine, jobs).items():
        pattern = specs[rid.rstrip("0123456789")][1]
        assert reason == FinishReason.STOP and pattern.fullmatch(_text(tokenizer, ids)), rid


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput(JSON, '{"type": "nonsense"}'),
        StructuredOutput(JSON, "{not json"),
        StructuredOutput(JSON, "[1, 2]"),
        StructuredOutput(REGEX, "a(b"),
        StructuredOutput(REGEX, ""),
        StructuredOutput(CHOICE, "[]"),
        StructuredOutput(CHOICE, '["a", 3]'),
        StructuredOutput(GRAMMAR, "start: undefined_rule"),
        StructuredOutput(GRAMMAR, 'root ::= "a'),
        StructuredOutput("xml", "<a/>"),
        StructuredOutput(JSON, {"type": "object"}),  # not JSON text
    ],
    ids=lambda s: s.kind,
)
def test_bad_specs_are_rejected_naming_the_field(spec, engine):
    with pytest.raises(InvalidRequestError) as e:
        validate(spec, "response_format")
    assert e.value.field == "response_format"
    with pytest.raises(InvalidRequestError) as e:  # the engine refuses it too, holding nothing
        engine.add_request("bad", [5, 6], _params(spec))
    assert e.value.field == "structured" and "bad" not in engine.requests
    assert len(engine.grammars) == 0


def test_constrained_and_free_rows_share_a_batch(engine, tokenizer):
    prompts = make_prompts([3, 9, 17, 30], seed=3)
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = _run(engine, {f"f{i}": (p, free) for i, p in enumerate(prompts)})
    jobs = {f"f{i}": (p, free) for i, p in enumerate(prompts)}
    jobs |= {f"c{i}": (p, _params(JSON_SPEC, seed=i)) for i, p in enumerate(prompts)}
    mixed = _run(engine, jobs)
    for i in range(len(prompts)):
        assert mixed[f"f{i}"] == alone[f"f{i}"]  # masks touch only their own rows
        ids, reason = mixed[f"c{i}"]
        assert reason == FinishReason.STOP
        jsonschema.validate(json.loads(_text(tokenizer, ids)), SCHEMA)


def test_seeded_structured_rows_repeat_whatever_else_is_in_the_batch(engine):
    target = ([7, 8, 9], _params(JSON_SPEC, seed=11))
    alone = _run(engine, {"t": target})["t"]
    others = {
        f"o{i}": (p, _params(REGEX_SPEC if i % 2 else None, seed=100 + i, max_tokens=20))
        for i, p in enumerate(make_prompts([4, 12, 25, 40], seed=4))
    }
    assert _run(engine, {**others, "t": target})["t"] == alone
    assert _run(engine, {"t": target, **others})["t"] == alone


def test_masks_filled_before_or_beside_the_forward_pass_agree(engine):
    jobs = {f"m{i}": (p, _params(JSON_SPEC, seed=i)) for i, p in enumerate(make_prompts([4, 9]))}
    background = engine.grammars.background
    try:
        engine.grammars.background = True
        beside = _run(engine, jobs)
        engine.grammars.background = False
        assert _run(engine, jobs) == beside
    finally:
        engine.grammars.background = background


def test_a_two_stage_pipeline_samples_what_one_rank_does(tiny_llama, engine):
    prompts = make_prompts([3, 11, 20, 33], seed=5)
    specs = [JSON_SPEC, REGEX_SPEC, CHOICE_SPEC, None]
    jobs = {f"p{i}": (p, _params(specs[i], seed=i, max_tokens=40)) for i, p in enumerate(prompts)}
    single = _run(engine, jobs)
    staged = new_engine(tiny_llama, pp=2, allow_oversubscribe=True)
    try:
        assert _run(staged, jobs) == single
    finally:
        staged.close()


def test_prefill_worker_masks_the_first_token_and_decode_consumes_it(tiny_llama, engine, tokenizer):
    """The two sides of a handoff in one process: the prefill engine samples the first token
    under the grammar; the decode engine's matcher consumes it before its first step (its KV
    is not copied here, so only the grammar is tested, not the tokens)."""
    decode = new_engine(tiny_llama)
    try:
        for i, spec in enumerate([JSON_SPEC, REGEX_SPEC, CHOICE_SPEC]):
            prompt, params = [3 + i, 40, 41], _params(spec, seed=i)
            first = engine.add_request(f"pre{i}", prompt, params, prefill_only=True)
            run_all(engine)
            assert first.finish_reason == FinishReason.LENGTH and len(first.output_token_ids) == 1
            assert len(engine.grammars) == 0 and engine.num_pages_used == 0
            assert decode.reserve(f"pre{i}", prompt, params) is not None
            req = decode.start_remote(f"pre{i}", first.output_token_ids[0], None)
            run_all(decode)
            text = _text(tokenizer, req.output_token_ids)
            assert req.finish_reason == FinishReason.STOP, text
            if spec is JSON_SPEC:
                jsonschema.validate(json.loads(text), SCHEMA)
            elif spec is REGEX_SPEC:
                assert re.fullmatch(spec.value, text)
            else:
                assert text in CHOICES
        assert len(decode.grammars) == 0 and decode.num_pages_used == 0
    finally:
        decode.close()


def test_a_first_token_the_grammar_rejects_ends_the_request_with_error(tiny_llama, tokenizer):
    decode = new_engine(tiny_llama)
    try:
        decode.reserve("r", [5, 6], _params(REGEX_SPEC))
        letter_z = tokenizer.token_to_id("z")  # the regex starts with a, b or c
        req = decode.start_remote("r", letter_z, None)
        assert req.finish_reason == FinishReason.ERROR
        assert len(decode.grammars) == 0 and decode.num_pages_used == 0 and not decode.requests
    finally:
        decode.close()


def test_preempted_rows_keep_their_grammar_state(tiny_llama, tokenizer):
    """A pool too small for every row: some are preempted and recomputed mid-output; their
    matchers keep the tokens consumed, so the outputs still validate."""
    small = new_engine(tiny_llama, num_pages=14)
    try:
        jobs = {
            f"s{i}": (p, _params(JSON_SPEC, seed=i))
            for i, p in enumerate(make_prompts([30] * 6, seed=6))
        }
        requests = {rid: small.add_request(rid, p, params) for rid, (p, params) in jobs.items()}
        run_all(small)
        assert sum(r.num_preemptions for r in requests.values()) > 0
        for r in requests.values():
            assert r.finish_reason == FinishReason.STOP
            jsonschema.validate(json.loads(_text(tokenizer, r.output_token_ids)), SCHEMA)
        assert small.num_pages_used == 0 and len(small.grammars) == 0
    finally:
        small.close()


def test_aborted_and_stopped_requests_free_their_matchers(engine):
    engine.add_request("a", [5, 6], _params(JSON_SPEC))
    engine.add_request("b", [5, 7], _params(JSON_SPEC))
    engine.step()
    assert len(engine.grammars) == 2
    assert engine.abort("a")
    engine.finish("b", FinishReason.STOP)  # as a matched stop string does
    assert len(engine.grammars) == 0 and engine.num_pages_used == 0 and not engine.has_unfinished()


def test_logit_bias_steers_the_engine_and_foreign_ids_are_rejected(engine):
    forced = SamplingParams(temperature=0, max_tokens=5, logit_bias={77: 100})
    outputs = _run(engine, {"b": ([5, 6, 7], forced)})
    assert outputs["b"][0] == [77] * 5
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("far", [5], SamplingParams(logit_bias={384: 1.0}))
    assert e.value.field == "logit_bias" and "far" not in engine.requests
