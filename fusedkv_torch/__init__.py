"""fusedkv for PyTorch: the Triton kernel, its torch.library registration, the materializer."""

from fusedkv_torch.ops import (
    fused_kv_norm_rope,
    fused_kv_norm_rope_into_cache,
    fused_kv_norm_rope_validated,  # interop's entry for the calls it has validated
)
from fusedkv_torch.materializer import FusedKVMaterializer

__all__ = ["FusedKVMaterializer", "fused_kv_norm_rope", "fused_kv_norm_rope_into_cache"]
