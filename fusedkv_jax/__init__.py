"""fusedkv for JAX: the Pallas GPU kernel, its jit-native wrapper, the materializer."""

from fusedkv_jax.ops import (
    fused_kv_norm_rope,
    fused_kv_norm_rope_into_cache,
    fused_kv_norm_rope_accepted,
)
from fusedkv_jax.materializer import FusedKVMaterializer

# fused_kv_norm_rope_accepted: the backend protocol of interop.registry (a call interop validated).
__all__ = ["FusedKVMaterializer", "fused_kv_norm_rope", "fused_kv_norm_rope_accepted", "fused_kv_norm_rope_into_cache"]
