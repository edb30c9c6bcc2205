"""Moving buffers between NumPy, torch, jax (and CuPy) through DLPack.

What crosses without a copy: any contiguous (or transposed) buffer between torch and
jax, on CPU and GPU, and torch/NumPy on the CPU. What costs a copy, and why:

* a torch view DLPack cannot describe to jax (a column slice of a wider workspace):
  jax accepts only compact strides, so the view is made contiguous first;
* int64 positions going to jax with x64 off: jax would wrap them to int32 silently,
  so they are saturated to int32 first (any position past 2**31 - 1 is past every
  cos/sin cache anyway, and stays out of range);
* bf16 NumPy arrays: NumPy's DLPack refuses bf16, so they travel to torch as an
  int16 view (no copy); jax receives every NumPy array through ``device_put``, which
  places it on jax's default device (a host-to-device copy when that is a GPU).

* on the CPU, a buffer that is not 64-byte aligned (NumPy's own allocations are
  not; torch's are) is copied by jax on import.

A tensor that requires grad is exported through ``.detach()``, which copies nothing.
"""

from __future__ import annotations

import importlib

import numpy as np

from interop.arrays import numpy_dtype
from interop.spec import dtype_name, framework_of

INT32_MAX = 2**31 - 1


def to_torch(array):
    """A torch tensor over the same memory (see the module docstring for the exceptions)."""
    import torch

    if framework_of(array) == "torch":
        return array
    if isinstance(array, np.ndarray):
        name = dtype_name(array.dtype)
        if name in ("bfloat16", "float8_e4m3fn"):
            bits = np.int16 if name == "bfloat16" else np.uint8
            return torch.from_numpy(array.view(bits)).view(getattr(torch, name))
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def to_jax(array):
    """A jax array over the same memory where DLPack allows; a documented copy where not."""
    import jax

    kind = framework_of(array)
    if kind == "jax":
        return array
    if kind == "torch":
        array = _torch_for_jax(array)
    elif isinstance(array, np.ndarray):
        # Host memory goes to jax's default device, where the kernel will run.
        return jax.device_put(narrow_for_jax(array))
    return jax.dlpack.from_dlpack(array)


def narrow_for_jax(indices):
    """Host int64 indices as int32 where jax holds no int64 (x64 off), values saturated.

    jax would wrap them instead, which can carry an out-of-range position or slot into
    range (2**32 + 3 becomes 3); saturated, it stays out of every cos/sin table and
    cache. Anything else (device arrays, tracers, other dtypes) passes unchanged.
    """
    if isinstance(indices, np.ndarray) and dtype_name(indices.dtype) == "int64" and not _jax_holds_int64():
        return np.clip(indices, -1, INT32_MAX).astype(np.int32)
    return indices


def _jax_holds_int64() -> bool:
    """Whether jax keeps int64 as int64 (x64 on, globally or in an ``enable_x64`` scope)."""
    import jax

    return jax.dtypes.canonicalize_dtype(np.int64) == np.int64


def _torch_for_jax(tensor):
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.int64 and not _jax_holds_int64():
        tensor = tensor.clamp(-1, INT32_MAX).to(torch.int32)
    if not _compact(tensor):
        tensor = tensor.contiguous()
    return tensor


def _compact(tensor) -> bool:
    """Whether the strides are a permutation of a dense layout (what jax accepts)."""
    dims = sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def to_framework(array, framework: str):
    """``array`` as an array of ``framework`` (``'torch'`` or ``'jax'``)."""
    return to_torch(array) if framework == "torch" else to_jax(array)


def to_caller(array, caller: str):
    """A backend's result handed back as an array of the caller's framework, zero-copy."""
    if framework_of(array) == caller:
        return array
    if caller == "numpy":
        return _to_numpy(array)
    if caller == "torch":
        return to_torch(array)
    if caller == "jax":
        return to_jax(array)
    return importlib.import_module(caller).from_dlpack(array)


def _to_numpy(array) -> np.ndarray:
    if framework_of(array) == "torch":
        name = dtype_name(array.dtype)
        if name in ("bfloat16", "float8_e4m3fn"):
            import torch

            bits = torch.int16 if name == "bfloat16" else torch.uint8
            return array.view(bits).numpy().view(numpy_dtype(name))
        return array.numpy()
    return np.asarray(array)
