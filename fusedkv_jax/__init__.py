"""fusedkv for JAX: the Pallas GPU kernel, its jit-native wrapper, the materializer."""

from fusedkv_jax.kernel import (
    fused_kv_norm_rope,
    fused_kv_norm_rope_into_cache,
    fused_kv_norm_rope_validated,  # interop's entry for the calls it has validated
)
from fusedkv_jax.materializer import FusedKVMaterializer

__all__ = ["FusedKVMaterializer", "fused_kv_norm_rope", "fused_kv_norm_rope_into_cache"]
