"""What the backward tests of both backends share: the comparison of a gradient, the
inputs of each edge value and per-layer RoPE tables."""

import numpy as np

from interop.core.reference import rope_cos_sin_cache
from interop.testing import gradient_mismatch

MAX_POSITION = 16


def assert_grad_close(got, expected, dtype: str, name: str):
    mismatch = gradient_mismatch(got, expected, dtype, name=name)
    assert not mismatch, mismatch


def edge_case(kind, arrays):
    """``arrays`` (kv, weight, eps, table, positions of 3 tokens, 2 heads of 16 dims, 2 layers)
    changed to hold one edge value of CONTRACT.md, Gradients."""
    kv, eps, positions = arrays[0].copy(), arrays[2].copy(), arrays[4].copy()
    if kind == "position outside the table":
        positions[1] = MAX_POSITION
    elif kind == "head without a scale":
        kv[0, 1, :16], eps[1] = np.float32(1e-40), 0.0
    else:
        kv[2, 0, 16 + 5] = np.float32({"nan head": np.nan, "inf head": np.inf}.get(kind, 1e30))
    return [kv, arrays[1], eps, arrays[3], positions]


# Per-layer tables: each layer another table than its neighbour's, or one index naming none.
LAYER_ROPE_TABLES = {"per-layer tables": [1, 0], "table index outside the tables": [2, 1]}


def with_per_layer_tables(arrays):
    """``arrays`` with two RoPE tables of other bases (a full-attention and a sliding-window one)
    in place of the one table: ``[2, MAX_POSITION, rotary_dim]``."""
    rotary_dim = arrays[3].shape[-1]
    tables = np.stack([rope_cos_sin_cache(MAX_POSITION, rotary_dim, base) for base in (1e6, 1e4)])
    return [*arrays[:3], tables, arrays[4]]
