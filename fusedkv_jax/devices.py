"""What the tile rules of both lowerings ask of the GPU jax runs on."""

from __future__ import annotations

import functools

import jax


@functools.cache
def multiprocessors() -> int:
    """The multiprocessors of jax's first GPU, 1 without a GPU."""
    try:
        return max(1, int(getattr(jax.devices("gpu")[0], "core_count", 1)))
    except RuntimeError:  # no GPU backend
        return 1
