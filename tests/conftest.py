import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

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
