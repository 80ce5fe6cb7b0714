"""The gateway's own OpenAPI 3.1 document, served at /openapi.json: every route with the body
fields the parsers read (openai_request.py, tool_choice.py, structured_request.py,
responses_request.py, tokenize.py) and OpenAI's error shape for the 4xx they answer. Fields
are typed loosely where the parsers take several shapes (a prompt of text or token ids, a stop
of one string or several); a test checks that every route of the app is here and every field
the hostile fuzz (tests/test_gateway_hostile.py) sends to a route is documented for it."""

_NUM, _INT, _BOOL, _STR = (
    {"type": "number"},
    {"type": "integer"},
    {"type": "boolean"},
    {"type": "string"},
)
_OBJ = {"type": "object"}
_STRINGS = {"type": "array", "items": _STR}
_INTS = {"type": "array", "items": _INT}

_SAMPLING = {
    "model": _STR,
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "min_p": _NUM,
    "presence_penalty": _NUM,
    "frequency_penalty": _NUM,
    "repetition_penalty": _NUM,
    "seed": _INT,
    "stop": {"anyOf": [_STR, _STRINGS]},
    "stop_token_ids": _INTS,
    "ignore_eos": _BOOL,
    "min_tokens": _INT,
    "skip_special_tokens": _BOOL,
    "logit_bias": {"type": "object", "additionalProperties": _NUM},
    "prompt_logprobs": _INT,
    "n": _INT,
    "stream": _BOOL,
    "stream_options": _OBJ,
    "cache_salt": _STR,
    "session_id": _STR,
    "user": _STR,
    "response_format": _OBJ,
    "guided_json": {"anyOf": [_OBJ, _STR]},
    "guided_regex": _STR,
    "guided_choice": _STRINGS,
    "guided_grammar": _STR,
}
_CHAT = {
    **_SAMPLING,
    "messages": {"type": "array", "items": _OBJ},
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "logprobs": _BOOL,
    "top_logprobs": _INT,
    "tools": {"type": "array", "items": _OBJ},
    "tool_choice": {"anyOf": [_STR, _OBJ]},
    "parallel_tool_calls": _BOOL,
}
_COMPLETION = {
    **_SAMPLING,
    "prompt": {"anyOf": [_STR, _INTS, _STRINGS]},
    "max_tokens": _INT,
    "logprobs": _INT,
    "echo": _BOOL,
    "best_of": _INT,
}
_RESPONSES = {
    "model": _STR,
    "input": {"anyOf": [_STR, {"type": "array", "items": _OBJ}]},
    "instructions": _STR,
    "tools": {"type": "array", "items": _OBJ},
    "tool_choice": {"anyOf": [_STR, _OBJ]},
    "parallel_tool_calls": _BOOL,
    "max_output_tokens": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "text": _OBJ,
    "previous_response_id": _STR,
    "store": _BOOL,
    "stream": _BOOL,
    "seed": _INT,
    "user": _STR,
}
_TOKENIZE = {
    "model": _STR,
    "prompt": _STR,
    "messages": {"type": "array", "items": _OBJ},
    "tools": {"type": "array", "items": _OBJ},
    "add_special_tokens": _BOOL,
    "add_generation_prompt": _BOOL,
}
_ERROR = {
    "description": "OpenAI's error object",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}


def _post(summary: str, fields: dict, required: list[str]) -> dict:
    body = {"type": "object", "properties": fields, "required": required}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {"description": "the result (text/event-stream when `stream` is true)"},
                "4XX": _ERROR,
            },
        }
    }


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}


def document(model: str) -> dict:
    """The OpenAPI document of a gateway serving `model`."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tison gateway", "version": "1", "description": f"serving {model}"},
        "paths": {
            "/v1/chat/completions": _post("chat completion", _CHAT, ["model", "messages"]),
            "/v1/completions": _post("text completion", _COMPLETION, ["model", "prompt"]),
            "/v1/responses": _post("OpenAI Responses API", _RESPONSES, ["model", "input"]),
            "/tokenize": _post("token ids of a prompt or conversation", _TOKENIZE, []),
            "/detokenize": _post("text of token ids", {"tokens": _INTS}, ["tokens"]),
            "/v1/models": _get("the served model"),
            "/health": _get("200 while a scheduler and workers serve, else 503"),
            "/metrics": _get("Prometheus metrics"),
            "/openapi.json": _get("this document"),
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": _STR,
                                "type": _STR,
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                }
            }
        },
    }
