"""Host copies of any framework's arrays, for references and reports (never on a hot path)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from interop.spec import dtype_name

_NUMPY_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype for a canonical dtype name such as ``'bfloat16'``."""
    return _NUMPY_DTYPES[name]


def as_numpy(array) -> np.ndarray:
    """A NumPy array with the same values and dtype; bf16 and fp8 torch tensors included."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("torch"):
        return _torch_to_numpy(array)
    return np.asarray(array)


def _torch_to_numpy(tensor) -> np.ndarray:
    import torch

    tensor = tensor.detach().cpu()
    name = str(tensor.dtype).removeprefix("torch.")
    if name in ("bfloat16", "float8_e4m3fn"):
        bits = torch.int16 if name == "bfloat16" else torch.uint8
        return tensor.contiguous().view(bits).numpy().view(_NUMPY_DTYPES[name])
    return tensor.numpy()


def numpy_to_torch(array: np.ndarray, device: str = "cpu"):
    """A torch tensor with the same bytes; bf16 and fp8 go through an integer view."""
    import torch

    name = dtype_name(array.dtype)
    if name in ("bfloat16", "float8_e4m3fn"):
        bits = np.int16 if name == "bfloat16" else np.uint8
        host = torch.from_numpy(np.ascontiguousarray(array).view(bits)).view(getattr(torch, name))
    else:
        host = torch.from_numpy(np.ascontiguousarray(array))
    return host.to(device)
