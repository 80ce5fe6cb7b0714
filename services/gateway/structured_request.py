"""Structured output fields of a request → a StructuredOutput spec for the engine. Pure.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's extras
`guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`; at most one may be set.
The spec is compiled here once (`validate`), so a schema or grammar the engine cannot use is
a 400 naming its field rather than a failure in a worker.
"""

import json
from typing import Any

from shared.errors import InvalidRequestError
from shared.sampling.structured import CHOICE, GRAMMAR, JSON, REGEX, StructuredOutput, validate

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def parse_structured(body: dict) -> tuple[StructuredOutput | None, str]:
    """(the spec or None, the field it came from)."""
    given = [name for name in ("response_format", *_GUIDED) if body.get(name) is not None]
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"cannot be combined with {given[0]}")
    if not given:
        return None, ""
    field = given[0]
    value = body[field]
    spec = _SPEC[field](value, field)
    if spec is not None:
        validate(spec, field)
    return spec, field


def _response_format(value: Any, field: str) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(JSON, "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict):
            raise InvalidRequestError(f"{field}.json_schema", "must be an object")
        schema = inner.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{field}.json_schema.schema", "must be an object")
        return StructuredOutput(JSON, json.dumps(schema or {"type": "object"}))
    raise InvalidRequestError(f"{field}.type", 'must be "text", "json_object" or "json_schema"')


def _guided_json(value: Any, field: str) -> StructuredOutput:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(field, f"is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be a JSON schema object")
    return StructuredOutput(JSON, json.dumps(value))


def _text(kind: str):
    def spec(value: Any, field: str) -> StructuredOutput:
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(field, "must be a non-empty string")
        return StructuredOutput(kind, value)

    return spec


def _guided_choice(value: Any, field: str) -> StructuredOutput:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise InvalidRequestError(field, "must be a non-empty list of strings")
    return StructuredOutput(CHOICE, json.dumps(value))


_SPEC = {
    "response_format": _response_format,
    "guided_json": _guided_json,
    "guided_regex": _text(REGEX),
    "guided_choice": _guided_choice,
    "guided_grammar": _text(GRAMMAR),
}


def forced_json(schema: dict, field: str) -> StructuredOutput:
    """The spec of a schema the gateway built (a forced tool call), checked like a user's."""
    spec = StructuredOutput(JSON, json.dumps(schema))
    validate(spec, field)
    return spec
