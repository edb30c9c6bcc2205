"""The kernel backends interop's neutral call runs, by name: one explicit table.

Each backend package has, beside its public functions, ``fused_kv_norm_rope_accepted``:
the op on a call that interop validated itself (``interop.core.spec.accept_call``,
then ``check_output_buffers``), which the backend then does not check again.
"""

from __future__ import annotations

import functools
import importlib.util

BACKENDS = ("torch", "jax")


def load_backend(name: str):
    """The kernel package of ``name`` (``fusedkv_torch`` or ``fusedkv_jax``).

    The environment is the caller's: without a GPU, the torch backend runs only where
    ``TRITON_INTERPRET=1`` was set before ``fusedkv_torch`` was imported, and otherwise
    refuses its call with a ``ValueError`` that says so (the ``fusedkv`` command sets it).
    """
    if name == "torch":
        import fusedkv_torch

        return fusedkv_torch
    if name == "jax":
        import fusedkv_jax

        return fusedkv_jax
    raise ValueError(f"Invalid backend for fused KV materialization: got {name!r}, "
                     f"expected one of {BACKENDS + ('auto',)}.")


@functools.cache
def backend_installed(name: str) -> bool:
    """Whether the framework of backend ``name`` is installed (torch: with Triton)."""
    return importlib.util.find_spec(name) is not None and (
        name != "torch" or importlib.util.find_spec("triton") is not None)
