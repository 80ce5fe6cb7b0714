"""Where the engine runs: EngineConfig.device (the CPU only, for now) and the attention
backend chosen once per engine from device, dtype and the C kernels (or forced)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.cpu import library
from shared.engine import device as devices
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


def test_devices_are_named_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidRequestError, match="cuda: torch sees no GPU") as e:
        EngineConfig(model_dir=tmp_path, device="cuda")
    assert e.value.field == "device"
    with pytest.raises(InvalidRequestError, match="device: must be one of auto, cpu, cuda"):
        EngineConfig(model_dir=tmp_path, device="tpu")
    with pytest.raises(InvalidRequestError, match="device: must be one of"):
        EngineConfig(model_dir=tmp_path, device="cpu:1")
    with pytest.raises(InvalidRequestError, match="attention_backend: must be one of"):
        EngineConfig(model_dir=tmp_path, attention_backend="flash")
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        EngineConfig(model_dir=tmp_path, gpu_memory_utilization=1.5)
    with pytest.raises(InvalidRequestError, match="decode_graphs"):
        EngineConfig(model_dir=tmp_path, decode_graphs="sometimes")
    config = EngineConfig(model_dir=tmp_path, device="auto")  # no GPU here: the CPU
    assert config.device == "cpu" and config.rank_device(0) == torch.device("cpu")
    assert not config.uses_graphs and EngineConfig(tmp_path, decode_graphs="on").uses_graphs


def test_each_rank_takes_its_own_gpu(tmp_path, monkeypatch):
    """As torch would see 2 GPUs: rank r on cuda:r, too many ranks refused, a named GPU for
    one rank only; the pool budget is the smaller of the share and what is free."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = EngineConfig(model_dir=tmp_path, device="cuda", tp=2, allow_oversubscribe=True)
    assert [config.rank_device(r) for r in (0, 1)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
    ]
    assert config.on_gpu and config.uses_graphs
    assert not EngineConfig(tmp_path, device="cuda", decode_graphs="off").uses_graphs
    with pytest.raises(InvalidRequestError, match="4 rank.s. need a GPU each from GPU 0 on; torch"):
        EngineConfig(tmp_path, device="cuda", tp=4, allow_oversubscribe=True).rank_device(3)
    assert EngineConfig(tmp_path, device="cuda:1").rank_device(0) == torch.device("cuda", 1)
    with pytest.raises(InvalidRequestError, match="cuda:1: 2 rank.s. need a GPU each from GPU 1"):
        EngineConfig(tmp_path, device="cuda:1", tp=2, allow_oversubscribe=True).rank_device(0)
    with pytest.raises(InvalidRequestError, match="cuda:2: torch sees 2 GPU"):
        EngineConfig(tmp_path, device="cuda:2")
    with pytest.raises(InvalidRequestError, match="kv_shm_path: a KV pool in shared memory"):
        EngineConfig(tmp_path, device="cuda", kv_shm_path=tmp_path / "pool")
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * gib)
    assert devices.memory_budget(torch.device("cuda", 0), 0.9) == 72 * gib  # 0.9 x 80
    assert devices.memory_budget(torch.device("cuda", 0), 0.5) == 40 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (30 * gib, 80 * gib))
    assert devices.memory_budget(torch.device("cuda", 0), 0.9) == 32 * gib  # free + our own


def test_the_shared_memory_pool_is_a_cpu_pool(tmp_path):
    spec = MHAKVSpec(num_layers=1, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="shared memory is a CPU pool"):
        KVCache(spec, 2, tmp_path / "pool", device="meta")
    assert KVCache(spec, 2, device="cpu").data.device.type == "cpu"


def test_a_float16_checkpoint_runs_in_bfloat16_on_a_cpu(tiny_llama, tmp_path):
    """dtype auto: a float16 checkpoint runs in bfloat16 on a CPU (vLLM's CPU rule; torch has
    no fast float16 matmul there and the C kernels take bfloat16), its tokens those of the same
    weights stored in bfloat16; asked for by name, float16 stays float16."""
    tensors = load_file(tiny_llama / "model.safetensors")
    config = json.loads((tiny_llama / "config.json").read_text())
    folders = {}
    for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        folder = folders[name] = tmp_path / name
        shutil.copytree(tiny_llama, folder)
        half = {k: v.to(torch.float16).to(dtype) for k, v in tensors.items()}
        save_file(half, folder / "model.safetensors")
        stored = {**config, "dtype": name, "torch_dtype": name}
        (folder / "config.json").write_text(json.dumps(stored))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for name, folder in folders.items():
        engine = new_engine(folder, dtype="auto")
        assert engine.dtype == torch.bfloat16 and engine.model.model.fused is not None
        reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(make_prompts())]
        run_all(engine)
        outputs[name] = [r.output_token_ids for r in reqs]
    assert outputs["float16"] == outputs["bfloat16"]
    config = EngineConfig(model_dir=folders["float16"], dtype="float16")
    assert config.torch_dtype("float16") == torch.float16
