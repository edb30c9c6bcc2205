"""The registered torch ops pass torch.library's own checks (schema, fake tensors, AOT dispatch).

``torch.library.opcheck`` runs each op for real and under fake tensors and compares: it
catches a fake implementation that disagrees with the op, a mutation the schema does not
declare, and an op that breaks under ``torch.compile``'s AOT dispatch.
"""

import pytest
import torch

import fusedkv_torch.ops  # noqa: F401  (registers torch.ops.fusedkv)
from interop.exchange import to_torch
from interop.core.spec import FusedKVConfig
from interop.testing import random_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = FusedKVConfig(2, 64, 32, "gptj")
N_LAYERS, TOTAL_CTX = 2, 3


def op_inputs():
    inputs = random_inputs(CONFIG, n_layers=N_LAYERS, total_ctx=TOTAL_CTX, max_position=16, seed=7)
    return [to_torch(array).to(DEVICE) for array in inputs.arrays()]


ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
STATIC = (CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.rotary_dim, CONFIG.rope_style)


@pytest.mark.parametrize("tile", [(), (2, 1, 1)], ids=["default-tile", "tile-override"])
def test_the_op_into_given_outputs_passes_opcheck(tile):
    kv, *rest = op_inputs()
    k_out, v_out = (torch.empty(CONFIG.output_shape(N_LAYERS, TOTAL_CTX), dtype=kv.dtype, device=DEVICE)
                    for _ in range(2))
    torch.library.opcheck(torch.ops.fusedkv.write_fused_kv_norm_rope, (kv, *rest, k_out, v_out, *STATIC, *tile))


@pytest.mark.parametrize("k_fp8, v_fp8", [(False, False), (True, True)])
def test_the_op_into_a_cache_passes_opcheck(k_fp8, v_fp8):
    kv, *rest = op_inputs()
    shape = (N_LAYERS, 8, CONFIG.num_kv_heads, CONFIG.head_dim)
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn if fp8 else kv.dtype, device=DEVICE)
              for fp8 in (k_fp8, v_fp8)]
    scales = [torch.full((N_LAYERS,), 0.5, device=DEVICE) if fp8 else None for fp8 in (k_fp8, v_fp8)]
    cache_loc = torch.tensor([5, -1, 2], device=DEVICE)
    checks = ALL_CHECKS
    if k_fp8 or v_fp8:
        # The schema check compares results with arithmetic torch lacks for float8 (CPU and CUDA).
        checks = tuple(check for check in ALL_CHECKS if check != "test_schema")
    torch.library.opcheck(torch.ops.fusedkv.write_fused_kv_norm_rope_into_cache,
                          (kv, *rest, cache_loc, *caches, *STATIC, *scales), test_utils=checks)
