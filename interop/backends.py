"""The kernels as seen by ``fusedkv check``: load a backend, run it on host inputs.

A backend is imported only when asked for, so ``interop`` stays free of torch and
jax. Without a GPU, the Triton kernel runs under ``TRITON_INTERPRET=1`` (set here
before ``fusedkv_torch`` is imported, as Triton reads it when a kernel is
decorated) and the Pallas kernel with ``interpret=True``.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from interop.arrays import as_numpy
from interop.exchange import to_torch
from interop.inputs import OpInputs
from interop.spec import FusedKVConfig

BACKEND_NAMES = ("torch", "jax")


@dataclasses.dataclass(frozen=True)
class BackendRun:
    name: str
    device: str
    k: np.ndarray
    v: np.ndarray
    seconds: float


class BackendUnavailable(Exception):
    """The backend's framework or kernel is not installed here; the message says which."""


def _timed(call, wait):
    wait(call())  # the first call compiles; time the second
    start = time.perf_counter()
    result = wait(call())
    return result, time.perf_counter() - start


def run_torch(inputs: OpInputs, config: FusedKVConfig) -> BackendRun:
    try:
        import torch
    except ImportError as error:
        raise BackendUnavailable(f"torch is not installed ({error})") from error
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from fusedkv_torch import fused_kv_norm_rope
    except ImportError as error:
        raise BackendUnavailable(f"fusedkv_torch cannot be imported ({error})") from error
    device = "cuda" if on_gpu else "cpu"
    args = [to_torch(a).to(device) for a in inputs.arrays()]

    def wait(outputs):
        if on_gpu:
            torch.cuda.synchronize()
        return outputs

    (k, v), seconds = _timed(lambda: fused_kv_norm_rope(
        *args, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style), wait)
    label = f"GPU ({torch.cuda.get_device_name()})" if on_gpu else "CPU (Triton interpret)"
    return BackendRun("torch", label, as_numpy(k), as_numpy(v), seconds)


def run_jax(inputs: OpInputs, config: FusedKVConfig) -> BackendRun:
    try:
        import jax
        from fusedkv_jax import fused_kv_norm_rope
    except ImportError as error:
        raise BackendUnavailable(f"jax or fusedkv_jax cannot be imported ({error})") from error
    args = [jax.device_put(a) for a in inputs.arrays()]
    (k, v), seconds = _timed(lambda: fused_kv_norm_rope(
        *args, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style), jax.block_until_ready)
    on_gpu = jax.default_backend() == "gpu"
    label = f"GPU ({jax.devices()[0].device_kind})" if on_gpu else "CPU (Pallas interpret)"
    return BackendRun("jax", label, as_numpy(k), as_numpy(v), seconds)


RUNNERS = {"torch": run_torch, "jax": run_jax}


def gpu_present() -> bool:
    """Whether either framework sees a GPU (decides the default sizes of ``check``)."""
    try:
        import torch

        if torch.cuda.is_available():
            return True
    except ImportError:
        pass
    try:
        import jax

        return jax.default_backend() == "gpu"
    except ImportError:
        return False
