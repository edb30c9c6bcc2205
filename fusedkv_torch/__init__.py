"""fusedkv for PyTorch: the Triton kernel, its torch.library registration, the materializer."""

from fusedkv_torch.ops import (
    fused_kv_norm_rope,
    fused_kv_norm_rope_into_cache,
    fused_kv_norm_rope_accepted,
)
from fusedkv_torch.materializer import FusedKVMaterializer

# fused_kv_norm_rope_accepted: the backend protocol of interop.registry (a call interop validated).
__all__ = ["FusedKVMaterializer", "fused_kv_norm_rope", "fused_kv_norm_rope_accepted", "fused_kv_norm_rope_into_cache"]
