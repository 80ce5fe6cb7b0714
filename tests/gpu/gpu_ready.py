"""Whether this machine runs the GPU tests: a CUDA device torch sees and cupy to compile the
kernels. Each tests/gpu module skips itself without them:

    if not gpu_ready():
        pytest.skip("needs cupy and a CUDA device", allow_module_level=True)"""

import torch


def gpu_ready() -> bool:
    try:
        import cupy

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # cupy missing or no driver: nothing to test here
        return False
