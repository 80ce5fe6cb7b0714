"""The KV pool: zeros until written, in memory that is not touched until a request uses it."""

import os

import torch

from shared.kv.cache import KVCache, zeroed_pages
from shared.kv.spec import MHAKVSpec


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_private_pool_reads_zero_and_keeps_what_is_written():
    spec = MHAKVSpec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    kv = KVCache(spec, num_pages=3)
    assert kv.data.shape == spec.pool_shape(3) and kv.data.dtype == torch.bfloat16
    assert kv.data.is_contiguous() and not kv.data.any()
    kv.layer(1)[0, 2, 1] = 1.5  # K of layer 1, page 2, token 1
    assert kv.data[1, 0, 2, 1].eq(1.5).all() and kv.data.count_nonzero() == 2 * 8
    assert kv.nbytes == 2 * 2 * 3 * 4 * 2 * 8 * 2


def test_a_pool_costs_no_memory_until_its_pages_are_used():
    before = _rss_bytes()
    pool = zeroed_pages((64, 1 << 20), torch.float32)  # 256 MiB
    assert _rss_bytes() - before < (32 << 20)
    pool[0].fill_(1.0)
    assert pool[0].sum() == 1 << 20 and not pool[1:].any()


def test_an_empty_shape_is_an_empty_tensor():
    assert zeroed_pages((0, 4), torch.float32).shape == (0, 4)
