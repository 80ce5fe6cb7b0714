"""What rank 0 tells the other ranks of a worker for one micro-batch (a "step plan"), and what
the last stage sends back (sampled tokens, prompt logprobs). msgpack bytes, built here and
nowhere else.

Every rank rebuilds the same ForwardBatch from a plan: build_batch reads only the chunk's
tokens, its start, the page ids (and the capped chunked layers' own, shared/kv/chunk_cache.py),
whether the request samples and the prompt tokens it scores."""

from dataclasses import dataclass, field

import msgpack
import torch

from shared.engine.prompt_logprobs import PromptLogprobChunk
from shared.engine.request import PromptTargets
from shared.engine.scheduler import ScheduledRequest, SchedulerOutput
from shared.sampling.batch import SamplingRow
from shared.sampling.logprobs import TokenLogprob
from shared.sampling.params import SamplingParams
from shared.sampling.sampler import SamplerOutput
from shared.sampling.token_mask import TokenMasks
from shared.wire import from_plain, to_plain

PLAN_VERSION = 5


@dataclass
class PlannedSeq:
    """A scheduled request as a rank other than 0 sees it (duck-types Request for build_batch)."""

    request_id: str
    start: int  # num_computed_tokens before this step
    chunk: list[int]  # token ids [start, start + len(chunk)) computed this step
    page_ids: list[int]
    samples: bool  # this step computes the request's last pending token
    prompt: PromptTargets | None = None  # the prompt tokens this chunk scores (prompt logprobs)
    chunk_page_ids: list[list[int]] = field(default_factory=list)  # capped chunked layers'
    # pages, one list a page group (as Request's)
    chunk_first_page: int = 0  # the logical page of each list's first (as Request's)
    dp_rank: int = 0  # the data-parallel rank that computes it (as Request's)

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.chunk[start - self.start : end - self.start]

    def prompt_targets(self, start: int, end: int) -> PromptTargets | None:
        return self.prompt  # rank 0's Request.prompt_targets of this chunk


@dataclass
class StepPlan:
    micro_batch: int  # id, rising; results come back in this order
    seqs: list[PlannedSeq]
    rows: list[SamplingRow]  # sampling state of the seqs that sample, in order
    push: dict  # prefill workers: KVHandoff.plan_extras (new and dropped targets), else {}
    stop: bool = False  # the worker is shutting down: ranks exit
    masks: TokenMasks | None = None  # grammar rows' allowed tokens (the last stage samples)

    def scheduler_output(self) -> SchedulerOutput:
        return SchedulerOutput(
            [ScheduledRequest(s, s.start, len(s.chunk), s.samples) for s in self.seqs]
        )


def encode_plan(
    micro_batch: int,
    out: SchedulerOutput,
    push: dict | None = None,
    masks: TokenMasks | None = None,
) -> bytes:
    seqs, rows = [], []
    for s in out.scheduled:
        req, end = s.request, s.start + s.num_tokens
        targets = req.prompt_targets(s.start, end)
        prompt = None if targets is None else [targets.first, targets.target_ids, targets.num_top]
        tokens = req.token_ids(s.start, end)
        seqs.append(
            [req.request_id, s.start, tokens, req.page_ids, s.samples, prompt, req.chunk_page_ids,
             req.chunk_first_page, req.dp_rank]
        )  # fmt: skip
        if s.samples:
            rows.append(_encode_row(req))
    body = {"v": PLAN_VERSION, "mb": micro_batch, "seqs": seqs, "rows": rows, "push": push or {}}
    if masks is not None:  # (R,) row ids, (R, W) int32 words as raw bytes
        bitmask = masks.bitmask.contiguous()
        body["masks"] = [masks.row_ids.tolist(), bitmask.shape[1], bitmask.numpy().tobytes()]
    return msgpack.packb(body)


def encode_stop() -> bytes:
    return msgpack.packb({"v": PLAN_VERSION, "stop": True})


def decode_plan(data: bytes) -> StepPlan:
    body = msgpack.unpackb(data)
    if body.get("v") != PLAN_VERSION:
        raise ValueError(f"step plan version {body.get('v')} != {PLAN_VERSION}")
    if body.get("stop"):
        return StepPlan(-1, [], [], {}, stop=True)
    seqs = []
    for rid, start, chunk, pages, samples, prompt, chunk_pages, chunk_first, dp in body["seqs"]:
        targets = None if prompt is None else PromptTargets(*prompt)
        seqs.append(
            PlannedSeq(rid, start, chunk, pages, samples, targets, chunk_pages, chunk_first, dp)
        )
    rows = [_decode_row(r) for r in body["rows"]]
    masks = _decode_masks(*body["masks"]) if "masks" in body else None
    return StepPlan(body["mb"], seqs, rows, body["push"], masks=masks)


def _decode_masks(row_ids: list[int], words: int, data: bytes) -> TokenMasks:
    bitmask = torch.frombuffer(bytearray(data), dtype=torch.int32).view(len(row_ids), words)
    return TokenMasks(torch.tensor(row_ids, dtype=torch.int64), bitmask)


def _encode_row(req) -> list:
    params = to_plain(req.params)  # the wire's encoding (nested specs, pairs as lists)
    prompt = req.prompt_token_ids if req.params.repetition_penalty != 1.0 else []
    return [params, req.seed, prompt, req.output_token_ids, sorted(req.stop_token_ids)]


def _decode_row(row: list) -> SamplingRow:
    params, seed, prompt, output, stop = row
    return SamplingRow(from_plain(SamplingParams, params), seed, prompt, output, frozenset(stop))


def encode_result(
    micro_batch: int,
    sample_index: list[int],
    samples: SamplerOutput | None,
    busy_s: float,
    prompt_logprobs: list[PromptLogprobChunk] = (),
) -> bytes:
    """The last stage's answer to one plan (no samples when nothing sampled); busy_s: the
    sender's seconds of work so far (ModelRunner.busy_s), for utilisation reports."""
    body = {"v": PLAN_VERSION, "mb": micro_batch, "index": sample_index, "busy_s": busy_s}
    body["prompt"] = [_encode_chunk(c) for c in prompt_logprobs]
    if samples is not None:
        body["tokens"] = samples.token_list()
        for key in ("logprobs", "top_logprob_ids", "top_logprobs"):
            value = getattr(samples, key)
            body[key] = None if value is None else value.tolist()
    return msgpack.packb(body)


@dataclass
class StepReply:
    micro_batch: int
    sample_index: list[int]  # indices into the plan's seqs that sampled
    samples: SamplerOutput | None
    busy_s: float  # the last stage's seconds of work so far
    prompt_logprobs: list[PromptLogprobChunk]


def decode_result(data: bytes) -> StepReply:
    body = msgpack.unpackb(data)
    prompt = [_decode_chunk(*c) for c in body["prompt"]]
    samples = None
    if "tokens" in body:
        samples = SamplerOutput(
            token_ids=torch.tensor(body["tokens"], dtype=torch.int64),
            logprobs=_tensor(body["logprobs"], torch.float32),
            top_logprob_ids=_tensor(body["top_logprob_ids"], torch.int64),
            top_logprobs=_tensor(body["top_logprobs"], torch.float32),
        )
    return StepReply(body["mb"], body["index"], samples, body["busy_s"], prompt)


def _encode_chunk(c: PromptLogprobChunk) -> list:
    values = [[v.token_id, v.logprob, v.top_ids, v.top_logprobs] for v in c.values]
    return [c.index, c.first, values]


def _decode_chunk(index: int, first: int, values: list) -> PromptLogprobChunk:
    logprobs = [TokenLogprob(t, lp, tuple(ids), tuple(top)) for t, lp, ids, top in values]
    return PromptLogprobChunk(index, first, logprobs)


def _tensor(value, dtype):
    return None if value is None else torch.tensor(value, dtype=dtype)
