"""vLLM's `POST /tokenize` and `POST /detokenize`: the served model's tokenizer and chat
template, as the completion routes apply them."""

import asyncio

from services.gateway.openai_request import parse_chat
from shared.errors import InvalidRequestError


async def tokenize(service, body) -> dict:
    """{"prompt": text} or {"messages": [...]} (chat template applied, `tools` too) →
    {"count", "max_model_len", "tokens"}."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    if "messages" in body:
        chat = parse_chat({"model": service.config.served_model_name, **body})
        messages, tools = list(chat.messages), list(chat.tools) if chat.tools else None
        generation = body.get("add_generation_prompt", True)
        if not isinstance(generation, bool):
            raise InvalidRequestError("add_generation_prompt", "must be a boolean")
        ids = await asyncio.to_thread(
            service.tokenizer.encode_chat, messages, tools=tools, add_generation_prompt=generation
        )
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt", "must be a string (or send messages)")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise InvalidRequestError("add_special_tokens", "must be a boolean")
        ids = await asyncio.to_thread(service.tokenizer.encode, prompt, special)
    return {"count": len(ids), "max_model_len": service.max_model_len(), "tokens": ids}


def detokenize(service, body) -> dict:
    """{"tokens": [ids]} → {"prompt": text}."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = service.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab for t in tokens):
        raise InvalidRequestError("tokens", f"must be a list of token ids in [0, {vocab})")
    return {"prompt": service.tokenizer.decode(tokens, skip_special_tokens=False)}
