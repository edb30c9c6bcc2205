"""The fused K/V kernel on the Pallas **Mosaic GPU** lowering (Hopper TMA copies, no gathers).

The math is :mod:`fusedkv_jax.kernel`'s (CONTRACT.md, Math); this module holds the
kernel and its launcher only (validation stays in :mod:`interop.core.spec`, the public
function and the choice of lowering in :mod:`fusedkv_jax.ops`).

One program per (block of 64 tokens, layer, head); or, where fewer programs still fill
the GPU (:func:`heads_per_program`), one per (block, layer, group of heads) that loops
over its heads, fetching the block's cos/sin rows once for them all. Mosaic GPU on Hopper has no
array-index gather, so everything the kernel reads arrives by TMA copies whose starts
are scalars: the ``[64, head_dim]`` K and V tiles of the head (``kv`` viewed as
``[total_ctx, n_layers, 2, heads, head_dim]``, a free reshape), the layer's norm
weight, the block's positions, and then the cos/sin rows at those positions (in the
layer's table, with ``layer_rope_table``): one copy for the block where its positions
count up in range, else one a token at the position read back from shared memory (an
out-of-range position or table copies row 0 of table 0, never reads outside the cache,
and makes its row's term NaN, which turns the whole K row into NaN). V goes from shared
memory straight back out (scaled in its tile first, with a ``v_multiplier``); K is computed in registers in the
WGMMA layout (64 rows, one row per token, so the RMS is a row reduction), its
``neox`` halves and unrotated tail are static column slices of the registers, and
each part is copied out from its own shared-memory tile. ``gptj``'s interleaved pairs
are no column slice of that layout, but each pair of 16-bit elements is one 32-bit
word: the kernel moves ``kv`` and the outputs as words (free views of the same bytes)
and splits each word into the pair's two members in registers, after which the
rotation is ``neox``'s on the words' columns (:func:`_to_fp32`, :func:`_from_fp32`).
With ``total_ctx`` a multiple of 8 the tiles are swizzled and every copy is a tiled TMA
copy, which fills the rows past ``total_ctx`` of the last block with zeros on the way in
and clips them on the way out; otherwise the tiles are plain (their register loads and
stores have bank conflicts) and V moves in two column halves (see :func:`_one_head_kernel`).

What it serves: ``kv`` in bf16/fp16, ``head_dim`` up to 256 (a TMA box side) and
shared memory permitting, ``head_dim`` and ``rotary_dim`` multiples of 32
(:func:`supports`); ``total_ctx`` at most 8 or a multiple of 8
(:func:`supports_context`). The rest (fp32 ``kv``, other dims) is the Triton lowering's.

jax versions (as of jax 0.11.2): ``pl.pallas_call`` no longer
lowers to Mosaic GPU there (its lowering rule is gone: a bare ``AssertionError``), so
the kernel is a ``pl.kernel`` over a Mosaic GPU mesh. It has no ``input_output_aliases``;
instead a caller's ``k_out``/``v_out`` enter as refs (``jax.new_ref`` in global memory),
which the kernel reads and writes in place, and which a jit that donates the outputs
turns into aliased buffers. Without given outputs the kernel is a ``plgpu.kernel``,
which ``jax.vmap`` batches over a grid axis; Pallas batches no kernel whose operands
include refs. That version also lays out plain shared-memory tiles itself (tiled by 8 rows), which
refuses a context longer than 8 tokens and not a multiple of 8. On the CPU, jax
0.10.2's Mosaic GPU interpreter runs ``plgpu.kernel`` grids (its gridded
``pallas_call`` keeps only the first program's writes) but cannot copy past an
array's end, so there ``total_ctx`` must be a multiple of ``BLOCK_TOKENS``.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from fusedkv_jax import devices
from interop.core.reference import SMALLEST_NORMAL_FP32
from interop.core.spec import FusedKVConfig

# The WGMMA register layout tiles rows by 64: one program's tokens.
BLOCK_TOKENS = 64
_MAX_BOX = 256  # the longest side of one TMA copy
_SHARED_BYTES = 200 * 1024  # of Hopper's 227 KiB per block, with room for the rest
# fp32 kv ends in CUDA_ERROR_MISALIGNED_ADDRESS on Hopper (jax 0.11.2), so it stays on
# the Triton lowering.
_KV_DTYPES = (jnp.bfloat16, jnp.float16)
# gptj rows move as words of two 16-bit elements, each word one rotary pair.
_WORD = jnp.dtype(jnp.uint32)
# A copy into shared memory moves a multiple of 128 bytes, a share for each of the
# warpgroup's threads: jax 0.10.2 refuses other copies when it lowers the kernel, and on
# jax 0.11.2 a token's cos/sin row of 64 or 192 bytes ends in CUDA_ERROR_MISALIGNED_ADDRESS
# on Hopper. So the fp32 rows of cos/sin (rotary_dim) and of the weight (head_dim) are
# multiples of 32 values, which also makes every run of K's columns a multiple of 32
# bytes, the narrowest swizzle.
_COPY_BYTES = 128
_FP32_BYTES = jnp.dtype(jnp.float32).itemsize
GRID_NAMES = ("block", "layer", "head")  # "head": a group of heads where a program loops over them
# Programs of several heads loop over them only where they still give each multiprocessor this many.
_PROGRAMS_PER_MULTIPROCESSOR = 2
KERNEL_NAME = "fused_kv_norm_rope_mosaic"


def supports(config: FusedKVConfig, kv_dtype) -> bool:
    """Whether this kernel computes ``config`` for ``kv`` of ``kv_dtype``."""
    dtype = jnp.dtype(kv_dtype)
    if dtype not in [jnp.dtype(d) for d in _KV_DTYPES]:
        return False
    return (config.head_dim <= _MAX_BOX and _fits_shared_memory(config, dtype, kv_tiles=2)
            and all(dims * _FP32_BYTES % _COPY_BYTES == 0 for dims in (config.head_dim, config.rotary_dim)))


def tile_columns(config: FusedKVConfig, kv_dtype) -> tuple:
    """``(columns, dtype)`` of a K or V tile's rows: ``head_dim`` elements of ``kv_dtype``,
    or for ``gptj`` ``head_dim / 2`` words."""
    if config.rope_style == "gptj":
        return config.head_dim // 2, _WORD
    return config.head_dim, jnp.dtype(kv_dtype)


def part_tiles(config: FusedKVConfig, kv_dtype, *, tiled: bool) -> list:
    """The shared-memory tiles K's parts go out through (:func:`_tiles_out`), side by side
    in a row, in the tiles' columns (elements; words of two for ``gptj``): ``neox``'s two
    rotary halves and tail, ``gptj``'s rotary pairs and the tail's (none for an empty run)."""
    _, dtype = tile_columns(config, kv_dtype)
    dim, rotary_dim = config.head_dim, config.rotary_dim
    runs = ((rotary_dim // 2, (dim - rotary_dim) // 2) if config.rope_style == "gptj"
            else (rotary_dim // 2, rotary_dim // 2, dim - rotary_dim))
    return [_tile((BLOCK_TOKENS, width), dtype, tiled=tiled, start=sum(runs[:index]))
            for index, width in enumerate(runs) if width]


def supports_context(total_ctx: int, *, interpret: bool) -> bool:
    """Whether this kernel takes a context of ``total_ctx`` tokens (module docstring)."""
    if interpret:
        return total_ctx % BLOCK_TOKENS == 0
    return total_ctx <= 8 or total_ctx % 8 == 0


def refused_config(config: FusedKVConfig, kv_dtype) -> str | None:
    """Why this kernel does not take ``config`` for ``kv`` of ``kv_dtype`` ("got ...,
    expected ..."), or None where it does (:func:`supports`)."""
    if supports(config, kv_dtype):
        return None
    return (f"got 'mosaic_gpu' for rope_style={config.rope_style!r}, head_dim={config.head_dim}, "
            f"rotary_dim={config.rotary_dim}, dtype={jnp.dtype(kv_dtype).name}, expected 'triton' (Mosaic GPU "
            "takes bf16/fp16 with head_dim <= 256, and head_dim and rotary_dim multiples of 32)")


def refused_context(total_ctx: int, *, interpret: bool) -> str | None:
    """Why this kernel does not take ``total_ctx`` tokens ("got ..., expected ..."), or
    None where it does (:func:`supports_context`)."""
    if supports_context(total_ctx, interpret=interpret):
        return None
    expected = f"a multiple of {BLOCK_TOKENS} in interpret mode" if interpret else "at most 8 or a multiple of 8"
    return f"got {total_ctx}, expected {expected}"


def heads_per_program(config: FusedKVConfig, total_ctx: int, n_layers: int, kv_dtype, *, head_tiles: int = 2) -> int:
    """The heads a program takes (:func:`_heads_looped_kernel` where more than one): the
    most that divide the heads and still leave every multiprocessor two programs. A
    program of several heads fetches the block's cos/sin rows once for all of them and
    keeps the next head's tiles in flight; it needs tiled copies and room for two of each
    of the ``head_tiles`` tiles a head reads (K and V; the backward's more) beside the K
    parts and the rows (one head a program otherwise)."""
    if total_ctx % 8 or not _fits_shared_memory(config, kv_dtype, kv_tiles=2 * head_tiles):
        return 1
    heads = config.num_kv_heads
    block_layers = pl.cdiv(total_ctx, BLOCK_TOKENS) * n_layers
    enough = _PROGRAMS_PER_MULTIPROCESSOR * devices.multiprocessors()
    return max(group for group in range(1, heads + 1)
               if heads % group == 0 and (group == 1 or block_layers * (heads // group) >= enough))


def _fits_shared_memory(config: FusedKVConfig, kv_dtype, *, kv_tiles: int) -> bool:
    """Whether a program's tiles fit: ``kv_tiles`` tiles a head reads (K and V, or the
    backward's; double-buffered: two of each) and the K parts out, in kv's dtype; the
    cos/sin rows in fp32."""
    tile_bytes = BLOCK_TOKENS * config.head_dim * jnp.dtype(kv_dtype).itemsize
    return (kv_tiles + 1) * tile_bytes + BLOCK_TOKENS * 4 * config.rotary_dim <= _SHARED_BYTES


def _tile(shape, dtype, *, tiled: bool, start: int = 0):
    """A shared-memory tile; ``tiled``: swizzled for conflict-free WGMMA-layout loads and
    stores, its copies (whose GMEM window starts at column ``start``) tiled by 8 rows."""
    if not tiled:
        return plgpu.SMEM(shape, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(math.gcd(shape[-1], start or shape[-1]) * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)))


class _Refs(NamedTuple):
    """The kernel's arrays in global memory, rows as elements (``neox``) or as words of two
    (``gptj``: ``uint32[..., head_dim / 2]``, and the weight's even dims before its odd
    ones). ``kv[total_ctx, n_layers, 2, heads, head_dim]``,
    ``cos_sin[max_pos, rotary_dim]`` fp32 (``[n_tables, max_pos, rotary_dim]`` with ``table``;
    a bf16 or fp16 table is converted before the launch), ``positions[total_ctx]`` int32,
    ``k_out, v_out[n_layers, total_ctx, heads, head_dim]``; the options, None where not
    taken: the K-norm's ``weight[n_layers, head_dim]`` fp32 and ``eps[n_layers]`` fp32,
    ``v_multiplier[n_layers]`` fp32, ``table[n_layers]`` int32 (``layer_rope_table``)."""

    kv: Any
    cos_sin: Any
    positions: Any
    k_out: Any
    v_out: Any
    weight: Any = None
    eps: Any = None
    v_multiplier: Any = None
    table: Any = None


def _one_head_kernel(
    refs: _Refs, *, k_tile, v_tiles, out_tiles, positions_tile, cos_sin_tile,
    loaded, positions_loaded, rows_loaded, run_loaded, weight_tile=None,
    head_dim: int, rotary_dim: int, tokens_per_block: int, tiled: bool, kv_dtype, interpret: bool,
):
    """K and V of one head for one layer and ``BLOCK_TOKENS`` tokens: the grid point
    ``(block, layer, head)``; the shared-memory tiles and barriers come by name."""
    # Untiled, V moves in two column halves: a copy out of whole rows of a one-head
    # output is one contiguous run of memory, which Mosaic does as a bulk copy that
    # clips only at the end of the array (running on into the next layer) rather
    # than as a tensor copy that clips the rows past total_ctx.
    half_row = v_tiles[0].shape[-1]
    v_columns = [slice(None)] if tiled else [pl.ds(0, half_row), pl.ds(half_row, half_row)]
    block, layer, head = (jax.lax.axis_index(name) for name in GRID_NAMES)
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)

    plgpu.copy_gmem_to_smem(refs.positions.at[tokens], positions_tile, positions_loaded)
    plgpu.copy_gmem_to_smem(refs.kv.at[tokens, layer, 0, head], k_tile, loaded)
    for v_tile, columns in zip(v_tiles, v_columns):
        plgpu.copy_gmem_to_smem(refs.kv.at[tokens, layer, 1, head, columns], v_tile, loaded)
    if weight_tile is not None:
        plgpu.copy_gmem_to_smem(refs.weight.at[layer], weight_tile, loaded)
    plgpu.barrier_wait(positions_loaded)
    run, terms = _fetch_cos_sin_rows(refs, layer, positions_tile, cos_sin_tile, rows_loaded, run_loaded,
                                     tokens_per_block, interpret)

    plgpu.barrier_wait(loaded)
    _store_v(refs, v_tiles, layer, [(tokens, head, columns) for columns in v_columns], kv_dtype, interpret)
    normed = _normalized(_to_fp32(_load(k_tile, plgpu.Layout.WGMMA, interpret), kv_dtype),
                         _load_weight(weight_tile, interpret), terms, head_dim)
    _wait_cos_sin_rows(run, rows_loaded, run_loaded)
    _store_k(_rotated(normed, _load(cos_sin_tile, plgpu.Layout.WGMMA, interpret), rotary_dim),
             out_tiles, refs.k_out, (layer, tokens, head), kv_dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _heads_looped_kernel(
    refs: _Refs, *, k_tiles, v_tiles, out_tiles, heads: int, head_dim: int, rotary_dim: int, kv_dtype, interpret: bool,
    **frame,
):
    """``heads`` heads of one layer for ``BLOCK_TOKENS`` tokens, from head ``group * heads``:
    the grid point ``(block, layer, group)``, in :func:`loop_over_heads`' frame, with K and
    V double-buffered (``k_tiles``/``v_tiles[2, BLOCK_TOKENS, head_dim]``)."""
    block, layer, group = (jax.lax.axis_index(name) for name in GRID_NAMES)
    tokens = pl.ds(block * BLOCK_TOKENS, BLOCK_TOKENS)
    first_head = group * heads

    def fetch_head(head, slot, loaded):
        for part, tiles in enumerate((k_tiles, v_tiles)):
            plgpu.copy_gmem_to_smem(refs.kv.at[tokens, layer, part, first_head + head], tiles.at[slot], loaded)

    def compute_head(head, slot, weight, cos_sin, terms):
        _store_v(refs, [v_tiles.at[slot]], layer, [(tokens, first_head + head)], kv_dtype, interpret)
        normed = _normalized(_to_fp32(_load(k_tiles.at[slot], plgpu.Layout.WGMMA, interpret), kv_dtype), weight,
                             terms, head_dim)
        _store_k(_rotated(normed, cos_sin, rotary_dim), out_tiles, refs.k_out, (layer, tokens, first_head + head),
                 kv_dtype)

    loop_over_heads(refs, layer, tokens, fetch_head, compute_head, heads=heads, interpret=interpret, **frame)


def loop_over_heads(refs, layer, tokens, fetch_head, compute_head, *, heads: int, positions_tile, cos_sin_tile,
                    loaded, fixed_loaded, rows_loaded, run_loaded, tokens_per_block: int, interpret: bool,
                    weight_tile=None):
    """The frame of a program of ``heads`` heads of one ``layer`` for a block's ``tokens``
    (the grid point ``(block, layer, group)``): the block's positions and cos/sin rows and
    the layer's weight fetched once, and each head's tiles double-buffered, the next
    head's arriving while a head is computed and stored. ``fetch_head(head, slot,
    barrier)`` copies the tiles of the group's ``head`` into ``slot`` (0 or 1) on
    ``barrier``; ``compute_head(head, slot, weight, cos_sin, terms)`` computes and stores
    it from them, given the weight row and cos/sin rows in registers (the weight None
    without a K-norm) and the rows' terms (:func:`_fetch_cos_sin_rows`)."""
    plgpu.copy_gmem_to_smem(refs.positions.at[tokens], positions_tile, fixed_loaded)
    if weight_tile is not None:
        plgpu.copy_gmem_to_smem(refs.weight.at[layer], weight_tile, fixed_loaded)
    fetch_head(0, 0, loaded.at[0])
    plgpu.barrier_wait(fixed_loaded)
    run, terms = _fetch_cos_sin_rows(refs, layer, positions_tile, cos_sin_tile, rows_loaded, run_loaded,
                                     tokens_per_block, interpret)
    weight = _load_weight(weight_tile, interpret)
    _wait_cos_sin_rows(run, rows_loaded, run_loaded)
    cos_sin = _load(cos_sin_tile, plgpu.Layout.WGMMA, interpret)

    @pl.loop(0, heads)
    def _head(head):
        slot = jax.lax.rem(head, 2)
        # The other slot and the tiles out are free once the head before's stores have read them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(head + 1 < heads)
        def _fetch_next():
            next_head, next_slot = head + 1, 1 - slot
            fetch_head(next_head, next_slot, loaded.at[next_slot])

        plgpu.barrier_wait(loaded.at[slot])
        compute_head(head, slot, weight, cos_sin, terms)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _fetch_cos_sin_rows(refs: _Refs, layer, positions_tile, cos_sin_tile, rows_loaded, run_loaded,
                        tokens_per_block: int, interpret: bool):
    """Copy the block's cos/sin rows of the layer's table; returns ``(run, terms)``.
    ``run``: whether the block's positions are a run (consecutive and in range): then its
    rows arrive as one copy on ``run_loaded``, else as one copy a token on
    ``rows_loaded`` (wait with :func:`_wait_cos_sin_rows`). ``terms[BLOCK_TOKENS]``, in
    registers: each token's row term, the layer's ``eps`` with a K-norm, else 1; NaN for a
    token without a row (its position, or the layer's table, out of range), which turns
    its K row into NaN."""
    max_position = refs.cos_sin.shape[-2]
    table_index, table_in_range = (), True
    if refs.table is not None:
        table = refs.table[layer]
        table_in_range = (table >= 0) & (table < refs.cos_sin.shape[0])
        table_index = (jnp.where(table_in_range, table, 0),)
    term = refs.eps[layer] if refs.eps is not None else jnp.float32(1.0)
    positions = _load(positions_tile, plgpu.Layout.WGMMA.reduce(1), interpret)
    offsets = row_offsets(interpret)
    first = positions_tile[0]
    # A run where every row counts up from the first; rows past a short call's tokens do not count.
    counts_up = (positions == first + offsets) | (offsets >= tokens_per_block)
    run = ((jnp.min(counts_up.astype(jnp.int32)) == 1) & (first >= 0)
           & (first <= max_position - tokens_per_block) & table_in_range)

    @pl.when(run)
    def _fetch_run():
        plgpu.copy_gmem_to_smem(refs.cos_sin.at[(*table_index, pl.ds(first, tokens_per_block))],
                                cos_sin_tile.at[pl.ds(0, tokens_per_block)], run_loaded)

    @pl.when(jnp.logical_not(run))
    def _fetch_rows():
        @pl.loop(0, tokens_per_block)
        def _fetch_row(token):
            position = positions_tile[token]
            in_range = (position >= 0) & (position < max_position) & table_in_range
            # A token without a row reads row 0 of table 0 (never outside the cache).
            plgpu.copy_gmem_to_smem(refs.cos_sin.at[(*table_index, pl.ds(jnp.where(in_range, position, 0), 1))],
                                    cos_sin_tile.at[pl.ds(token, 1)], rows_loaded)

    in_range = (positions >= 0) & (positions < max_position) & table_in_range
    return run, jnp.where(in_range, term, jnp.float32(jnp.nan))


def row_offsets(interpret: bool):
    """``int32[BLOCK_TOKENS]``: each row's offset in its block, in the WGMMA row layout."""
    offsets = jax.lax.broadcasted_iota(jnp.int32, (BLOCK_TOKENS,), 0)
    if interpret:  # the interpreter's arrays have no layout
        return offsets
    return plgpu.layout_cast(offsets, plgpu.Layout.WGMMA.reduce(1))


def _wait_cos_sin_rows(run, rows_loaded, run_loaded):
    """Wait for the rows :func:`_fetch_cos_sin_rows` asked for (``run``: what it returned)."""
    @pl.when(run)
    def _one_copy():
        plgpu.barrier_wait(run_loaded)

    @pl.when(jnp.logical_not(run))
    def _a_copy_a_token():
        plgpu.barrier_wait(rows_loaded)


def _load_weight(weight_tile, interpret: bool):
    """The layer's K-norm weight as a row of registers; None without a K-norm."""
    return None if weight_tile is None else _load(weight_tile, plgpu.Layout.WGMMA.reduce(0), interpret)


def _normalized(parts: list, weight, row_terms, head_dim: int) -> list:
    """A ``[BLOCK_TOKENS, head_dim]`` K tile as fp32 ``parts`` (:func:`_to_fp32`), each row
    RMS-normalized over all its parts (``row_terms``: its ``eps``) and weighted (``weight``:
    the parts' columns side by side); without a ``weight`` (no K-norm) each row times its
    term (1). A NaN term makes its row NaN either way."""
    if weight is None:
        return [part * by_row(row_terms, part) for part in parts]
    inv_rms = inverse_rms(parts, row_terms, head_dim)
    return [part * by_row(inv_rms, part) * weights for part, weights in zip(parts, weight_parts(weight, parts))]


def inverse_rms(pieces: list, row_terms, head_dim: int):
    """``rsqrt(mean(k*k) + eps)`` of each row of a K tile's ``pieces`` (its columns side by
    side; ``row_terms``: each row's ``eps``, NaN without a row), with the edge values of
    interop.core.reference as the Triton lowering decides them per head row: 0 where there
    is no scale to normalize by, NaN where the sum of squares is not finite."""
    sum_squares = row_sums([piece * piece for piece in pieces])
    mean_square_eps = sum_squares / head_dim + row_terms
    inv_rms = jnp.where(mean_square_eps < SMALLEST_NORMAL_FP32, 0.0, jax.lax.rsqrt(mean_square_eps))
    return jnp.where(sum_squares < jnp.inf, inv_rms, jnp.nan)


def row_sums(pieces: list):
    """Each row's sum over all of ``pieces`` (arrays of the same rows)."""
    total = jnp.sum(pieces[0], axis=1)
    for piece in pieces[1:]:
        total = total + jnp.sum(piece, axis=1)
    return total


def by_row(values, like):
    """A value a row (``[rows]``) at ``like``'s shape."""
    return jax.lax.broadcast_in_dim(values, like.shape, (0,))


def weight_parts(weight, parts: list) -> list:
    """The layer's weight row (its columns those of K's ``parts``, side by side) at the
    parts' shapes."""
    rows, width = parts[0].shape
    weights = jax.lax.broadcast_in_dim(weight, (rows, width * len(parts)), (1,))
    return [weights[:, index * width:(index + 1) * width] for index in range(len(parts))]


def _rotated(parts: list, cos_sin, rotary_dim: int) -> list:
    """The rotation of the first ``rotary_dim`` dims of a normalized K tile's ``parts``,
    as the fp32 parts of each K tile out (:func:`_tiles_out`)."""
    half = rotary_dim // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    first, second, tails = _pieces(parts, rotary_dim)
    return _tiles_out(first * cos - second * sin, second * cos + first * sin, tails, words=len(parts) == 2)


def _pieces(parts: list, rotary_dim: int) -> tuple:
    """``(first, second, tails)`` of a K tile's fp32 ``parts`` (:func:`_to_fp32`): the two
    members of every rotary pair, and the dims past them. ``neox`` (one part, the row): the
    rotary halves and the tail; ``gptj`` (the even and the odd dims): the pairs' even and odd
    members, and the even and the odd dims past them."""
    half = rotary_dim // 2
    if len(parts) == 1:
        (row,) = parts
        return row[:, :half], row[:, half:rotary_dim], [row[:, rotary_dim:]] if rotary_dim < row.shape[1] else []
    even, odd = parts
    return even[:, :half], odd[:, :half], [even[:, half:], odd[:, half:]] if half < even.shape[1] else []


def _tiles_out(first, second, tails: list, *, words: bool) -> list:
    """:func:`_pieces`' inverse as the fp32 parts of each K tile out (:func:`_store_k`):
    ``neox`` the two halves, then the tail, each a tile; ``gptj`` (``words``) the pairs,
    then the pairs past the rotary dims, each a tile of words."""
    if words:
        return [[first, second], *([tails] if tails else [])]
    return [[first], [second], *[[tail] for tail in tails]]


def _to_fp32(values, kv_dtype) -> list:
    """A tile's values as fp32 parts: ``[values]``, or, for words (``gptj``), the even and
    the odd elements of the row (each word's low and high 16 bits, of ``kv_dtype``)."""
    if values.dtype != _WORD:
        return [values.astype(jnp.float32)]
    halves = ((values & 0xFFFF).astype(jnp.uint16), (values >> 16).astype(jnp.uint16))
    return [jax.lax.bitcast_convert_type(half, kv_dtype).astype(jnp.float32) for half in halves]


def _from_fp32(parts: list, dtype, kv_dtype):
    """:func:`_to_fp32`'s inverse: ``parts`` rounded once to ``kv_dtype``, as values of
    ``dtype`` (words of the two parts' elements where ``dtype`` is the word)."""
    if dtype != _WORD:
        (values,) = parts
        return values.astype(dtype)
    even, odd = (jax.lax.bitcast_convert_type(part.astype(kv_dtype), jnp.uint16).astype(_WORD) for part in parts)
    return even | (odd << 16)


def _store_k(parts: list, out_tiles: list, k_out_ref, index: tuple, kv_dtype):
    """Copy the K parts out through their tiles into ``k_out_ref[*index]``, side by side."""
    for tile, tile_parts in zip(out_tiles, parts):
        tile[...] = _from_fp32(tile_parts, tile.dtype, kv_dtype)
    plgpu.commit_smem()
    start = 0
    for tile in out_tiles:
        plgpu.copy_smem_to_gmem(tile, k_out_ref.at[(*index, pl.ds(start, tile.shape[1]))])
        start += tile.shape[1]


def _store_v(refs: _Refs, v_tiles: list, layer, indices: list, kv_dtype, interpret: bool):
    """Copy the V tiles out to ``v_out[layer, *index]``, each first scaled in place by the
    layer's ``v_multiplier`` (in fp32, rounded once) where there is one."""
    if refs.v_multiplier is not None:
        multiplier = refs.v_multiplier[layer]
        for tile in v_tiles:
            scaled = [part * multiplier for part in _to_fp32(_load(tile, plgpu.Layout.WGMMA, interpret), kv_dtype)]
            tile[...] = _from_fp32(scaled, tile.dtype, kv_dtype)
        plgpu.commit_smem()
    for tile, index in zip(v_tiles, indices):
        plgpu.copy_smem_to_gmem(tile, refs.v_out.at[(layer, *index)])


def _load(ref, layout, interpret):
    """``ref[...]`` in ``layout``. Untiled shared memory in a register layout has bank
    conflicts, which Mosaic refuses unless told (``optimized=False``); the tiles read so
    are small. Interpret mode has no layouts and no ``plgpu.load``."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, *_WHOLE_REF, layout=layout, optimized=False)


def _whole_ref_index() -> tuple:
    """``plgpu.load``'s index arguments for a whole ref: jax 0.10.2 requires one (``()``);
    later versions take none and deprecate one given."""
    index = inspect.signature(plgpu.load).parameters.get("idx")
    return ((),) if index is not None and index.default is inspect.Parameter.empty else ()


_WHOLE_REF = _whole_ref_index()


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out=None, v_out=None, v_multiplier=None,
           layer_rope_table=None, *, config: FusedKVConfig, interpret):
    """The Mosaic GPU kernel: ``(k_out, v_out)``, each ``[n_layers, total_ctx, heads, head_dim]``.

    ``kv`` dense ``[total_ctx, n_layers, 2*kv_size]``; ``positions`` int32 or int64 (an
    int64 position is narrowed with out-of-range values kept out of range).
    ``k_norm_weight``/``eps``: None for a draft without a K-norm. ``v_multiplier`` and
    ``layer_rope_table`` (with a 3-D ``cos_sin_cache``): as for
    :func:`fusedkv_jax.fused_kv_norm_rope`, None where not taken.
    ``k_out``/``v_out``: optional outputs, written through refs the kernel aliases (in
    place under a jit that donates them; not under ``jax.vmap``, see
    :meth:`_Kernel.written_into`). None allocates the output.
    ``interpret``: run under Mosaic GPU's interpret mode (CPU).
    """
    total_ctx, n_layers, _ = kv.shape
    gptj = config.rope_style == "gptj"
    operands = kernel_operands(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table,
                               config=config)
    kernel = _Kernel(config, total_ctx, n_layers, kv.dtype, tuple(operands), bool(interpret))
    if k_out is None and v_out is None:
        outputs = kernel.fresh(*operands.values())
    else:
        outputs = kernel.written_into(tuple(operands.values()), *(
            None if out is None else _as_words(out, gptj) for out in (k_out, v_out)))
    return tuple(_as_elements(out, kv.dtype, gptj) for out in outputs)


def kernel_operands(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table, *,
                    config: FusedKVConfig) -> dict:
    """The arrays a kernel of this module reads, by :class:`_Refs`' names (those of the
    options not taken left out): ``kv`` as ``[total_ctx, n_layers, 2, heads, head_dim]``
    (words for ``gptj``), the tables, weight, eps and multiplier in fp32 (the weight's even
    dims first for ``gptj``), int32 positions (an int64 one narrowed with out-of-range
    values kept out of range)."""
    total_ctx, n_layers, _ = kv.shape
    max_position = cos_sin_cache.shape[-2]
    if positions.dtype != jnp.int32:
        in_range = (positions >= 0) & (positions < max_position)
        positions = jnp.where(in_range, positions, -1).astype(jnp.int32)
    gptj = config.rope_style == "gptj"
    operands = dict(
        kv=_as_words(kv.reshape(total_ctx, n_layers, 2, config.num_kv_heads, config.head_dim), gptj),
        # A bf16/fp16 table's rows in shared memory end in a misaligned address on Hopper: fp32 rows.
        cos_sin=cos_sin_cache.astype(jnp.float32), positions=positions)
    if k_norm_weight is not None:
        weight = k_norm_weight.astype(jnp.float32)
        if gptj:  # the even dims' weights, then the odd dims': the columns of K's two parts
            weight = weight.reshape(n_layers, -1, 2).swapaxes(1, 2).reshape(n_layers, -1)
        operands.update(weight=weight, eps=eps.astype(jnp.float32))
    if v_multiplier is not None:
        operands.update(v_multiplier=v_multiplier.astype(jnp.float32))
    if layer_rope_table is not None:
        operands.update(table=layer_rope_table)
    return operands


def _as_words(array, gptj: bool):
    """``array[..., head_dim]`` as ``uint32[..., head_dim / 2]``, a word for each pair of
    elements (``gptj``; a view of the same bytes), or itself."""
    return jax.lax.bitcast_convert_type(array.reshape(*array.shape[:-1], -1, 2), _WORD) if gptj else array


def _as_elements(array, dtype, gptj: bool):
    """:func:`_as_words`' inverse."""
    return jax.lax.bitcast_convert_type(array, dtype).reshape(*array.shape[:-1], -1) if gptj else array


class _Kernel:
    """The kernel of one call's shape and options (``inputs``: the names of its operands,
    :class:`_Refs`'s), launched with fresh outputs (:meth:`fresh`) or into given ones
    (:meth:`written_into`)."""

    def __init__(self, config: FusedKVConfig, total_ctx: int, n_layers: int, dtype, inputs: tuple,
                 interpret: bool):
        dim, rotary_dim = config.head_dim, config.rotary_dim
        columns, tile_dtype = tile_columns(config, dtype)
        tokens_per_block = min(BLOCK_TOKENS, total_ctx)
        k_norm = "weight" in inputs
        # Tiled copies move whole tiles of 8 rows: a context of another length takes the
        # untiled tiles (bank conflicts in their loads and stores).
        tiled = total_ctx % 8 == 0
        shared = dict(
            out_tiles=part_tiles(config, dtype, tiled=tiled),
            positions_tile=plgpu.SMEM((BLOCK_TOKENS,), jnp.int32),
            cos_sin_tile=plgpu.SMEM((BLOCK_TOKENS, rotary_dim), jnp.float32),
            rows_loaded=plgpu.Barrier(num_arrivals=tokens_per_block),
            run_loaded=plgpu.Barrier(num_arrivals=1),
        )
        if k_norm:
            shared.update(weight_tile=plgpu.SMEM((dim,), jnp.float32))
        heads = heads_per_program(config, total_ctx, n_layers, dtype)
        if heads > 1:
            self.scratch = dict(
                shared, k_tiles=_tile((2, BLOCK_TOKENS, columns), tile_dtype, tiled=True),
                v_tiles=_tile((2, BLOCK_TOKENS, columns), tile_dtype, tiled=True),
                loaded=plgpu.Barrier(num_arrivals=2, num_barriers=2),
                fixed_loaded=plgpu.Barrier(num_arrivals=1 + k_norm))
            self.kernel = functools.partial(
                _heads_looped_kernel, head_dim=dim, rotary_dim=rotary_dim, tokens_per_block=tokens_per_block,
                heads=heads, kv_dtype=dtype, interpret=interpret)
        else:
            v_tiles = ([_tile((BLOCK_TOKENS, columns), tile_dtype, tiled=True)] if tiled else
                       [_tile((BLOCK_TOKENS, columns // 2), tile_dtype, tiled=False)] * 2)
            self.scratch = dict(
                shared, k_tile=_tile((BLOCK_TOKENS, columns), tile_dtype, tiled=tiled), v_tiles=v_tiles,
                loaded=plgpu.Barrier(num_arrivals=1 + len(v_tiles) + k_norm),
                positions_loaded=plgpu.Barrier(num_arrivals=1))
            self.kernel = functools.partial(
                _one_head_kernel, head_dim=dim, rotary_dim=rotary_dim,
                tokens_per_block=tokens_per_block, tiled=tiled, kv_dtype=dtype, interpret=interpret)
        self.inputs = inputs
        self.grid = (pl.cdiv(total_ctx, BLOCK_TOKENS), n_layers, config.num_kv_heads // heads)
        self.output = jax.ShapeDtypeStruct((*config.output_shape(n_layers, total_ctx)[:-1], columns), tile_dtype)
        self.interpret = _interpret_params() if interpret else None

    def body(self, *refs, **scratch) -> None:
        """The kernel's body: its refs are the inputs, then ``k_out`` and ``v_out``."""
        count = len(self.inputs)
        self.kernel(_Refs(**dict(zip(self.inputs, refs[:count])), k_out=refs[count], v_out=refs[count + 1]),
                    **scratch)

    def fresh(self, *operands) -> tuple:
        """``(k_out, v_out)`` as new arrays; ``jax.vmap`` batches it (over a grid axis)."""
        return tuple(plgpu.kernel(
            self.body, out_type=[self.output] * 2, scratch_types=self.scratch, grid=self.grid,
            grid_names=GRID_NAMES, compiler_params=plgpu.CompilerParams(), interpret=self.interpret,
            kernel_name=KERNEL_NAME,
        )(*operands))

    def written_into(self, operands: tuple, k_out, v_out) -> tuple:
        """``(k_out, v_out)``, a given one written through a ref the kernel aliases, a
        missing one fresh. ``jax.vmap`` does not batch it: Pallas batches a Mosaic GPU
        kernel with refs among its operands only over a batch of one."""
        given = [out is not None for out in (k_out, v_out)]
        refs = [None if out is None else jax.new_ref(out, memory_space=plgpu.GMEM) for out in (k_out, v_out)]
        fresh = iter(pl.kernel(
            functools.partial(self._into_refs, given),
            out_type=tuple(self.output for ref in refs if ref is None),
            mesh=plgpu.Mesh(grid=self.grid, grid_names=GRID_NAMES, kernel_name=KERNEL_NAME),
            compiler_params=plgpu.CompilerParams(), interpret=self.interpret or False,
        )(*operands, *(ref for ref in refs if ref is not None)))
        return tuple(next(fresh) if ref is None else jax.freeze(ref) for ref in refs)

    def _into_refs(self, given: list, *refs) -> None:
        """The body of :meth:`written_into`'s kernel: its refs are the inputs, the given
        outputs, then the fresh ones; the block's scratch is scoped inside."""
        count = len(self.inputs)
        inputs, given_refs = refs[:count], iter(refs[count:count + sum(given)])
        fresh_refs = iter(refs[count + sum(given):])
        outputs = [next(given_refs) if is_given else next(fresh_refs) for is_given in given]
        pl.run_scoped(functools.partial(self.body, *inputs, *outputs), **self.scratch)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
