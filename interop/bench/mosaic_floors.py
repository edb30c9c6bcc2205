"""The floors of the Mosaic GPU kernel: its data movement alone, on its own plan.

As :mod:`interop.bench.floors` is for the Triton lowering: the grid of
:mod:`fusedkv_jax.mosaic_kernel` where its programs take one head each (a program per 64
tokens, layer and head; where :func:`~fusedkv_jax.mosaic_kernel.heads_per_program` gives
a program several heads, this is the floor of the one-head plan, not of the kernel's), its swizzled
shared-memory tiles and TMA copies, ``k_out``/``v_out`` written through refs the kernel
aliases, and none of the op's work. :func:`copy` copies each program's K and V tiles
through shared memory unchanged; with ``cos_sin=True`` a program also copies its tokens'
positions and then their cos/sin rows with the kernel's own fetch (one copy for a run of
consecutive positions, else one a token), and holds K's store until those rows have
arrived. Where the kernel is slower than this floor, the difference is its registers'
work; where the floor is slower than the Triton lowering's floor, it is the plan or the
lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fusedkv_jax import mosaic_kernel


def _copy_block(kv_ref, cos_sin_ref, positions_ref, k_out_ref, v_out_ref, *, k_tile, v_tile, positions_tile,
                cos_sin_tile, loaded, positions_loaded, rows_loaded, run_loaded, tokens_per_block: int,
                cos_sin: bool, interpret: bool):
    """K and V of one head for one layer and ``BLOCK_TOKENS`` tokens, copied unchanged."""
    block, layer, head = (jax.lax.axis_index(name) for name in mosaic_kernel.GRID_NAMES)
    tokens = pl.ds(block * mosaic_kernel.BLOCK_TOKENS, mosaic_kernel.BLOCK_TOKENS)
    if cos_sin:
        plgpu.copy_gmem_to_smem(positions_ref.at[tokens], positions_tile, positions_loaded)
    plgpu.copy_gmem_to_smem(kv_ref.at[tokens, layer, 0, head], k_tile, loaded)
    plgpu.copy_gmem_to_smem(kv_ref.at[tokens, layer, 1, head], v_tile, loaded)
    if cos_sin:
        plgpu.barrier_wait(positions_loaded)
        refs = mosaic_kernel._Refs(kv=kv_ref, cos_sin=cos_sin_ref, positions=positions_ref, k_out=k_out_ref,
                                   v_out=v_out_ref)
        run, _ = mosaic_kernel._fetch_cos_sin_rows(refs, layer, positions_tile, cos_sin_tile, rows_loaded,
                                                   run_loaded, tokens_per_block, interpret)

    plgpu.barrier_wait(loaded)
    plgpu.copy_smem_to_gmem(v_tile, v_out_ref.at[layer, tokens, head])
    if cos_sin:
        mosaic_kernel._wait_cos_sin_rows(run, rows_loaded, run_loaded)
    plgpu.copy_smem_to_gmem(k_tile, k_out_ref.at[layer, tokens, head])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# Jitted, as the kernel's launch is: a jit of many calls then traces and lowers one of them.
@functools.partial(jax.jit, static_argnames=("num_kv_heads", "head_dim", "rotary_dim", "cos_sin", "interpret"))
def copy(kv, cos_sin_cache, positions, k_dest, v_dest, *, num_kv_heads: int, head_dim: int, rotary_dim: int,
         cos_sin: bool, interpret: bool):
    """``(k_dest, v_dest)`` holding K and V of ``kv`` as ``[n_layers, total_ctx,
    num_kv_heads, head_dim]``, written in place under a jit that donates them. ``kv``'s
    context must be one :func:`fusedkv_jax.mosaic_kernel.supports_context` takes, and a
    multiple of 8 (the tiled copies the kernel makes there); ``interpret``: Mosaic GPU's
    interpreter (CPU)."""
    total_ctx, n_layers, _ = kv.shape
    block = mosaic_kernel.BLOCK_TOKENS
    tokens_per_block = min(block, total_ctx)
    scratch = dict(
        k_tile=mosaic_kernel._tile((block, head_dim), kv.dtype, tiled=True),
        v_tile=mosaic_kernel._tile((block, head_dim), kv.dtype, tiled=True),
        positions_tile=plgpu.SMEM((block,), jnp.int32),
        cos_sin_tile=plgpu.SMEM((block, rotary_dim), jnp.float32),
        loaded=plgpu.Barrier(num_arrivals=2),
        positions_loaded=plgpu.Barrier(num_arrivals=1),
        rows_loaded=plgpu.Barrier(num_arrivals=tokens_per_block),
        run_loaded=plgpu.Barrier(num_arrivals=1),
    )
    body = functools.partial(_copy_block, tokens_per_block=tokens_per_block, cos_sin=cos_sin, interpret=interpret)

    def kernel(*refs):
        pl.run_scoped(functools.partial(body, *refs), **scratch)

    refs = [jax.new_ref(dest, memory_space=plgpu.GMEM) for dest in (k_dest, v_dest)]
    mesh = plgpu.Mesh(grid=(pl.cdiv(total_ctx, block), n_layers, num_kv_heads), grid_names=mosaic_kernel.GRID_NAMES,
                      kernel_name="fused_kv_floor_mosaic")
    pl.kernel(kernel, out_type=(), mesh=mesh, compiler_params=plgpu.CompilerParams(),
              interpret=mosaic_kernel._interpret_params() if interpret else False)(
        kv.reshape(total_ctx, n_layers, 2, num_kv_heads, head_dim), cos_sin_cache.astype(jnp.float32),
        positions.astype(jnp.int32), *refs)
    return tuple(jax.freeze(ref) for ref in refs)
