"""Engine results as wire messages."""

from shared.engine.request import Request
from shared.protocol import TokenItem, TokenLogprob, Usage


def token_item(
    req: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprob], error: str = ""
) -> TokenItem:
    """The request's progress of one step; the last item of a request carries finish and usage,
    the one of its first token its prompt logprobs (the engine computed its prompt)."""
    index = len(req.output_token_ids) - len(new_token_ids)
    prompt = tuple(req.prompt_logprobs) if index == 0 and new_token_ids else ()
    if not req.finished:
        return TokenItem(
            req.request_id,
            index,
            tuple(new_token_ids),
            tuple(new_logprobs),
            prompt_logprobs=prompt,
        )
    return TokenItem(
        request_id=req.request_id,
        index=index,
        token_ids=tuple(new_token_ids),
        logprobs=tuple(new_logprobs),
        prompt_logprobs=prompt,
        finish_reason=req.finish_reason.value,
        error=error,
        usage=Usage(req.num_prompt_tokens, len(req.output_token_ids)),
    )
