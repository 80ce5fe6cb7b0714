"""Where the engine runs: EngineConfig.device (the CPU only, for now), which places the
weights, the KV pool and every step's tensors."""

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.kv.cache import KVCache
from shared.kv.spec import MHAKVSpec


def test_device_is_cpu_for_now(tmp_path):
    with pytest.raises(InvalidRequestError, match="CUDA path is not built yet") as e:
        EngineConfig(model_dir=tmp_path, device="cuda")
    assert e.value.field == "device"
    with pytest.raises(InvalidRequestError, match="device: must be one of cpu"):
        EngineConfig(model_dir=tmp_path, device="tpu")
    assert EngineConfig(model_dir=tmp_path).torch_device == torch.device("cpu")


def test_the_shared_memory_pool_is_a_cpu_pool(tmp_path):
    spec = MHAKVSpec(num_layers=1, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="shared memory is a CPU pool"):
        KVCache(spec, 2, tmp_path / "pool", device="meta")
    assert KVCache(spec, 2, device="cpu").data.device.type == "cpu"
