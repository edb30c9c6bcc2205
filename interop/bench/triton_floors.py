"""The floors of the Triton kernel: its data movement alone, on the kernel's own tiles.

A bar the kernel misses is judged against what moving its bytes costs in the same form:
the kernel's plan (``fusedkv_torch.kernel.tuned_plan``: tile, grid, warps, programmatic
dependent launch) and program order (``_tile_of_program``), K and V loaded and stored as
whole head rows, none of the op's work. :func:`copy` copies K and V of ``kv`` into
``k_dest``/``v_dest`` unchanged; with ``cos_sin=True`` it also loads each token's position
first and its cos/sin row after K and V, as the kernel does, and adds the row's sum times
zero to K (which the compiler must keep: ``0 * x`` is not ``0`` for every float), so a
program waits for the chain positions -> cos/sin before it stores K. Where the copy runs
at a device copy's speed and the kernel does not, the gap is the kernel's work; where the
``cos_sin`` floor already misses, it is the dependent load, whatever the math costs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from interop.core.spec import FusedKVConfig
from fusedkv_torch import kernel as triton_kernel
from fusedkv_torch.kernel import _tile_of_program


@triton.jit
def _copy_kernel(kv_ptr, cos_sin_ptr, positions_ptr, k_dest_ptr, v_dest_ptr, total_ctx,
                 kv_stride_t, kv_stride_l, cos_sin_stride_p, positions_stride, dest_stride_l, dest_stride_t,
                 N_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr, HEAD_BLOCK: tl.constexpr,
                 ROTARY_BLOCK: tl.constexpr, COS_SIN: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr):
    """One ``[BLOCK_T tokens, BLOCK_HEADS heads, head_dim]`` tile of one layer's K and V, copied."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    layer, tokens, heads = _tile_of_program(total_ctx, N_LAYERS, NUM_HEADS, BLOCK_T, BLOCK_HEADS)
    in_context = tokens < total_ctx
    positions = tokens * 0
    if COS_SIN:
        positions = tl.load(positions_ptr + tokens * positions_stride, mask=in_context, other=0).to(tl.int64)
    dims = tl.arange(0, HEAD_BLOCK)[None, None, :]
    mask = in_context[:, None, None] & (dims < HEAD_DIM)
    rows = kv_ptr + tokens[:, None, None] * kv_stride_t + layer * kv_stride_l + heads * HEAD_DIM + dims
    k = tl.load(rows, mask=mask)
    v = tl.load(rows + NUM_HEADS * HEAD_DIM, mask=mask)
    destination = layer * dest_stride_l + tokens[:, None, None] * dest_stride_t + heads * HEAD_DIM + dims
    tl.store(v_dest_ptr + destination, v, mask=mask)
    if COS_SIN:
        lanes = tl.arange(0, ROTARY_BLOCK)[None, :]
        row = tl.load(cos_sin_ptr + positions[:, None] * cos_sin_stride_p + lanes,
                      mask=in_context[:, None] & (lanes < ROTARY_DIM), other=0.0)
        k = (k.to(tl.float32) + 0.0 * tl.sum(row, 1)[:, None, None]).to(k.dtype)
    tl.store(k_dest_ptr + destination, k, mask=mask)


def copy(kv: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor, k_dest: torch.Tensor,
         v_dest: torch.Tensor, *, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str,
         cos_sin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_dest, v_dest)``, written in place with K and V of ``kv``
    (``[total_ctx, n_layers, 2*kv_size]``, its last dim unit-stride) as
    ``[n_layers, total_ctx, num_kv_heads, head_dim]`` (contiguous), on the kernel's default
    plan for this call; ``cos_sin_cache`` is 2-D with unit-stride rows."""
    total_ctx, n_layers, _ = kv.shape
    if kv.stride(2) != 1 or cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1 \
            or not (k_dest.is_contiguous() and v_dest.is_contiguous()):
        raise ValueError("Invalid arrays for the Triton floor: got strides "
                         f"{kv.stride()}, {cos_sin_cache.stride()}, {k_dest.stride()}, {v_dest.stride()}, "
                         "expected unit-stride rows of kv and cos_sin_cache and contiguous outputs.")
    config = FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style)
    grid, constexprs, num_warps, dependent_launch = triton_kernel.tuned_plan(
        config, total_ctx, n_layers, kv.element_size(), (None, None, None),
        triton_kernel.supports_dependent_launch(kv.device))
    block_tokens, block_heads = constexprs[5], constexprs[6]
    _copy_kernel[(grid,)](
        kv, cos_sin_cache, positions, k_dest, v_dest, total_ctx,
        kv.stride(0), kv.stride(1), cos_sin_cache.stride(0), positions.stride(0), k_dest.stride(0), k_dest.stride(1),
        N_LAYERS=n_layers, NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_T=block_tokens, BLOCK_HEADS=block_heads, HEAD_BLOCK=triton.next_power_of_2(head_dim),
        ROTARY_BLOCK=triton.next_power_of_2(rotary_dim), COS_SIN=cos_sin, DEPENDENT_LAUNCH=dependent_launch,
        num_warps=num_warps, launch_pdl=dependent_launch)
    return k_dest, v_dest
