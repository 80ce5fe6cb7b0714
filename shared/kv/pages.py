"""The page rule: how many KV pages a request needs, in one place for all who count them (the
engine's scheduler, the scheduler service's router, the fake decode worker). Pure: no torch.

The rule is vLLM's and SGLang's. A request is admitted when its KV so far (the prompt, or prompt
and output when it is recomputed after a preemption) and the token it samples next fit in the
free pages: `pages_to_admit`. It then grows a page at a time as it decodes (`pages_to_grow`);
when the pool is full, the newest running request is preempted (its pages freed, its tokens
recomputed later). A decode worker reserves `pages_to_admit(prompt)` when it accepts a request
whose prompt a prefill worker computes, so its first decode step needs no page more.

max_tokens reserves nothing: most requests stop long before it (a chat request's default is the
rest of the context), so holding pages for it would make a worker refuse requests that fit.

The router predicts with the same function what a decode worker accepts now: it picks a worker
whose free pages (its heartbeat's, less what the router assigned since) hold
`pages_to_reserve(prompt)` (`pages_to_admit`, and where the worker caps chunked layers, their
page groups' pages of the first decoded token's window, as its heartbeat says) and counts them
against it until the next heartbeat. It does not use
max_tokens as a soft signal for spreading load either: as an estimate of a request's length it
is mostly far off, and a heartbeat says nothing of how long the running requests will grow;
ranking by running sequences, then free pages, spreads the streams that will grow, and
preemption on the worker absorbs the rest. max_tokens enters one hard limit only: a request
whose prompt + max_tokens exceeds every decode worker's whole pool could not finish even alone,
and the router refuses it (TOO_LONG).
"""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold the KV of `num_tokens` tokens."""
    return -(-num_tokens // page_size)


def pages_to_admit(num_tokens: int, page_size: int) -> int:
    """Pages a request needs to start: its `num_tokens` tokens so far (prompt, or prompt and
    output) and the one it samples next."""
    return pages_for(num_tokens + 1, page_size)


def pages_to_reserve(num_tokens: int, page_size: int, chunk: int = 0, groups: int = 0) -> int:
    """Pages a request with `num_tokens` tokens so far takes to start: pages_to_admit, and
    where chunked layers are capped (chunks of `chunk` tokens, their pages in `groups` page
    groups: shared/kv/chunk_cache.py) each group's pages of the next token's window."""
    pages = pages_to_admit(num_tokens, page_size)
    if groups:
        first, end = chunk_window(num_tokens, num_tokens + 1, chunk, page_size)
        pages += groups * (end - first)
    return pages


def fits(free_pages: int, num_tokens: int, page_size: int, chunk: int = 0, groups: int = 0) -> bool:
    """Whether a request with `num_tokens` tokens so far is admitted with `free_pages` free."""
    return free_pages >= pages_to_reserve(num_tokens, page_size, chunk, groups)


def pages_to_grow(num_held: int, num_tokens: int, page_size: int) -> int:
    """Pages to add to the `num_held` a request holds before computing up to `num_tokens`."""
    return max(0, pages_for(num_tokens, page_size) - num_held)


def chunk_window(start: int, end: int, chunk: int, page_size: int) -> tuple[int, int]:
    """[first, end) logical pages that a chunked layer (chunks of `chunk` tokens) reads or
    writes computing tokens [start, end): from the chunk of `start` on."""
    return start // chunk * chunk // page_size, pages_for(end, page_size)
