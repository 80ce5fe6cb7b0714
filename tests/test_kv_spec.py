"""KV layout specs: what a page costs, how TP ranks divide a layer, which replica sends it."""

import pytest
import torch

from shared.kv.cache import KVCache
from shared.kv.layer_groups import LayerGroupKVSpec
from shared.kv.spec import MHAKVSpec, MLAKVSpec

BF16 = torch.bfloat16


def test_mha_divides_heads_and_replicates_them_when_ranks_outnumber_them():
    spec = MHAKVSpec(4, 16, num_kv_heads=8, head_dim=128, dtype=BF16)
    assert spec.page_size_bytes == 4 * 16 * 2 * 8 * 128 * 2
    assert [spec.rank_units(r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(spec.writes(r, 4) for r in range(4))
    two = MHAKVSpec(4, 16, num_kv_heads=2, head_dim=128, dtype=BF16)
    assert [two.rank_units(r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [two.writes(r, 4) for r in range(4)] == [True, False, True, False]
    assert two.shard((2, 4), (1, 2)) == MHAKVSpec(2, 16, 1, 128, BF16)
    with pytest.raises(ValueError, match="KV heads"):
        two.shard((0, 4), (1, 3))


def test_mla_holds_one_latent_per_token_on_every_rank():
    # DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64, 61 layers
    spec = MLAKVSpec(61, 64, kv_lora_rank=512, rope_dim=64, dtype=BF16)
    assert spec.page_size_bytes == 61 * 64 * 576 * 2
    assert spec.pool_shape(10) == (61, 10, 64, 576)
    assert [spec.rank_units(r, 8) for r in range(8)] == [(0, 1)] * 8
    assert [spec.writes(r, 8) for r in range(8)] == [True] + [False] * 7
    assert spec.shard((0, 30), (0, 1)).num_layers == 30
    assert spec.layout == "mla:L61:R512:P64:S64:bfloat16"


def test_slots_follow_the_page_table():
    spec = MLAKVSpec(1, 4, 8, 0, BF16)
    assert spec.slots([3, 0], 2, 7).tolist() == [14, 15, 0, 1, 2]


def test_layer_groups_keep_each_layers_own_shape_in_one_pool():
    groups = LayerGroupKVSpec(
        (((0, 2), MHAKVSpec(2, 4, 2, 8, BF16)), ((1,), MHAKVSpec(1, 4, 2, 16, BF16)))
    )
    assert groups.page_size_bytes == 4 * 2 * 2 * (8 + 8 + 16) * 2
    kv = KVCache(groups, num_pages=3)
    assert [tuple(kv.layer(i).shape) for i in range(3)] == [(2, 3, 4, 2, 8), (2, 3, 4, 2, 16)] + [
        (2, 3, 4, 2, 8)
    ]
    kv.layer(1).fill_(1.0)  # layer 1 is the 16-wide group's only layer: the others stay zero
    assert not kv.layer(0).any() and not kv.layer(2).any()
    assert kv.data.count_nonzero() == 2 * 3 * 4 * 2 * 16
    shard = groups.shard((1, 3), (0, 1))
    assert shard.num_layers == 2 and shard.layer_token_bytes(0) == 2 * 16 * 2
    with pytest.raises(ValueError, match="cover layers"):
        LayerGroupKVSpec((((0, 2), MHAKVSpec(2, 4, 2, 8, BF16)),))
    with pytest.raises(ValueError, match="one page size"):
        LayerGroupKVSpec((((0,), MHAKVSpec(1, 4, 2, 8, BF16)), ((1,), MHAKVSpec(1, 8, 2, 8, BF16))))
