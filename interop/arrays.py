"""Host copies of any framework's arrays, for references and reports (never on a hot path)."""

from __future__ import annotations

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


def as_numpy(array) -> np.ndarray:
    """A host NumPy array with the same values and dtype (a device array is copied to the host)."""
    if isinstance(array, np.ndarray):
        return array
    if type(array).__module__.startswith("torch"):
        from interop.exchange import to_caller

        return to_caller(array.detach().cpu(), "numpy")
    return np.asarray(array)
