"""Test harness: kernels run in interpret mode on a machine without a GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` is decorated, so it is
set here, before a test module imports ``fusedkv_torch``; jax is kept on the CPU
there too. On the H200 the same tests run on the GPU.
"""

import os


def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


ON_GPU = _cuda_present()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"
