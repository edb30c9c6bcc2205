"""Host copies of any framework's arrays, for references and reports (never on a hot path)."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

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


# torch tensors NumPy cannot take in directly: their bits go through an integer view.
_BIT_VIEWS = {"bfloat16": "int16", "float8_e4m3fn": "uint8"}


def as_numpy(array) -> np.ndarray:
    """A host NumPy array with the same values and dtype (a device array is copied to the host)."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("torch"):
        tensor = array.detach().cpu()
        name = str(tensor.dtype).removeprefix("torch.")
        if name in _BIT_VIEWS:
            torch = sys.modules["torch"]  # loaded, as a tensor exists: the core imports no framework
            return tensor.view(getattr(torch, _BIT_VIEWS[name])).numpy().view(numpy_dtype(name))
        return tensor.numpy()
    return np.asarray(array)
