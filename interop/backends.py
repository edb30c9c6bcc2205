"""The kernels as ``fusedkv check`` runs them: the same input bytes, through DLPack, to each.

The inputs are placed once, in one framework (torch on a GPU when it is installed,
else jax on a GPU, else NumPy on the CPU), and every backend is called on those
very buffers through :func:`interop.dispatch.fused_kv_norm_rope`, so a difference
between backends is a difference of kernels, not of inputs.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from interop import dispatch
from interop.arrays import as_numpy
from interop.exchange import to_jax, to_torch
from interop.inputs import OpInputs
from interop.spec import FusedKVConfig


@dataclasses.dataclass(frozen=True)
class BackendRun:
    name: str
    device: str
    k: np.ndarray
    v: np.ndarray
    seconds: float


class BackendUnavailable(Exception):
    """The backend's framework or kernel is not installed here; the message says which."""


def gpu_framework() -> str | None:
    """The framework that will hold the shared inputs on a GPU, or None without a GPU."""
    if dispatch.backend_installed("torch"):
        import torch

        if torch.cuda.is_available():
            return "torch"
    if dispatch.backend_installed("jax"):
        import jax

        if jax.default_backend() == "gpu":
            return "jax"
    return None


def place_inputs(inputs: OpInputs) -> tuple:
    """The inputs on the device every backend will read them from."""
    framework = gpu_framework()
    if framework == "torch":
        return tuple(to_torch(a).to("cuda") for a in inputs.arrays())
    if framework == "jax":
        return tuple(to_jax(a) for a in inputs.arrays())
    return inputs.arrays()


def _device_label(name: str) -> str:
    if gpu_framework() is None:
        return f"CPU ({'Triton' if name == 'torch' else 'Pallas'} interpret)"
    if name == "torch":
        import torch

        return f"GPU ({torch.cuda.get_device_name()})"
    import jax

    return f"GPU ({jax.devices()[0].device_kind})"


def _wait(outputs):
    for output in outputs:
        if hasattr(output, "block_until_ready"):
            output.block_until_ready()
        elif type(output).__module__.startswith("torch") and output.is_cuda:
            import torch

            torch.cuda.synchronize(output.device)
    return outputs


def run_backend(name: str, placed: tuple, config: FusedKVConfig) -> BackendRun:
    """Call backend ``name`` twice on ``placed`` (the first call compiles), time the second."""
    try:
        dispatch.load_backend(name)
    except ImportError as error:
        raise BackendUnavailable(f"{name} backend not installed ({error})") from error

    def call():
        return _wait(dispatch.fused_kv_norm_rope(
            *placed, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            rotary_dim=config.rotary_dim, rope_style=config.rope_style, backend=name))

    call()
    start = time.perf_counter()
    k, v = call()
    seconds = time.perf_counter() - start
    return BackendRun(name, _device_label(name), as_numpy(k), as_numpy(v), seconds)
