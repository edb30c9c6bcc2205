"""The backward pass of the Mosaic GPU lowering's forward, itself a Mosaic GPU kernel.

The math is :mod:`fusedkv_jax.backward`'s (CONTRACT.md, Gradients); per token ``t``, layer
``l`` and head ``h``, in fp32::

    gn     = rope^T(g)                                  (the pair rotated back: sin negated)
    grad_x = r * (w*gn - x*r * mean(x*r * w*gn)),  r = rsqrt(mean(x*x) + eps[l])
    grad_w[l] += gn * x*r                              (summed over t and h)
    grad_v = g_v (times v_multiplier[l]);  grad_v_multiplier[l] += sum(v * g_v)

The plan is the forward's (:mod:`fusedkv_jax.mosaic_kernel`): one program per (block of
64 tokens, layer, head), or, where :func:`~fusedkv_jax.mosaic_kernel.heads_per_program`
gives several heads a program with room for two of each tile a head reads (K, the
gradients of K and V, and V with a multiplier), one per (block, layer, group of heads)
that loops over its heads; tiles in shared memory filled and emptied by TMA copies, the
block's cos/sin rows fetched by the forward's own fetch, each row in the WGMMA register
layout so that its reductions are row reductions, ``neox`` halves and ``gptj`` pairs (as
32-bit words) the forward's pieces. Each program writes the column sums of its rows'
weight and multiplier terms to a row of partial sums of its own, added up by jnp after
the kernel (deterministic, unlike atomics). It takes every call the forward takes: where
V's tile does not fit beside the others, jnp scales V's gradient after the kernel
(:func:`scales_v_in_kernel`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fusedkv_jax.mosaic_kernel import (
    BLOCK_TOKENS,
    GRID_NAMES,
    _SHARED_BYTES,
    _as_elements,
    _as_words,
    _fetch_cos_sin_rows,
    _from_fp32,
    _interpret_params,
    _load,
    _load_weight,
    _pieces,
    _tile,
    _tiles_out,
    _to_fp32,
    _wait_cos_sin_rows,
    heads_per_program,
    kernel_operands,
    loop_over_heads,
    part_tiles,
    by_row,
    inverse_rms,
    row_offsets,
    row_sums,
    tile_columns,
    weight_parts,
)
from interop.core.spec import FusedKVConfig

KERNEL_NAME = "fused_kv_norm_rope_mosaic_backward"


def scales_v_in_kernel(config: FusedKVConfig, kv_dtype) -> bool:
    """Whether a program's tiles with a ``v_multiplier`` fit shared memory: K, the gradients
    of K and V, V, K's gradient out and the cos/sin rows. Where they do not (head_dim 256
    with a rotary of more than about 150 dims), the kernel copies V's gradient unscaled and
    jnp scales it and sums ``v * g_v`` after it. Without a multiplier the tiles always fit
    where the forward's do."""
    tile_bytes = BLOCK_TOKENS * config.head_dim * jnp.dtype(kv_dtype).itemsize
    return 5 * tile_bytes + BLOCK_TOKENS * 4 * config.rotary_dim <= _SHARED_BYTES


class _GradRefs(NamedTuple):
    """The backward kernel's arrays in global memory: the forward's (``kv``, ``cos_sin``,
    ``positions``, and those of the options, None where not taken: :class:`~fusedkv_jax.
    mosaic_kernel._Refs`), the incoming gradients ``grad_k, grad_v[n_layers, total_ctx,
    heads, head_dim]`` in ``kv``'s dtype (words for ``gptj``), and the outputs: ``grad_kv``
    as ``kv``, the partial sums ``weight_sums[blocks, n_layers, heads, head_dim]`` (the
    weight's column order) and ``multiplier_sums[blocks, n_layers, heads, columns]``."""

    kv: Any
    cos_sin: Any
    positions: Any
    grad_k: Any
    grad_v: Any
    grad_kv: Any
    weight: Any = None
    eps: Any = None
    v_multiplier: Any = None
    table: Any = None
    weight_sums: Any = None
    multiplier_sums: Any = None


def _one_head_backward(refs: _GradRefs, *, k_tile, grad_k_tile, grad_v_tile, positions_tile, cos_sin_tile, loaded,
                       positions_loaded, rows_loaded, run_loaded, tokens_per_block: int, total_ctx: int,
                       interpret: bool, v_tile=None, weight_tile=None, **head):
    """The gradients of one head for one layer and ``BLOCK_TOKENS`` tokens: the grid point
    ``(block, layer, head)``; the shared-memory tiles and barriers come by name, those
    every head uses alike in ``head`` (:func:`_head_grads`)."""
    block, layer, index_head = (jax.lax.axis_index(name) for name in GRID_NAMES)
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)

    plgpu.copy_gmem_to_smem(refs.positions.at[tokens], positions_tile, positions_loaded)
    plgpu.copy_gmem_to_smem(refs.kv.at[tokens, layer, 0, index_head], k_tile, loaded)
    plgpu.copy_gmem_to_smem(refs.grad_k.at[layer, tokens, index_head], grad_k_tile, loaded)
    plgpu.copy_gmem_to_smem(refs.grad_v.at[layer, tokens, index_head], grad_v_tile, loaded)
    if v_tile is not None:
        plgpu.copy_gmem_to_smem(refs.kv.at[tokens, layer, 1, index_head], v_tile, loaded)
    if weight_tile is not None:
        plgpu.copy_gmem_to_smem(refs.weight.at[layer], weight_tile, loaded)
    plgpu.barrier_wait(positions_loaded)
    run, terms = _fetch_cos_sin_rows(refs, layer, positions_tile, cos_sin_tile, rows_loaded, run_loaded,
                                     tokens_per_block, interpret)
    counted = _counted_rows(block, total_ctx, interpret)

    def cos_sin():
        _wait_cos_sin_rows(run, rows_loaded, run_loaded)
        return _load(cos_sin_tile, plgpu.Layout.WGMMA, interpret)

    plgpu.barrier_wait(loaded)
    _head_grads(refs, (block, layer, index_head), k_tile=k_tile, grad_k_tile=grad_k_tile, grad_v_tile=grad_v_tile,
                v_tile=v_tile, weight=_load_weight(weight_tile, interpret), cos_sin=cos_sin, terms=terms,
                counted=counted, interpret=interpret, **head)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _heads_looped_backward(refs: _GradRefs, *, k_tiles, grad_k_tiles, grad_v_tiles, heads: int, interpret: bool,
                           v_tiles=None, grad_tiles, weight_sum_tiles=(), multiplier_sum_tile=None, weight_starts=(),
                           head_dim: int, rotary_dim: int, total_ctx: int, kv_dtype, **frame):
    """The gradients of ``heads`` heads of one layer for ``BLOCK_TOKENS`` tokens, from head
    ``group * heads``: the grid point ``(block, layer, group)``, in the forward's
    :func:`~fusedkv_jax.mosaic_kernel.loop_over_heads` frame, with the tiles each head
    reads double-buffered (``[2, BLOCK_TOKENS, columns]``)."""
    block, layer, group = (jax.lax.axis_index(name) for name in GRID_NAMES)
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)
    first_head = group * heads
    tiles = [k_tiles, grad_k_tiles, grad_v_tiles, *([] if v_tiles is None else [v_tiles])]
    counted = _counted_rows(block, total_ctx, interpret)

    def fetch_head(head, slot, loaded):
        head = first_head + head
        sources = [refs.kv.at[tokens, layer, 0, head], refs.grad_k.at[layer, tokens, head],
                   refs.grad_v.at[layer, tokens, head], refs.kv.at[tokens, layer, 1, head]]
        for source, tile in zip(sources, tiles):  # V's source only where V has tiles
            plgpu.copy_gmem_to_smem(source, tile.at[slot], loaded)

    def compute_head(head, slot, weight, cos_sin, terms):
        k_tile, grad_k_tile, grad_v_tile, *v_tile = [tile.at[slot] for tile in tiles]
        _head_grads(refs, (block, layer, first_head + head), k_tile=k_tile, grad_k_tile=grad_k_tile,
                    grad_v_tile=grad_v_tile, v_tile=v_tile[0] if v_tile else None, weight=weight,
                    cos_sin=lambda: cos_sin, terms=terms, counted=counted, grad_tiles=grad_tiles,
                    weight_sum_tiles=weight_sum_tiles, multiplier_sum_tile=multiplier_sum_tile,
                    weight_starts=weight_starts, head_dim=head_dim, rotary_dim=rotary_dim, kv_dtype=kv_dtype,
                    interpret=interpret)

    loop_over_heads(refs, layer, tokens, fetch_head, compute_head, heads=heads, interpret=interpret, **frame)


def _counted_rows(block, total_ctx: int, interpret: bool):
    """Whether each row of ``block`` is a token of the context: rows past it (a last
    block's) add nothing to the sums."""
    return block * BLOCK_TOKENS + row_offsets(interpret) < total_ctx


def _head_grads(refs: _GradRefs, index: tuple, *, k_tile, grad_k_tile, grad_v_tile, v_tile, weight, cos_sin, terms,
                counted, grad_tiles, weight_sum_tiles=(), multiplier_sum_tile=None, weight_starts=(), head_dim: int,
                rotary_dim: int, kv_dtype, interpret: bool):
    """The gradients of the head at ``index`` (block, layer, head) from its tiles, loaded:
    V's out first, then K's and the head's weight sums, each through its tiles out.
    ``weight``: the layer's weight row in registers (None without a K-norm); ``cos_sin()``:
    the block's cos/sin rows in registers, once they have arrived; ``terms``: each row's term
    (:func:`~fusedkv_jax.mosaic_kernel._fetch_cos_sin_rows`); ``counted``: each row's
    :func:`_counted_rows`."""
    block, layer, head = index
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)
    _store_grad_v(refs, grad_v_tile, v_tile, multiplier_sum_tile, index, counted, kv_dtype, interpret)
    x = _pieces(_to_fp32(_load(k_tile, plgpu.Layout.WGMMA, interpret), kv_dtype), rotary_dim)
    g_parts = _to_fp32(_load(grad_k_tile, plgpu.Layout.WGMMA, interpret), kv_dtype)
    if weight is not None:
        weight = _pieces(weight_parts(weight, g_parts), rotary_dim)
    gn = _rotated_back(_pieces(g_parts, rotary_dim), cos_sin(), rotary_dim)
    grads, weight_sums = _normalized_grads(_flat(x), _flat(gn), None if weight is None else _flat(weight), terms,
                                           counted, head_dim)
    first, second, *tails = grads
    for tile, parts in zip(grad_tiles, _tiles_out(first, second, tails, words=len(g_parts) == 2)):
        tile[...] = _from_fp32(parts, tile.dtype, kv_dtype)
    for tile, sums in zip(weight_sum_tiles, weight_sums):
        tile[...] = sums
    plgpu.commit_smem()
    start = 0
    for tile in grad_tiles:
        plgpu.copy_smem_to_gmem(tile, refs.grad_kv.at[tokens, layer, 0, head, pl.ds(start, tile.shape[1])])
        start += tile.shape[1]
    for tile, start in zip(weight_sum_tiles, weight_starts):
        plgpu.copy_smem_to_gmem(tile, refs.weight_sums.at[block, layer, head, pl.ds(start, tile.shape[0])])


def _store_grad_v(refs: _GradRefs, grad_v_tile, v_tile, multiplier_sum_tile, index: tuple, counted, kv_dtype,
                  interpret: bool):
    """V's gradient out to ``grad_kv``: the incoming one as it is, or, with a
    ``v_multiplier`` (``v_tile`` given), times the layer's multiplier (in fp32, rounded
    once), the column sums of ``v * g_v`` over the counted rows going to
    ``multiplier_sums``."""
    block, layer, head = index
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)
    if v_tile is not None:
        g_v = _to_fp32(_load(grad_v_tile, plgpu.Layout.WGMMA, interpret), kv_dtype)
        v = _to_fp32(_load(v_tile, plgpu.Layout.WGMMA, interpret), kv_dtype)
        sums = _column_sums(v[0] * g_v[0], counted)
        for v_part, g_part in zip(v[1:], g_v[1:]):
            sums = sums + _column_sums(v_part * g_part, counted)
        multiplier_sum_tile[...] = sums
        multiplier = refs.v_multiplier[layer]
        grad_v_tile[...] = _from_fp32([part * multiplier for part in g_v], grad_v_tile.dtype, kv_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(multiplier_sum_tile, refs.multiplier_sums.at[block, layer, head])
    plgpu.copy_smem_to_gmem(grad_v_tile, refs.grad_kv.at[tokens, layer, 1, head])


def _weight_pieces(config: FusedKVConfig) -> list:
    """``(start, width)`` in the weight's columns of each of
    :func:`~fusedkv_jax.mosaic_kernel._pieces`' pieces: ``neox`` the halves and the tail
    side by side; ``gptj`` the even dims, then the odd ones, each rotary dims first."""
    dim, half = config.head_dim, config.rotary_dim // 2
    if config.rope_style == "gptj":
        pieces = [(0, half), (dim // 2, half), (half, dim // 2 - half), (dim // 2 + half, dim // 2 - half)]
    else:
        pieces = [(0, half), (half, half), (2 * half, dim - 2 * half)]
    return [(start, width) for start, width in pieces if width]


def _flat(pieces: tuple) -> list:
    first, second, tails = pieces
    return [first, second, *tails]


def _rotated_back(pieces: tuple, cos_sin, rotary_dim: int) -> tuple:
    """``rope^T``: every rotary pair rotated by minus its angle, the dims past them as they are."""
    half = rotary_dim // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    first, second, tails = pieces
    return first * cos + second * sin, second * cos - first * sin, tails


def _normalized_grads(x: list, gn: list, weight, row_terms, counted, head_dim: int) -> tuple:
    """``(grad_x, weight_sums)`` over a head row's pieces: ``r * (w*gn - x*r * mean(x*r *
    w*gn))`` and the column sums of ``gn * x*r`` over the counted rows whose ``r`` is a
    number (a head the forward poisons does not depend on the weight). Without a
    ``weight`` (no K-norm): ``gn`` times each row's term (1, or NaN without a rotation), and
    no sums. The edge values of ``r`` are the forward's (CONTRACT.md, Gradients)."""
    if weight is None:
        return [piece * by_row(row_terms, piece) for piece in gn], []
    inv_rms = inverse_rms(x, row_terms, head_dim)
    normed = [piece * by_row(inv_rms, piece) for piece in x]
    weighted = [g_piece * w_piece for g_piece, w_piece in zip(gn, weight)]
    mean = row_sums([n * w for n, w in zip(normed, weighted)]) / head_dim
    grads = [by_row(inv_rms, n) * (w - n * by_row(mean, n)) for n, w in zip(normed, weighted)]
    summed = counted & (inv_rms == inv_rms)
    return grads, [_column_sums(g_piece * n, summed) for g_piece, n in zip(gn, normed)]


def _column_sums(values, counted):
    """``values`` summed over the rows where ``counted``: ``[columns]``."""
    return jnp.sum(jnp.where(by_row(counted, values), values, 0.0), axis=0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def backward(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, grad_k, grad_v, layer_rope_table=None,
             *, config: FusedKVConfig, interpret: bool):
    """``(grad_kv, grad_k_norm_weight, grad_v_multiplier)`` of the op at these inputs, the
    last two None without a K-norm, a multiplier; ``grad_k``/``grad_v`` in ``kv``'s dtype,
    ``[n_layers, total_ctx, heads, head_dim]``. The arguments as for
    :func:`fusedkv_jax.mosaic_kernel.launch`, which must take the call."""
    if v_multiplier is not None and not scales_v_in_kernel(config, kv.dtype):
        return _scaled_v_after(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, grad_k, grad_v,
                               layer_rope_table, config=config, interpret=interpret)
    total_ctx, n_layers, _ = kv.shape
    gptj = config.rope_style == "gptj"
    dim, rotary_dim = config.head_dim, config.rotary_dim
    operands = kernel_operands(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table,
                               config=config)
    operands.update(grad_k=_as_words(grad_k, gptj), grad_v=_as_words(grad_v, gptj))
    columns, tile_dtype = tile_columns(config, kv.dtype)
    k_norm, multiplied = k_norm_weight is not None, v_multiplier is not None
    head_tiles = ("k", "grad_k", "grad_v", "v")[:3 + multiplied]
    heads = heads_per_program(config, total_ctx, n_layers, kv.dtype, head_tiles=len(head_tiles))
    blocks = pl.cdiv(total_ctx, BLOCK_TOKENS)
    tiled = total_ctx % 8 == 0
    tokens_per_block = min(BLOCK_TOKENS, total_ctx)
    scratch = dict(
        grad_tiles=part_tiles(config, kv.dtype, tiled=tiled),
        positions_tile=plgpu.SMEM((BLOCK_TOKENS,), jnp.int32),
        cos_sin_tile=plgpu.SMEM((BLOCK_TOKENS, rotary_dim), jnp.float32),
        rows_loaded=plgpu.Barrier(num_arrivals=tokens_per_block),
        run_loaded=plgpu.Barrier(num_arrivals=1),
    )
    if heads > 1:
        scratch.update({f"{name}_tiles": _tile((2, BLOCK_TOKENS, columns), tile_dtype, tiled=True)
                        for name in head_tiles},
                       loaded=plgpu.Barrier(num_arrivals=len(head_tiles), num_barriers=2),
                       fixed_loaded=plgpu.Barrier(num_arrivals=1 + k_norm))
        kernel = functools.partial(_heads_looped_backward, heads=heads)
    else:
        scratch.update({f"{name}_tile": _tile((BLOCK_TOKENS, columns), tile_dtype, tiled=tiled) for name in head_tiles},
                       loaded=plgpu.Barrier(num_arrivals=len(head_tiles) + k_norm),
                       positions_loaded=plgpu.Barrier(num_arrivals=1))
        kernel = _one_head_backward
    outputs = dict(grad_kv=jax.ShapeDtypeStruct(operands["kv"].shape, tile_dtype))
    # A row of partial sums for every head, whichever program computes it.
    sums = (blocks, n_layers, config.num_kv_heads)
    if k_norm:
        scratch.update(weight_tile=plgpu.SMEM((dim,), jnp.float32),
                       weight_sum_tiles=[plgpu.SMEM((width,), jnp.float32) for _, width in _weight_pieces(config)])
        outputs.update(weight_sums=jax.ShapeDtypeStruct((*sums, dim), jnp.float32))
    if multiplied:
        scratch.update(multiplier_sum_tile=plgpu.SMEM((columns,), jnp.float32))
        outputs.update(multiplier_sums=jax.ShapeDtypeStruct((*sums, columns), jnp.float32))
    kernel = functools.partial(kernel, weight_starts=[start for start, _ in _weight_pieces(config)],
                               head_dim=dim, rotary_dim=rotary_dim, tokens_per_block=tokens_per_block,
                               total_ctx=total_ctx, kv_dtype=kv.dtype, interpret=interpret)
    inputs, names = tuple(operands), tuple(outputs)

    def body(*refs, **tiles):
        kernel(_GradRefs(**dict(zip(inputs + names, refs))), **tiles)

    results = dict(zip(names, plgpu.kernel(
        body, out_type=list(outputs.values()), scratch_types=scratch,
        grid=(blocks, n_layers, config.num_kv_heads // heads), grid_names=GRID_NAMES,
        compiler_params=plgpu.CompilerParams(), interpret=_interpret_params() if interpret else None,
        kernel_name=KERNEL_NAME,
    )(*operands.values())))
    grad_kv = _as_elements(results["grad_kv"], kv.dtype, gptj).reshape(kv.shape)
    grad_weight = grad_multiplier = None
    if k_norm_weight is not None:
        grad_weight = results["weight_sums"].sum(axis=(0, 2))
        if gptj:  # back from the even dims, then the odd ones
            grad_weight = grad_weight.reshape(n_layers, 2, -1).swapaxes(1, 2).reshape(n_layers, dim)
        grad_weight = grad_weight.astype(k_norm_weight.dtype)
    if v_multiplier is not None:
        grad_multiplier = results["multiplier_sums"].sum(axis=(0, 2, 3))
    return grad_kv, grad_weight, grad_multiplier


def _scaled_v_after(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, grad_k, grad_v, layer_rope_table,
                    *, config: FusedKVConfig, interpret: bool):
    """:func:`backward` with a ``v_multiplier`` where its tiles do not fit: the kernel without
    one, then V's gradient ``g_v * v_multiplier[l]`` (in fp32, rounded once) written over
    the copy it made, and ``sum(v * g_v)`` per layer, by jnp."""
    grad_kv, grad_weight, _ = backward(kv, k_norm_weight, eps, cos_sin_cache, positions, None, grad_k, grad_v,
                                       layer_rope_table, config=config, interpret=interpret)
    total_ctx, n_layers, width = kv.shape
    g_v = grad_v.astype(jnp.float32).swapaxes(0, 1).reshape(total_ctx, n_layers, width // 2)
    v = kv[:, :, width // 2:].astype(jnp.float32)
    multiplier = v_multiplier.astype(jnp.float32)
    grad_kv = grad_kv.at[:, :, width // 2:].set((g_v * multiplier[None, :, None]).astype(kv.dtype))
    return grad_kv, grad_weight, jnp.sum(v * g_v, axis=(0, 2))
