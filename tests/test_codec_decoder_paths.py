"""The C decoder's fast paths against the original bits and the numpy reference: the pair
table (two codes per lookup when both fit its 12 bits, one when not), codes at every length
from 1 to the 12-bit limit, the widest symbols (11 bits, NaN and inf exponents), runs that end
mid-tile and mid-group, lanes of unequal length, the merge of every raw-field layout, and the
helper threads kept between calls (concurrent calls, a forked child)."""

import numpy as np
import pytest
import torch

from shared.codec import decode_tensor, decode_tensors, encode_tensor
from shared.codec.format import LAYOUTS, MAX_CODE_LEN
from shared.codec.tensor import full_lengths

from compilers import needs_compiler

pytestmark = needs_compiler

UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def skewed(n: int, dtype: torch.dtype, k: int, seed: int = 0, ratio: float = 0.5) -> torch.Tensor:
    """n elements whose symbols (the bits under the sign, down to bit k) follow a geometric
    law over the whole alphabet, so that the code has lengths 1, 2, ... up to the 12-bit
    limit; sign and low bits random."""
    layout = LAYOUTS[dtype]
    rng = np.random.default_rng(seed)
    symbols = 1 << (layout.width - 1 - k)
    p = ratio ** np.arange(symbols, dtype=np.float64)
    sym = rng.permutation(symbols)[rng.choice(symbols, size=n, p=p / p.sum())]
    low = rng.integers(0, 1 << k, size=n) if k else np.zeros(n, dtype=np.int64)
    sign = rng.integers(0, 2, size=n)
    u = (sign << (layout.width - 1)) | (sym << k) | low
    bits = u.astype(UNSIGNED[layout.width // 8])
    return torch.from_numpy(bits.view(np.dtype(f"i{layout.width // 8}"))).view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = LAYOUTS[a.dtype].int_dtype
    return a.shape == b.shape and torch.equal(a.view(width), b.view(width))


CASES = [(dtype, k) for dtype, layout in LAYOUTS.items() for k in layout.candidate_ks()]


@pytest.mark.parametrize("dtype,k", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("n", [1024, 1024 + 37, 100_003])
def test_codes_of_every_length_decode_exactly(dtype, k, n):
    tensor = skewed(n, dtype, k, seed=n).reshape(1, n)
    encoded = encode_tensor(tensor, "w", k=k)
    used = full_lengths(encoded)
    assert used[used > 0].min() <= 2 and (n < 50_000 or used.max() == MAX_CODE_LEN)
    for threads in (1, 3):
        assert same_bits(decode_tensor(encoded, backend="native", num_threads=threads), tensor)
    if n < 10_000:
        assert same_bits(decode_tensor(encoded, backend="reference"), tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_widest_symbols_with_nan_and_inf_exponents(dtype):
    # Split at the smallest k: 11-bit symbols for BF16 and FP32, where all-ones exponents
    # (inf, NaN) give the largest symbol values the pair table holds.
    k = min(LAYOUTS[dtype].candidate_ks())
    g = torch.Generator().manual_seed(1)
    tensor = (torch.randn(300, 301, generator=g) * 3).to(dtype)
    flat = tensor.view(-1)
    flat[::97] = float("inf")
    flat[5::89] = -float("inf")
    flat[7::83] = float("nan")
    flat[11::79] = 0.0
    encoded = encode_tensor(tensor, "w", k=k)
    for threads in (1, 2):
        assert same_bits(decode_tensor(encoded, backend="native", num_threads=threads), tensor)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_one_symbol_fills_the_pair_table(dtype):
    # A 1-bit code: every lookup yields two symbols and reads 2 of its 12 bits.
    for n in (1024, 5000, 70_001):
        tensor = torch.full((1, n), -1.5, dtype=dtype)
        tensor.view(-1)[::3] = 1.5  # the sign is a raw bit: the symbol stays the same
        encoded = encode_tensor(tensor, "w")
        assert int(full_lengths(encoded).max()) == 1
        assert same_bits(decode_tensor(encoded, backend="native"), tensor)


def test_runs_of_unequal_length_and_tensors_of_every_small_size():
    # Runs start on blocks, so the runs of one work item differ in length and some lanes
    # finish before others; tensors just above the coding threshold end mid-group.
    rng = np.random.default_rng(7)
    tensors = [skewed(int(n), torch.float8_e4m3fn, 1, seed=int(n), ratio=0.7).reshape(1, -1)
               for n in rng.integers(1024, 4000, size=12)]  # fmt: skip
    tensors += [skewed(150_001, torch.float8_e4m3fn, 0, ratio=0.8).reshape(1, -1)]
    tensors += [skewed(333_333, torch.bfloat16, 5, ratio=0.8).reshape(1, -1)]
    encoded = [encode_tensor(t, f"t{i}") for i, t in enumerate(tensors)]
    assert len(encoded[-1].planes.block_first) >= 6
    for threads in (1, 2, 4):
        decoded = decode_tensors(encoded, backend="native", num_threads=threads)
        assert all(same_bits(got, want) for got, want in zip(decoded, tensors))


def test_calls_from_several_threads_at_once():
    # One call at a time uses the kept helper threads; the others start their own.
    from concurrent.futures import ThreadPoolExecutor

    tensors = [skewed(200_000 + 999 * i, torch.float8_e4m3fn, 1, seed=i).reshape(1, -1)
               for i in range(4)]  # fmt: skip
    encoded = [encode_tensor(t, f"t{i}") for i, t in enumerate(tensors)]

    def decode_many(i: int) -> bool:
        return all(same_bits(decode_tensor(encoded[i], num_threads=2), tensors[i])
                   for _ in range(20))  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(decode_many, range(4)))


def _decode_in_child(queue, encoded, tensor):
    queue.put(same_bits(decode_tensor(encoded, num_threads=2), tensor))


# Python 3.12+ warns about forking a process that has threads: that is the point here.
@pytest.mark.filterwarnings("ignore:This process.*is multi-threaded:DeprecationWarning")
def test_a_forked_child_decodes_on_its_own_threads():
    # The parent's helper threads do not exist in a forked child: it must start its own
    # rather than wait for them.
    import multiprocessing

    tensor = skewed(300_000, torch.bfloat16, 5).reshape(1, -1)
    encoded = encode_tensor(tensor, "w")
    assert same_bits(decode_tensor(encoded, num_threads=2), tensor)  # helpers now exist
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=(queue, encoded, tensor))
    child.start()
    child.join(timeout=60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0 and queue.get(timeout=5)
