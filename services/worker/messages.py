"""Conversions between engine results and wire messages."""

from shared.engine.request import Request, TokenLogprobs
from shared.protocol import TokenItem, TokenLogprob, Usage


def to_wire_logprob(token_id: int, lp: TokenLogprobs) -> TokenLogprob:
    ids = tuple(t for t, _ in lp.top)
    values = tuple(v for _, v in lp.top)
    return TokenLogprob(token_id, lp.logprob, ids, values)


def from_wire_logprob(lp: TokenLogprob | None) -> TokenLogprobs | None:
    if lp is None:
        return None
    return TokenLogprobs(lp.logprob, list(zip(lp.top_ids, lp.top_logprobs)))


def token_item(
    req: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprobs], error: str = ""
) -> TokenItem:
    """The request's progress of one step; the last item of a request carries finish and usage."""
    index = len(req.output_token_ids) - len(new_token_ids)
    logprobs = tuple(to_wire_logprob(t, lp) for t, lp in zip(new_token_ids, new_logprobs))
    if not req.finished:
        return TokenItem(req.request_id, index, tuple(new_token_ids), logprobs)
    return TokenItem(
        request_id=req.request_id,
        index=index,
        token_ids=tuple(new_token_ids),
        logprobs=logprobs,
        finish_reason=req.finish_reason.value,
        error=error,
        usage=Usage(req.num_prompt_tokens, len(req.output_token_ids)),
    )
