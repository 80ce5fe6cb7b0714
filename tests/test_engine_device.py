"""Where the engine runs: EngineConfig.device (the CPU only, for now) and the attention
backend chosen once per engine from device, dtype and the C kernels (or forced)."""

import pytest
import torch

from kernels.cpu import library
from shared.engine.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.kv.cache import KVCache
from shared.kv.spec import MHAKVSpec
from shared.models.layers.attention_backend import CpuKernelBackend, TorchBackend, select_backend
from shared.sampling.params import SamplingParams

from compilers import needs_compiler
from engine_helpers import LOGPROB_TOL, attention_backends, make_prompts, new_engine, run_all


@needs_compiler
def test_forced_torch_backend_matches_the_kernel_backend(tiny_llama):
    """Same weights, same other kernels: logprobs of the two backends within float32 noise."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, ignore_eos=True)
    results = {}
    for backend in ("cpu_kernels", "torch"):
        engine = new_engine(tiny_llama, attention_backend=backend)
        assert attention_backends(engine) == {backend}
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(make_prompts())]
        run_all(engine)
        results[backend] = reqs
    for ours, ref in zip(results["cpu_kernels"], results["torch"]):
        assert ours.output_token_ids == ref.output_token_ids
        got = torch.tensor([lp.logprob for lp in ours.output_logprobs])
        want = torch.tensor([lp.logprob for lp in ref.output_logprobs])
        torch.testing.assert_close(got, want, atol=LOGPROB_TOL, rtol=0)


def test_auto_backend_follows_dtype_and_kernels(monkeypatch):
    assert isinstance(select_backend("cpu", torch.float16), TorchBackend)  # no C kernels
    if library.usable(torch.zeros(1)):
        assert isinstance(select_backend("cpu", torch.float32), CpuKernelBackend)
    monkeypatch.setattr(library, "usable", lambda x: False)  # no C compiler
    assert isinstance(select_backend("cpu", torch.bfloat16), TorchBackend)
    with pytest.raises(InvalidRequestError, match="attention_backend: the C kernels do not run"):
        select_backend("cpu", torch.bfloat16, "cpu_kernels")


def test_device_is_cpu_for_now(tmp_path):
    with pytest.raises(InvalidRequestError, match="CUDA path is not built yet") as e:
        EngineConfig(model_dir=tmp_path, device="cuda")
    assert e.value.field == "device"
    with pytest.raises(InvalidRequestError, match="device: must be one of cpu"):
        EngineConfig(model_dir=tmp_path, device="tpu")
    with pytest.raises(InvalidRequestError, match="attention_backend: must be one of"):
        EngineConfig(model_dir=tmp_path, attention_backend="flash")
    assert EngineConfig(model_dir=tmp_path).torch_device == torch.device("cpu")


def test_the_shared_memory_pool_is_a_cpu_pool(tmp_path):
    spec = MHAKVSpec(num_layers=1, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="shared memory is a CPU pool"):
        KVCache(spec, 2, tmp_path / "pool", device="meta")
    assert KVCache(spec, 2, device="cpu").data.device.type == "cpu"
