"""Backend-neutral half of fusedkv: the op's contract, its NumPy reference, tolerances.

Importing this package imports neither torch nor jax.
"""

from interop.dispatch import fused_kv_norm_rope
from interop.reference import (
    fused_kv_norm_rope_into_cache_reference,
    fused_kv_norm_rope_reference,
    rope_cos_sin_cache,
)
from interop.spec import FusedKVConfig, validate_cache_call, validate_call
from interop.testing import TOLERANCES, assert_bit_exact, assert_close, compare

__version__ = "0.1.0"

__all__ = [
    "FusedKVConfig",
    "TOLERANCES",
    "assert_bit_exact",
    "assert_close",
    "compare",
    "fused_kv_norm_rope",
    "fused_kv_norm_rope_into_cache_reference",
    "fused_kv_norm_rope_reference",
    "rope_cos_sin_cache",
    "validate_cache_call",
    "validate_call",
]
