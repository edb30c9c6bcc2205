"""Host int64 indices (positions, cache slots) as jax holds them."""

from __future__ import annotations

import jax
import numpy as np

from interop.core.spec import SATURATED_INDEX_RANGE, dtype_name


def jax_holds_int64() -> bool:
    """Whether jax keeps int64 as int64 (x64 on, globally or in an ``enable_x64`` scope)."""
    return jax.dtypes.canonicalize_dtype(np.int64) == np.int64


def narrow_for_jax(indices):
    """Host int64 indices as int32 where jax holds no int64 (x64 off), values saturated.

    jax would wrap them instead, which can carry an out-of-range position or slot into
    range (2**32 + 3 becomes 3); saturated, it stays out of every cos/sin table and
    cache. Anything else (device arrays, tracers, other dtypes) passes unchanged.
    """
    if isinstance(indices, np.ndarray) and dtype_name(indices.dtype) == "int64" and not jax_holds_int64():
        return np.clip(indices, *SATURATED_INDEX_RANGE).astype(np.int32)
    return indices
