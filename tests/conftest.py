import os
import sys
from pathlib import Path

# One thread per process: tests start several processes (workers, gateway) on a 2-core machine,
# and OpenMP threads fighting over cores make every op many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from kernels.cpu import isa  # noqa: E402

isa.cap_torch()  # TISON_CPU_ISA=avx2 runs torch and oneDNN as on an AVX2 CPU too

import openai  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from gpu.gpu_testing import cupy_backend, host_backend  # noqa: E402, F401 (the CUDA modules')

from tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """Builds (once per session) a tiny model folder of a family: factory(family, **overrides)."""
    cache: dict = {}

    def make(family: str = "llama", **overrides) -> Path:
        key = (family, tuple(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"model-{family}")
            cache[key] = build_model(out, family, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture
async def client(cluster):
    """The official `openai` client on the gateway of the module's `cluster` fixture."""
    async with openai.AsyncOpenAI(
        base_url=cluster.base_url + "/v1", api_key="x", max_retries=0
    ) as c:
        yield c
