"""fusedkv's backend-neutral package, in two floors.

``interop.core`` is the ground floor: the op's configuration, its validation and its NumPy
reference, which both backends import. The rest of ``interop`` stands on the backends: the
neutral call over DLPack (``interop.fused_kv_norm_rope``), the comparison helpers of the
tolerance table, ``fusedkv check`` and ``fusedkv bench``. The names below are loaded when
first used, so importing ``interop.core`` (as a backend does) loads none of the upper
floor, and importing this package imports neither torch nor jax.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "FusedKVConfig": "interop.core.spec",
    "validate_call": "interop.core.spec",
    "validate_cache_call": "interop.core.spec",
    "fused_kv_norm_rope_reference": "interop.core.reference",
    "fused_kv_norm_rope_into_cache_reference": "interop.core.reference",
    "fused_kv_norm_rope_backward_reference": "interop.core.reference_backward",
    "rope_cos_sin_cache": "interop.core.reference",
    "fused_kv_norm_rope": "interop.dispatch",
    "TOLERANCES": "interop.testing",
    "assert_bit_exact": "interop.testing",
    "assert_close": "interop.testing",
    "compare": "interop.testing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'interop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
