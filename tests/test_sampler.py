"""The batched sampler: greedy, penalties, min_tokens, filters, seeds, distribution, logprobs."""

import math

import pytest
import torch

from shared.errors import InvalidRequestError, TisonError
from shared.sampling.noise import gumbel_noise, row_key, uniform_bits
from shared.sampling.params import SamplingParams
from shared.sampling.penalties import PenaltyTensors
from shared.sampling.sampler import (
    NUCLEUS_CANDIDATES,
    SamplingBatch,
    SamplingRow,
    request_stop_token_ids,
    sample,
    sample_greedy,
)

EOS = 3


def _row(seed=0, prompt=(1, 2), output=(), stop=frozenset({EOS}), **params) -> SamplingRow:
    return SamplingRow(
        SamplingParams(max_tokens=64, **params), seed, list(prompt), list(output), stop
    )


def _tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    batch = SamplingBatch.build(rows, logits.shape[-1], "cpu")
    return sample(logits, batch).token_ids.tolist()


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale


# --- counter-based noise ------------------------------------------------------------------


def _reference_bits(key: int, token: int) -> int:
    """The documented hash on exact unsigned integers: lowbias32 without its last xorshift."""
    mask = (1 << 32) - 1
    z = (key + (token + 1) * 0x9E3779B9) & mask
    z = ((z ^ (z >> 16)) * 0x21F0AAAD) & mask
    z = ((z ^ (z >> 15)) * 0x735A2D97) & mask
    return z >> 8


def test_uniform_bits_match_the_integer_reference():
    keys = [row_key(seed, step) for seed, step in [(0, 0), (-5, 3), (2**70 + 1, 9), (42, 1000)]]
    token_ids = torch.tensor([0, 1, 2, 77, 65535, 151_935])
    bits = uniform_bits(torch.tensor(keys, dtype=torch.int32), token_ids)
    expected = [[_reference_bits(k, int(t)) for t in token_ids] for k in keys]
    assert bits.tolist() == expected


def test_row_keys_differ_by_seed_and_step():
    keys = {row_key(seed, step) for seed in range(50) for step in range(50)}
    assert len(keys) == 2500
    assert row_key(7, 3) == row_key(7, 3)


def test_gumbel_noise_has_gumbel_moments():
    noise = gumbel_noise(torch.arange(64, dtype=torch.int32), torch.arange(4096))
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.01
    assert torch.isfinite(noise).all()


# --- greedy -------------------------------------------------------------------------------


def test_greedy_takes_the_argmax_in_float32_and_bfloat16():
    logits = _logits(5, 300)
    rows = [_row(seed=i, temperature=0.0) for i in range(5)]
    assert _tokens(logits, rows) == logits.argmax(-1).tolist()
    half = logits.to(torch.bfloat16)
    assert _tokens(half, rows) == half.float().argmax(-1).tolist()
    tiny = [_row(seed=i, temperature=1e-7) for i in range(5)]  # below MIN_TEMPERATURE
    assert _tokens(logits, tiny) == logits.argmax(-1).tolist()


def test_greedy_rows_of_a_mixed_batch_take_the_argmax():
    logits = _logits(6, 300)
    rows = [_row(seed=i, temperature=0.0 if i % 2 else 1.0, top_k=5 * (i % 3)) for i in range(6)]
    tokens = _tokens(logits, rows)
    assert [tokens[i] for i in (1, 3, 5)] == logits.argmax(-1)[[1, 3, 5]].tolist()


# --- penalties ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, output, plain",
    [
        ({"temperature": 0}, (), True),
        ({"temperature": 0, "min_tokens": 2}, (5, 6), True),  # min_tokens reached
        ({"temperature": 0, "min_tokens": 2, "ignore_eos": True}, (), None),  # no stop tokens
        ({"temperature": 0.7}, (), False),
        ({"temperature": 0, "logprobs": 0}, (), False),
        ({"temperature": 0, "logit_bias": {9: 50}}, (), False),
        ({"temperature": 0, "repetition_penalty": 1.5}, (), False),
        ({"temperature": 0, "frequency_penalty": 1.0}, (), False),
        ({"temperature": 0, "presence_penalty": -1.0}, (), False),
        ({"temperature": 0, "min_tokens": 2}, (5,), False),  # EOS still masked
    ],
)
def test_plain_greedy_rows_are_those_whose_token_is_the_argmax(params, output, plain):
    """SamplingRow.plain_greedy (the runner then takes the argmax with no SamplingBatch, and
    the fused call's argmax on CPU): what sample gives for such a row is the argmax; each
    setting that changes the logits or returns them makes a row not plain."""
    stop = frozenset() if plain is None else frozenset({EOS})
    row = _row(prompt=(9, 9), output=output, stop=stop, **params)
    assert row.plain_greedy == (plain is not False)
    logits = _logits(4, 16)
    logits[:, EOS] = logits[:, 9] = logits.max() + 1  # EOS and 9 tie as the argmax: EOS first
    if row.plain_greedy:
        rows = [row] * 4
        assert sample_greedy(logits).token_ids.tolist() == _tokens(logits, rows)


def _reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for b, row in enumerate(rows):
        p = row.params
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = out[b, token].item()
            out[b, token] = (
                value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            )
        for token in set(row.output_token_ids):
            count = row.output_token_ids.count(token)
            out[b, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


PENALTY_CASES = {
    "repetition": [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7), {}],
    "frequency": [dict(frequency_penalty=0.8), dict(frequency_penalty=-0.5), {}],
    "presence": [dict(presence_penalty=1.5), dict(presence_penalty=-1.0), {}],
    "all": [
        dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.6),
        dict(repetition_penalty=0.9, presence_penalty=-0.3),
        {},
    ],
}


@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_penalties_match_a_per_row_reference(case):
    vocab_size = 40
    logits = _logits(3, vocab_size, seed=1)
    rows = [
        _row(prompt=[1, 5, 5, 9, 30], output=[5, 7, 7, 7, 12, 39], **PENALTY_CASES[case][0]),
        _row(prompt=[0, 2, 3], output=[2, 2, 8], **PENALTY_CASES[case][1]),
        _row(prompt=[4, 6], output=[4, 6, 6], **PENALTY_CASES[case][2]),  # no penalty
    ]
    params = [r.params for r in rows]
    prompts = [r.prompt_token_ids for r in rows]
    outputs = [r.output_token_ids for r in rows]
    penalties = PenaltyTensors.build(params, prompts, outputs, vocab_size, "cpu")
    assert penalties is not None
    penalized = logits.clone()
    penalties.apply_(penalized.view(-1))
    expected = _reference_penalties(logits, rows)
    torch.testing.assert_close(penalized, expected)
    assert torch.equal(penalized[2], logits[2])


def test_greedy_sampling_sees_the_penalties():
    logits = torch.zeros(1, 6)
    logits[0, 4] = 2.0
    logits[0, 1] = 1.9
    plain = _row(output=[4], temperature=0.0)
    penalized = _row(output=[4], temperature=0.0, frequency_penalty=0.5)
    assert _tokens(logits, [plain]) == [4]
    assert _tokens(logits, [penalized]) == [1]
    assert PenaltyTensors.build([plain.params], [[1]], [[4]], 6, "cpu") is None


def test_penalty_token_outside_the_vocabulary_is_rejected():
    with pytest.raises(InvalidRequestError):
        SamplingBatch.build([_row(prompt=[1, 99], repetition_penalty=1.1)], 50, "cpu")


# --- min_tokens and stop tokens -----------------------------------------------------------


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    logits[0, 7] = 4.0
    logits[0, 8] = 1.0
    stop = frozenset({EOS, 7})
    early = _row(output=[1, 2], stop=stop, temperature=0.0, min_tokens=3)
    reached = _row(output=[1, 2, 1], stop=stop, temperature=0.0, min_tokens=3)
    assert _tokens(logits, [early]) == [8]
    assert _tokens(logits, [reached]) == [EOS]
    drawn = _tokens(
        logits.expand(500, 10).contiguous(),
        [_row(seed=s, output=[1], stop=stop, min_tokens=2) for s in range(500)],
    )
    assert EOS not in drawn and 7 not in drawn


def test_ignore_eos_leaves_eos_unmasked_and_keeps_stop_token_ids():
    params = SamplingParams(max_tokens=8, min_tokens=4, ignore_eos=True, stop_token_ids=[6])
    stop = request_stop_token_ids(params, eos_token_ids=[EOS])
    assert stop == frozenset({6})
    with_eos = request_stop_token_ids(SamplingParams(stop_token_ids=[6]), eos_token_ids=[EOS])
    assert with_eos == frozenset({EOS, 6})
    logits = torch.zeros(2, 10)
    logits[:, EOS] = 5.0
    logits[:, 6] = 4.0
    ignoring = SamplingRow(
        SamplingParams(
            max_tokens=8, min_tokens=4, ignore_eos=True, stop_token_ids=[6], temperature=0
        ),
        0,
        [1],
        [],
        stop,
    )
    masked = _row(stop=with_eos, temperature=0.0, min_tokens=4, stop_token_ids=[6])
    assert _tokens(logits, [ignoring, masked]) == [EOS, 0]


# --- top-k, top-p, min-p ------------------------------------------------------------------


def _reference_filter(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row of scaled logits with filtered tokens at -inf, written the plain way."""
    order = x.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(x[kept], dim=0).tolist()
    nucleus, mass = [], 0.0
    for token, prob in zip(kept, probs, strict=True):
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += prob
    out = torch.full_like(x, float("-inf"))
    out[nucleus] = x[nucleus]
    if min_p > 0:
        out[out < out.max() + math.log(min_p)] = float("-inf")
    return out


FILTER_CASES = [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(top_k=12, top_p=0.7),  # the nucleus is taken from the top-k's renormalized mass
    dict(top_k=12, top_p=0.7, min_p=0.3),  # 64 -> 12 -> 5 -> 3 tokens
    dict(top_k=1),
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=lambda c: "-".join(map(str, c.items())))
def test_filters_draw_exactly_what_a_masked_whole_row_draw_would(case):
    vocab_size, num_rows, temperature = 64, 300, 0.8
    logits = _logits(1, vocab_size, seed=2, scale=1.0).expand(num_rows, vocab_size).contiguous()
    rows = [_row(seed=s, temperature=temperature, **case) for s in range(num_rows)]
    tokens = _tokens(logits, rows)
    masked = _reference_filter(
        logits[0] / temperature, case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0)
    )
    allowed = set(torch.isfinite(masked).nonzero().flatten().tolist())
    assert set(tokens) <= allowed
    assert len(set(tokens)) == len(allowed)  # 300 draws reach every kept token here
    keys = torch.tensor([row_key(s, 0) for s in range(num_rows)], dtype=torch.int32)
    noise = gumbel_noise(keys, torch.arange(vocab_size))
    assert tokens == (masked + noise).argmax(-1).tolist()


def test_rows_with_different_filters_share_a_batch():
    vocab_size, temperature = 64, 0.8
    cases = [*FILTER_CASES, {}] * 20
    logits = _logits(1, vocab_size, seed=2, scale=1.0).expand(len(cases), vocab_size).contiguous()
    rows = [_row(seed=s, temperature=temperature, **c) for s, c in enumerate(cases)]
    tokens = _tokens(logits, rows)
    keys = torch.tensor([row_key(s, 0) for s in range(len(cases))], dtype=torch.int32)
    noise = gumbel_noise(keys, torch.arange(vocab_size))
    for b, case in enumerate(cases):
        masked = _reference_filter(
            logits[b] / temperature,
            case.get("top_k", 0),
            case.get("top_p", 1.0),
            case.get("min_p", 0.0),
        )
        assert tokens[b] == (masked + noise[b]).argmax().item(), case


@pytest.mark.parametrize("scale", [0.3, 8.0], ids=["wide-nucleus", "narrow-nucleus"])
def test_top_p_without_top_k_over_a_large_vocabulary(scale):
    vocab_size, num_rows = 3 * NUCLEUS_CANDIDATES, 20
    logits = _logits(num_rows, vocab_size, seed=3, scale=scale)
    rows = [_row(seed=s, top_p=0.9) for s in range(num_rows)]
    tokens = _tokens(logits, rows)
    keys = torch.tensor([row_key(s, 0) for s in range(num_rows)], dtype=torch.int32)
    noise = gumbel_noise(keys, torch.arange(vocab_size))
    for b in range(num_rows):
        masked = _reference_filter(logits[b], 0, 0.9, 0.0)
        assert tokens[b] == (masked + noise[b]).argmax().item()


# --- seeds --------------------------------------------------------------------------------


def _generate(target: SamplingRow, companions: list[SamplingRow], position: int, steps: int):
    """Tokens of `target` over `steps` steps; its logits depend on the step only."""
    output: list[int] = []
    vocab_size = 200
    for step in range(steps):
        rows = list(companions)
        me = SamplingRow(
            target.params, target.seed, target.prompt_token_ids, list(output), target.stop_token_ids
        )
        rows.insert(position, me)
        logits = _logits(len(rows), vocab_size, seed=1000 + step, scale=1.5)
        logits[position] = _logits(1, vocab_size, seed=step, scale=1.5)[0]
        output.append(_tokens(logits, rows)[position])
    return output


def test_seeded_rows_repeat_whatever_the_batch_and_position():
    target = _row(seed=1234, temperature=0.9, top_p=0.95)
    alone = _generate(target, [], 0, 12)
    companions = [
        _row(seed=1, temperature=0.0),
        _row(seed=2, top_k=3, logprobs=2),
        _row(seed=3, repetition_penalty=1.5, output=[1, 2]),
        _row(seed=4, min_tokens=5, temperature=0.5),
        _row(seed=5, top_p=0.5, min_p=0.1),
    ]
    assert _generate(target, companions, 3, 12) == alone
    assert _generate(target, companions[:2], 2, 12) == alone
    other_seed = _row(seed=4321, temperature=0.9, top_p=0.95)
    assert _generate(other_seed, [], 0, 12) != alone


def test_recompute_after_preemption_draws_the_same_token():
    logits = _logits(1, 500, seed=9, scale=1.0)
    row = _row(seed=77, output=[10, 11, 12])
    again = _row(seed=77, output=[10, 11, 12])
    next_step = _row(seed=77, output=[10, 11, 12, 13])
    first = _tokens(logits, [row])
    assert _tokens(logits, [again]) == first
    draws = {_tokens(logits, [_row(seed=77, output=[0] * n)])[0] for n in range(20)}
    assert len(draws) > 5  # the output index moves the stream
    assert _tokens(logits, [next_step]) == _tokens(logits, [_row(seed=77, output=[0, 0, 0, 0])])


# --- distribution -------------------------------------------------------------------------

CHI2_99_9 = {9: 27.88, 4: 18.47}  # chi-square critical values at p = 0.001 by degrees of freedom


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert counts[~support].sum() == 0
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item()


def test_draws_follow_softmax_of_logits_over_temperature():
    vocab_size, num_draws, temperature = 10, 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2, 0.8, -2.0])
    rows = [_row(seed=s, output=[0] * (s % 5), temperature=temperature) for s in range(num_draws)]
    tokens = _tokens(logits.expand(num_draws, vocab_size).contiguous(), rows)
    probs = torch.softmax(logits / temperature, dim=0)
    assert _chi_square(tokens, probs) < CHI2_99_9[9]
    empirical = torch.bincount(torch.tensor(tokens), minlength=vocab_size) / num_draws
    assert (empirical - probs).abs().sum().item() / 2 < 0.015  # total variation


def test_filtered_draws_follow_the_renormalized_distribution():
    vocab_size, num_draws = 10, 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2, 0.8, -2.0])
    rows = [_row(seed=10**6 + s, top_k=5) for s in range(num_draws)]
    tokens = _tokens(logits.expand(num_draws, vocab_size).contiguous(), rows)
    top5 = logits.topk(5).indices
    probs = torch.zeros(vocab_size)
    probs[top5] = torch.softmax(logits[top5], dim=0)
    assert _chi_square(tokens, probs) < CHI2_99_9[4]


# --- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits():
    logits = _logits(4, 100, seed=5).to(torch.bfloat16)
    rows = [
        _row(seed=1, logprobs=3, temperature=0.5, repetition_penalty=2.0, output=[4, 5]),
        _row(seed=2, logprobs=0, temperature=0.0),
        _row(seed=3),
        _row(seed=4, logprobs=5, top_k=2),
    ]
    out = sample(logits, SamplingBatch.build(rows, 100, "cpu"))
    reference = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_logprob_ids.shape == (4, 5)
    top = reference.topk(5, dim=-1)
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.logprobs.dtype == out.top_logprobs.dtype == torch.float32


def test_no_logprobs_fields_when_none_asked():
    out = sample(_logits(2, 30), SamplingBatch.build([_row(), _row(seed=1)], 30, "cpu"))
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (2,)


def test_logits_of_the_wrong_shape_are_rejected():
    batch = SamplingBatch.build([_row()], 30, "cpu")
    with pytest.raises(TisonError):
        sample(_logits(1, 31), batch)


def test_cheap_batches_skip_unused_tensors():
    greedy = SamplingBatch.build([_row(temperature=0.0), _row(seed=1, temperature=0.0)], 50, "cpu")
    assert greedy.random == () and greedy.penalties is None and greedy.stop_mask is None
    mixed = SamplingBatch.build([_row(), _row(seed=1, top_k=4), _row(temperature=0.0)], 50, "cpu")
    assert [g.row_ids.tolist() for g in mixed.random] == [[0], [1]]
    assert mixed.random[0].top_k is None and mixed.random[1].top_p is None
    assert greedy.bias is None and greedy.masks is None


# --- logit_bias and grammar masks ----------------------------------------------------------


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one():
    logits = _logits(4, 40, seed=3)
    top = logits.argmax(dim=-1).tolist()
    forced = [(17, 100.0)]
    rows = [
        _row(temperature=0.0, logit_bias=forced),
        _row(seed=1, logit_bias=forced),
        _row(temperature=0.0, logit_bias=[(top[2], -100.0)]),
        _row(seed=3, temperature=0.0),  # no bias: its argmax
    ]
    tokens = _tokens(logits, rows)
    assert tokens[:2] == [17, 17]
    assert tokens[2] != top[2] and tokens[2] == int(logits[2].topk(2).indices[1])
    assert tokens[3] == top[3]


def test_logit_bias_bans_a_token_in_every_random_draw():
    logits = torch.zeros(1, 3)  # uniform: each token drawn about a third of the time
    banned = [_row(seed=s, logit_bias={1: -100}) for s in range(200)]
    assert 1 not in _tokens(logits.expand(200, 3).contiguous(), banned)
    shifted = _tokens(logits.expand(200, 3).contiguous(), [_row(seed=s) for s in range(200)])
    assert 1 in shifted  # without the bias it is drawn


def test_logit_bias_adds_to_the_logits_before_temperature():
    """A bias of b on a uniform row makes the token e^b times likelier than the others: the
    draw follows softmax(logits + bias) (the same chi-square check as unbiased draws)."""
    bias = {0: 1.0, 2: -1.0}
    rows = [_row(seed=s, logit_bias=bias) for s in range(3000)]
    logits = torch.zeros(3000, 4)
    probs = torch.softmax(torch.tensor([1.0, 0.0, -1.0, 0.0]), dim=0)
    assert _chi_square(_tokens(logits, rows), probs) < 16.3  # p = 0.001 at 3 d.o.f.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_stay_those_of_the_raw_logits_under_a_bias(dtype):
    """bf16 logits are copied to float32 once; with no logprobs asked the bias goes into that
    copy, with logprobs into another: the logprobs, and the caller's logits, stay raw."""
    logits = _logits(1, 30, seed=4).to(dtype)
    before = logits.clone()
    for asked in (None, 2):
        row = _row(logprobs=asked, logit_bias={5: 100})
        out = sample(logits, SamplingBatch.build([row], 30, "cpu"))
        assert out.token_ids.tolist() == [5] and torch.equal(logits, before)
    raw = torch.log_softmax(logits.float(), -1)[0, 5]
    assert math.isclose(float(out.logprobs[0]), float(raw), rel_tol=1e-6)


def test_logit_bias_is_validated():
    for bad, problem in [
        ({-1: 1.0}, "token ids"),
        ({3: 100.5}, "biases"),
        ({3: float("nan")}, "biases"),
        ({True: 1.0}, "token ids"),
        ({i: 1.0 for i in range(301)}, "at most 300"),
        ([(3, 1.0), (3, 2.0)], "repeat"),
        ([(3,)], "pairs"),
    ]:
        with pytest.raises(InvalidRequestError, match=problem) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.field == "logit_bias"
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))


def _bitmask(allowed: list[list[int]], vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words with the bits of `allowed` set (llguidance's layout)."""
    words = torch.zeros(len(allowed), -(-vocab_size // 32), dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_grammar_masks_restrict_greedy_and_random_rows_of_a_mixed_batch():
    from shared.sampling.token_mask import TokenMasks, penalty

    vocab = 70  # three words, the last one partly used
    open_ids = (penalty(_bitmask([[0, 31, 33, 69]], vocab), vocab) == 0).nonzero()[:, 1]
    assert open_ids.tolist() == [0, 31, 33, 69]
    logits = _logits(4, vocab, seed=5)
    rows = [_row(temperature=0.0), _row(seed=1), _row(seed=2, top_k=3), _row(temperature=0.0)]
    masks = TokenMasks(torch.tensor([0, 1, 2]), _bitmask([[31, 64], [5, 40, 69], [2, 3]], vocab))
    for _ in range(20):
        batch = SamplingBatch.build(rows, vocab, "cpu", masks)
        tokens = sample(logits, batch).token_ids.tolist()
        assert tokens[0] == (31 if logits[0, 31] > logits[0, 64] else 64)
        assert tokens[1] in (5, 40, 69) and tokens[2] in (2, 3)
        assert tokens[3] == int(logits[3].argmax())  # unmasked
        rows = [
            _row(seed=s + 7, temperature=r.params.temperature, top_k=r.params.top_k)
            for s, r in enumerate(rows)
        ]


def test_grammar_rows_ignore_min_tokens_the_grammar_decides_the_end():
    from shared.sampling.token_mask import TokenMasks

    logits = _logits(1, 10, seed=6)
    row = _row(temperature=0.0, min_tokens=5)  # EOS masked below min_tokens without a grammar
    masks = TokenMasks(torch.tensor([0]), _bitmask([[EOS]], 10))
    assert sample(logits, SamplingBatch.build([row], 10, "cpu", masks)).token_ids.tolist() == [EOS]
