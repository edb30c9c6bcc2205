"""Where a jax array lives, and what the tile rules of both lowerings ask of the GPU jax runs on."""

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


def devices_of(array):
    """The devices ``array`` lives on; None for NumPy input and jit tracers, which have none
    of their own. A tracer is not asked: the error it raises describes where it came from,
    which walks the whole program traced so far."""
    if isinstance(array, jax.core.Tracer) or not hasattr(array, "devices"):
        return None
    return array.devices()


def on_cpu(kv) -> bool:
    """Whether ``kv`` lives on the CPU (the default backend decides where it has no device)."""
    devices = devices_of(kv)
    if devices is None:
        return jax.default_backend() == "cpu"
    return all(device.platform == "cpu" for device in devices)
