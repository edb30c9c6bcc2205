"""Test harness: kernels run in interpret mode on a machine without a GPU.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` is decorated, so it is
set here, before a test module imports ``fusedkv_torch``; jax is kept on the CPU
there too. On a GPU machine the same tests run on the GPU, and the interpreted twins of the
contract suite run beside them (``backends.py``).
"""

import os

import pytest


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


@pytest.fixture(scope="class", params=["torch", "jax"])
def backend(request):
    """Each backend (``backends.py``), interpreted or compiled as the test class says
    (``interpret``: the twins); outside such a class, as this machine runs it by default.
    Skipped where this process cannot run it so."""
    pytest.importorskip(request.param)
    from backends import BACKENDS, machine_interprets

    interpret = getattr(request.cls, "interpret", None)
    if interpret is None:
        interpret = machine_interprets(request.param)
    reason = BACKENDS[request.param].unavailable(interpret)
    if reason:
        pytest.skip(reason)
    chosen = BACKENDS[request.param](interpret=interpret)
    with chosen.context():
        yield chosen
