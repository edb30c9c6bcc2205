"""The Triton kernel of fused K/V materialization: every draft layer in one launch.

For token t, layer l and KV head h, with all arithmetic in fp32 and one rounding at the end::

    k      = kv[t, l, h*D:(h+1)*D]
    kn     = k * rsqrt(mean(k*k) + eps[l]) * k_norm_weight[l]
    k_out[l, t, h] = rope(kn, cos_sin_cache[positions[t]])     (first rotary_dim dims; the rest as kn)
    v_out[l, t, h] = kv[t, l, kv_size + h*D : kv_size + (h+1)*D]   (bit-exact)

The kernel reads ``kv`` once and writes each output once; the cos/sin rows and weights
it also reads are served from L2. It is bandwidth-bound, so each program moves a 3-D
tile of ``BLOCK_T`` tokens by ``BLOCK_HEADS`` heads by ``head_dim`` with 16-byte
vector accesses, and the launcher sizes the tiles from ``total_ctx``. The grid is one
axis of (token block, layer, head group) with the head group varying fastest: adjacent
programs then read adjacent bytes of ``kv``, and one axis has room for the
billions of programs a long context with small tiles needs (the other axes stop at 65535).

On Hopper and later the kernel is launched with programmatic dependent launch: it may
start while the kernel ahead of it in the stream finishes, and waits for that kernel's
memory before its first load (:func:`supports_dependent_launch`).

The same kernel writes into a paged KV cache (``fused_kv_norm_rope_into_cache``): rows
are then ``cache_loc[t]`` instead of ``t`` and an fp8 cache is quantized on the way.

This module launches the kernel on validated arguments (:func:`launch`); the public
functions, their validation and the registered torch ops are in :mod:`fusedkv_torch.ops`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from fusedkv_torch.launcher import DirectLauncher
from interop.core.reference import FP8_E4M3_MAX, FP8_SCALE_MAX, FP8_SCALE_MIN, SMALLEST_NORMAL_FP32
from interop.core.spec import FusedKVConfig, size_argument, tile_argument
from interop.core.tiles import interpreted_block_tokens, next_power_of_2

_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_SMALLEST_NORMAL = tl.constexpr(SMALLEST_NORMAL_FP32)
_FP8_SCALE_MIN = tl.constexpr(FP8_SCALE_MIN)
_FP8_SCALE_MAX = tl.constexpr(FP8_SCALE_MAX)


@triton.jit
def _load_rotary_halves(base_ptrs, stride, mask, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                        PAIR_BLOCK: tl.constexpr, PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr):
    """The two members of every pair of the first ``PAIRED_DIM`` dims as fp32
    ``[TOKENS, HEADS, PAIR_BLOCK]`` tiles: adjacent dims (``GPTJ``) or the two halves.

    ``base_ptrs`` and ``mask`` are ``[TOKENS, HEADS, 1]``: where each row's dims start.
    """
    if GPTJ:
        # Pairs are adjacent: one contiguous load, then a register split of [.., pairs, 2].
        dims = tl.arange(0, 2 * PAIR_BLOCK)[None, None, :]
        both = tl.load(base_ptrs + dims * stride, mask=mask & (dims < PAIRED_DIM), other=0.0)
        first, second = tl.split(tl.reshape(both.to(tl.float32), [TOKENS, HEADS, PAIR_BLOCK, 2]))
    else:
        pairs = tl.arange(0, PAIR_BLOCK)[None, None, :]
        mask = mask & (pairs < PAIRED_DIM // 2)
        first = tl.load(base_ptrs + pairs * stride, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(base_ptrs + (pairs + PAIRED_DIM // 2) * stride, mask=mask, other=0.0).to(tl.float32)
    return first, second


@triton.jit
def _store_rotary_halves(base_ptrs, stride, first, second, mask, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                         PAIR_BLOCK: tl.constexpr, PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr):
    if GPTJ:
        dims = tl.arange(0, 2 * PAIR_BLOCK)[None, None, :]
        both = tl.reshape(tl.join(first, second), [TOKENS, HEADS, 2 * PAIR_BLOCK])
        tl.store(base_ptrs + dims * stride, both, mask=mask & (dims < PAIRED_DIM))
    else:
        pairs = tl.arange(0, PAIR_BLOCK)[None, None, :]
        mask = mask & (pairs < PAIRED_DIM // 2)
        tl.store(base_ptrs + pairs * stride, first, mask=mask)
        tl.store(base_ptrs + (pairs + PAIRED_DIM // 2) * stride, second, mask=mask)


@triton.jit
def _to_destination(values, scale_ptr, scale, inverse_scale, dtype: tl.constexpr):
    """fp32 values in the destination dtype; an fp8 cache (given ``scale_ptr``) holds ``values / scale`` saturated,
    or NaN where the scale is outside ``[FP8_SCALE_MIN, FP8_SCALE_MAX]`` (interop.core.reference).

    The quotient is the correctly rounded ``values / scale`` of the reference, without a
    division per element (an IEEE division is a dozen instructions and a branch, enough
    to make the fp8 path compute-bound): ``q = values * (1/scale)`` is within an ulp, and
    one Newton step from the exact residual ``values - q*scale`` (an fma) rounds to the
    correctly rounded quotient when ``1/scale`` is itself correctly rounded and normal
    (Markstein's theorem), which the scale's range ensures. Where the step gives NaN (an
    infinite quotient) the plain product is kept, so it saturates as the reference.
    """
    if scale_ptr is not None:
        quotient = values * inverse_scale
        refined = tl.fma(tl.fma(-quotient, scale, values), inverse_scale, quotient)
        values = tl.where(refined != refined, quotient, refined)
        # Comparisons rather than min/max, which would turn the NaN of a bad position into 448.
        values = tl.where(values > _FP8_MAX, _FP8_MAX, tl.where(values < -_FP8_MAX, -_FP8_MAX, values))
        values = tl.where((scale >= _FP8_SCALE_MIN) & (scale <= _FP8_SCALE_MAX), values, float("nan"))
    return values.to(dtype)


@triton.jit
def _tile_of_program(total_ctx, N_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_HEADS: tl.constexpr):
    """``(layer, tokens, heads)`` of this program: one axis of (token block, layer, head
    group), head group fastest, so adjacent programs read adjacent bytes of ``kv``.

    int64 from the start: offsets into kv or a cache pass 2**31 elements in long contexts.
    """
    pid = tl.program_id(0).to(tl.int64)
    head_groups: tl.constexpr = NUM_HEADS // BLOCK_HEADS
    layer = (pid // head_groups) % N_LAYERS
    tokens = (pid // (head_groups * N_LAYERS)) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = ((pid % head_groups) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS))[None, :, None]
    return layer, tokens, heads


@triton.jit
def _destination_rows(tokens, in_context, slots_ptr, slots_stride, num_slots):
    """``(rows, written)``: row ``t`` for token ``t``, or its cache slot, skipped outside the cache."""
    # One return per helper: the compiler checks every return's type, even in a branch
    # it never generates.
    rows, written = tokens, in_context
    if slots_ptr is not None:
        rows = tl.load(slots_ptr + tokens * slots_stride, mask=in_context, other=-1).to(tl.int64)
        written = in_context & (rows >= 0) & (rows < num_slots)
    return rows, written


@triton.jit
def _load_head_rows(row_ptrs, stride, mask, TOKENS: tl.constexpr, HEADS: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                    TAIL_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PAIRED_DIM: tl.constexpr,
                    GPTJ: tl.constexpr):
    """fp32 ``(first, second, tail)`` of head rows: the two members of every pair of the
    first ``PAIRED_DIM`` dims (:func:`_paired_dims`) and the dims past them (0.0 where there are none)."""
    first, second = _load_rotary_halves(row_ptrs, stride, mask, TOKENS, HEADS, PAIR_BLOCK, PAIRED_DIM, GPTJ)
    tail = 0.0
    if TAIL_BLOCK > 0:
        tail_dims = PAIRED_DIM + tl.arange(0, TAIL_BLOCK)[None, None, :]
        tail = tl.load(row_ptrs + tail_dims * stride, mask=mask & (tail_dims < HEAD_DIM), other=0.0).to(tl.float32)
    return first, second, tail


@triton.jit
def _load_rotation_and_norm(cos_sin_table, positions, rotated, tokens, heads, cos_sin_stride_p, cos_sin_stride_d,
                            weight_ptr, layer, weight_stride_l, weight_stride_d, eps_ptr, eps_stride,
                            TOKENS: tl.constexpr, HEADS: tl.constexpr, PAIR_BLOCK: tl.constexpr,
                            TAIL_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                            PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr, WEIGHT_ROW: tl.constexpr):
    """``(cos, sin, w_first, w_second, w_tail, eps)``: the cos/sin rows of the tokens' positions
    in ``cos_sin_table`` (zeros for a token not ``rotated``, whose row is never read) at K's
    ``[tokens, heads, dims]`` shape, and the layer's K-norm (:func:`_load_norm`) at that shape
    too, or as one ``[1, 1, dims]`` row (``WEIGHT_ROW``, :func:`loads_one_weight_row`)."""
    every_head = heads * 0
    cos_sin_rows = (cos_sin_table + positions * cos_sin_stride_p)[:, None, None] + every_head
    cos, sin = _load_rotary_halves(cos_sin_rows, cos_sin_stride_d, rotated[:, None, None] & (every_head == 0),
                                   TOKENS, HEADS, PAIR_BLOCK, ROTARY_DIM, False)
    if WEIGHT_ROW:
        w_first, w_second, w_tail, eps = _load_norm(weight_ptr, layer, weight_stride_l, weight_stride_d,
                                                    tl.zeros([1, 1, 1], tl.int64), eps_ptr, eps_stride,
                                                    1, 1, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    else:
        w_first, w_second, w_tail, eps = _load_norm(weight_ptr, layer, weight_stride_l, weight_stride_d,
                                                    tokens[:, None, None] * 0 + every_head, eps_ptr, eps_stride,
                                                    TOKENS, HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    return cos, sin, w_first, w_second, w_tail, eps


@triton.jit
def _load_norm(weight_ptr, layer, weight_stride_l, weight_stride_d, every_row, eps_ptr, eps_stride,
               TOKENS: tl.constexpr, HEADS: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr):
    """The layer's K-norm weight as :func:`_load_head_rows` pieces, and its eps; ones and
    zero for a draft without a K-norm (``weight_ptr`` None).

    The weight rows come at ``every_row``'s shape (zeros): K's [tokens, heads, dims], each
    thread its own copy (L1 serves the repeats), so they arrive in K's register layout; or
    one [1, 1, dims] row, shuffled through shared memory to meet K (:func:`loads_one_weight_row`).
    """
    first, second, tail, eps = 1.0, 1.0, 1.0, 0.0
    if weight_ptr is not None:
        rows = weight_ptr + layer * weight_stride_l + every_row
        first, second, tail = _load_head_rows(rows, weight_stride_d, every_row == 0, TOKENS, HEADS, PAIR_BLOCK,
                                              TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
        eps = tl.load(eps_ptr + layer * eps_stride)
    return first, second, tail, eps


@triton.jit
def _inverse_rms(first, second, tail, eps, rotatable, weight_ptr, HEAD_DIM: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    """``rsqrt(mean(k*k) + eps)`` per head row, with the edge values of interop.core.reference:
    zeros where there is no scale to normalize by (rsqrt flushes denormals, hence a
    threshold), NaN where the sum of squares is not finite or the token has no rotation.
    Without a K-norm (``weight_ptr`` None): 1, or NaN where the token has no rotation."""
    inv_rms = tl.where(rotatable, 1.0, float("nan"))[:, None, None]
    if weight_ptr is not None:
        sum_squares = tl.sum(first * first, 2) + tl.sum(second * second, 2)
        if TAIL_BLOCK > 0:
            sum_squares += tl.sum(tail * tail, 2)
        # A product with the constant 1/HEAD_DIM, exact for powers of two and otherwise within
        # an fp32 ulp of the mean: a division would add a slow-path branch for nothing.
        mean_square_eps = sum_squares * (1.0 / HEAD_DIM) + eps
        normalizing = tl.where(mean_square_eps < _SMALLEST_NORMAL, 0.0, tl.math.rsqrt(mean_square_eps))
        inv_rms = tl.where(rotatable[:, None] & (sum_squares < float("inf")), normalizing,
                           float("nan"))[:, :, None]
    return inv_rms


@triton.jit
def _layer_table(cos_sin_ptr, table_ptr, layer, table_stride, cos_sin_stride_table, n_tables, rotatable):
    """The layer's cos/sin table, and which tokens have a row in it: the one table where
    ``table_ptr`` is None, else table ``layer_rope_table[layer]``, and none where that index
    is outside ``[0, n_tables)`` (its K is then NaN, and nothing of it is read)."""
    table_base, rotatable_in_table = cos_sin_ptr, rotatable
    if table_ptr is not None:
        table = tl.load(table_ptr + layer * table_stride)
        named = (table >= 0) & (table < n_tables)
        table_base = cos_sin_ptr + tl.where(named, table, 0).to(tl.int64) * cos_sin_stride_table
        # A select, not &: Triton's interpreter makes an int tensor of a bool one & a loaded bool scalar.
        rotatable_in_table = tl.where(named, rotatable, False)
    return table_base, rotatable_in_table


@triton.jit
def _rotate(first, second, cos, sin, PAIR_BLOCK: tl.constexpr, ROTARY_DIM: tl.constexpr, PAIRED_DIM: tl.constexpr):
    """RoPE of every pair ``(first, second)`` of the first ``ROTARY_DIM`` dims; where the pairs
    run past them (``PAIRED_DIM``), those pairs as they are: a select, since their cos and sin
    load as 0."""
    rotated_first, rotated_second = first * cos - second * sin, second * cos + first * sin
    if PAIRED_DIM > ROTARY_DIM:
        rotated = tl.arange(0, PAIR_BLOCK)[None, None, :] < ROTARY_DIM // 2
        rotated_first = tl.where(rotated, rotated_first, first)
        rotated_second = tl.where(rotated, rotated_second, second)
    return rotated_first, rotated_second


@triton.jit
def _layer_scale(scale_ptr, layer, stride):
    """``(scale, 1/scale)`` of the layer's fp8 cache; ones for a cache that is not fp8."""
    scale, inverse = 1.0, 1.0
    if scale_ptr is not None:
        scale = tl.load(scale_ptr + layer * stride)
        inverse = tl.div_rn(1.0, scale)
    return scale, inverse


@triton.jit
def _layer_multiplier(multiplier_ptr, layer, stride):
    """The layer's V multiplier; 1 where V is copied (``multiplier_ptr`` None)."""
    multiplier = 1.0
    if multiplier_ptr is not None:
        multiplier = tl.load(multiplier_ptr + layer * stride)
    return multiplier


@triton.jit
def _v_to_destination(v, multiplier_ptr, multiplier, scale_ptr, scale, inverse_scale, dtype: tl.constexpr):
    """V as its destination holds it: as loaded (bit for bit, NaN payloads included), or
    ``v * multiplier`` in fp32 and then :func:`_to_destination`."""
    if multiplier_ptr is not None:
        v = _to_destination(v.to(tl.float32) * multiplier, scale_ptr, scale, inverse_scale, dtype)
    elif scale_ptr is not None:
        v = _to_destination(v.to(tl.float32), scale_ptr, scale, inverse_scale, dtype)
    return v


@triton.jit
def _store_head_rows(row_ptrs, stride, first, second, tail, mask, scale_ptr, scale, inverse_scale,
                     TOKENS: tl.constexpr, HEADS: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr):
    """:func:`_load_head_rows`'s pieces, each in the destination's dtype (:func:`_to_destination`)."""
    dtype = row_ptrs.dtype.element_ty
    _store_rotary_halves(row_ptrs, stride, _to_destination(first, scale_ptr, scale, inverse_scale, dtype),
                         _to_destination(second, scale_ptr, scale, inverse_scale, dtype), mask,
                         TOKENS, HEADS, PAIR_BLOCK, PAIRED_DIM, GPTJ)
    if TAIL_BLOCK > 0:
        tail_dims = PAIRED_DIM + tl.arange(0, TAIL_BLOCK)[None, None, :]
        tl.store(row_ptrs + tail_dims * stride, _to_destination(tail, scale_ptr, scale, inverse_scale, dtype),
                 mask=mask & (tail_dims < HEAD_DIM))


@triton.jit(do_not_specialize=["total_ctx", "max_position", "num_slots", "n_tables"])
def _fused_kv_norm_rope_kernel(
    # Tensors (None where a call has none), then sizes, then strides, then constexprs:
    # the order DirectLauncher expects.
    kv_ptr, k_norm_weight_ptr, eps_ptr, cos_sin_ptr, positions_ptr, slots_ptr,
    k_dest_ptr, v_dest_ptr, k_scale_ptr, v_scale_ptr, v_multiplier_ptr, layer_rope_table_ptr,
    total_ctx, max_position, num_slots, n_tables,
    kv_stride_t, kv_stride_l, kv_stride_d,
    weight_stride_l, weight_stride_d, eps_stride, cos_sin_stride_table, cos_sin_stride_p, cos_sin_stride_d,
    positions_stride, slots_stride, k_scale_stride, v_scale_stride, v_multiplier_stride, layer_rope_table_stride,
    k_stride_l, k_stride_row, k_stride_h, k_stride_d,
    v_stride_l, v_stride_row, v_stride_h, v_stride_d,
    N_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    GPTJ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    PAIRED_DIM: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr,
    WEIGHT_ROW: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """One ``[BLOCK_T tokens, BLOCK_HEADS heads, head_dim]`` tile of one layer's K and V.

    What a call leaves out is None and carried by the helpers: ``slots_ptr`` (rows are
    the tokens), ``k_norm_weight_ptr`` and ``eps_ptr`` (no K-norm), the scales (no fp8
    cache), ``v_multiplier_ptr`` (V copied), ``layer_rope_table_ptr`` (one cos/sin table for
    every layer). Every load is issued before any store
    (destinations might alias inputs as far as the compiler knows, so it would not move
    a load past a store), and none waits on another but the cos/sin rows on their positions
    (and the layer's table index).
    """
    if DEPENDENT_LAUNCH:
        # Let the kernel behind start launching now; read nothing until the one ahead (which
        # may have written any input) has finished and flushed.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    layer, tokens, heads = _tile_of_program(total_ctx, N_LAYERS, NUM_HEADS, BLOCK_T, BLOCK_HEADS)
    in_context = tokens < total_ctx
    loaded = in_context[:, None, None]
    positions = tl.load(positions_ptr + tokens * positions_stride, mask=in_context, other=0).to(tl.int64)
    cos_sin_table, rotatable = _layer_table(cos_sin_ptr, layer_rope_table_ptr, layer, layer_rope_table_stride,
                                            cos_sin_stride_table, n_tables,
                                            (positions >= 0) & (positions < max_position))
    rows, written = _destination_rows(tokens, in_context, slots_ptr, slots_stride, num_slots)
    rows, written = rows[:, None, None], written[:, None, None]

    kv_rows = kv_ptr + tokens[:, None, None] * kv_stride_t + layer * kv_stride_l
    head_stride = HEAD_DIM * kv_stride_d
    k_first, k_second, k_tail = _load_head_rows(kv_rows + heads * head_stride, kv_stride_d, loaded, BLOCK_T,
                                                BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    head_dims = tl.arange(0, HEAD_BLOCK)[None, None, :]
    v = tl.load(kv_rows + (NUM_HEADS + heads) * head_stride + head_dims * kv_stride_d,
                mask=loaded & (head_dims < HEAD_DIM))

    cos, sin, w_first, w_second, w_tail, eps = _load_rotation_and_norm(
        cos_sin_table, positions, in_context & rotatable, tokens, heads, cos_sin_stride_p, cos_sin_stride_d,
        k_norm_weight_ptr, layer, weight_stride_l, weight_stride_d, eps_ptr, eps_stride,
        BLOCK_T, BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, ROTARY_DIM, PAIRED_DIM, GPTJ, WEIGHT_ROW)
    # Each cache has its own scale: an fp8 K cache may sit beside a bf16 V cache.
    k_scale, k_inverse_scale = _layer_scale(k_scale_ptr, layer, k_scale_stride)
    v_scale, v_inverse_scale = _layer_scale(v_scale_ptr, layer, v_scale_stride)
    v_multiplier = _layer_multiplier(v_multiplier_ptr, layer, v_multiplier_stride)

    # V first: its writes start while K still waits for the cos/sin rows.
    v_dest = v_dest_ptr + layer * v_stride_l + rows * v_stride_row + heads * v_stride_h
    v = _v_to_destination(v, v_multiplier_ptr, v_multiplier, v_scale_ptr, v_scale, v_inverse_scale,
                          v_dest_ptr.dtype.element_ty)
    tl.store(v_dest + head_dims * v_stride_d, v, mask=written & (head_dims < HEAD_DIM))

    inv_rms = _inverse_rms(k_first, k_second, k_tail, eps, rotatable, k_norm_weight_ptr, HEAD_DIM, TAIL_BLOCK)
    k_first, k_second = _rotate(k_first * inv_rms * w_first, k_second * inv_rms * w_second, cos, sin, PAIR_BLOCK,
                                ROTARY_DIM, PAIRED_DIM)
    k_dest = k_dest_ptr + layer * k_stride_l + rows * k_stride_row + heads * k_stride_h
    _store_head_rows(k_dest, k_stride_d, k_first, k_second, k_tail * inv_rms * w_tail, written, k_scale_ptr, k_scale,
                     k_inverse_scale, BLOCK_T, BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)


def default_tile(total_ctx: int, num_kv_heads: int, head_dim: int, *, n_layers: int = 1, itemsize: int = 4,
                 multiprocessors: Optional[int] = None, interpret: bool = False) -> tuple[int, int, int]:
    """``(block_tokens, block_heads, num_warps)`` for a call of this size.

    Three regimes, each the fastest tile of its sizes under graph replay beside a copy
    of the same bytes: short contexts take many one-warp programs of one head and two
    tokens (one for a call of one token, whose second row would only be masked), whose
    loads all start at once; otherwise, and for long contexts, tiles of
    about 8 head rows: one token of 8 heads, two of 4, and so on (16 elements of K and 16
    of V per thread), twice that where a row of K is 128 bytes or less (head_dim 64 of a
    16-bit ``kv``, ``itemsize`` its bytes an element), whose 8 rows keep too few bytes
    in flight, unless that leaves a multiprocessor fewer than 8 programs, where programs
    in flight matter more; around 256 tokens, four times the tokens of those tiles (four
    tokens of 8 heads, eight of 4). With the call's programs counted over all
    ``n_layers`` (``multiprocessors``: the current GPU's where None): outside short
    contexts a tile takes fewer tokens (halved in turn) while they would not give every
    multiprocessor two, since with one a multiprocessor waits on each program's loads with
    nothing else in flight, and a tile of more than two head rows that would then not give
    every multiprocessor four gives up half its rows (tokens first) and keeps its warps (a
    warp per 256 elements of K), so that twice the threads ask for the call's loads at once;
    in short contexts a tile takes more heads (doubled in turn, at
    most 8, a warp per 1024 elements of K) while they would give some multiprocessor more
    than 16, since past that handing out the small programs costs more than their loads.

    ``interpret`` (``TRITON_INTERPRET=1``): few, large programs instead, of as many
    tokens as fit ``interop.core.tiles.INTERPRETED_TILE_ELEMENTS``.
    """
    if interpret:
        block_heads = num_kv_heads & -num_kv_heads  # the largest power of two dividing the heads
        return interpreted_block_tokens(total_ctx, block_heads, head_dim), block_heads, 1
    multiprocessors = _multiprocessors() if multiprocessors is None else multiprocessors
    max_heads = min(8, num_kv_heads & -num_kv_heads)  # the largest power of two dividing the heads

    def programs(block_tokens, block_heads):
        return -(-total_ctx // block_tokens) * n_layers * (num_kv_heads // block_heads)

    if total_ctx < _SHORT_CONTEXT_END:
        block_tokens, block_heads = 1 if total_ctx == 1 else 2, 1
        while block_heads < max_heads and programs(block_tokens, block_heads) \
                > _MAX_SHORT_PROGRAMS_PER_MULTIPROCESSOR * multiprocessors:
            block_heads *= 2
        return block_tokens, block_heads, tile_warps(block_tokens * block_heads, head_dim, 1024)
    block_heads = max_heads
    four_token_tiles = _FOUR_TOKEN_TILES[0] <= total_ctx < _FOUR_TOKEN_TILES[1]
    tokens_per_row = 4 if four_token_tiles else 1
    block_tokens = max(1, _TILE_ROWS // block_heads) * tokens_per_row
    doubled = max(1, 2 * _TILE_ROWS // block_heads) * tokens_per_row
    if head_dim * itemsize <= _SHORT_ROW_BYTES and programs(doubled, block_heads) \
            >= _MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_DOUBLED_ROWS * multiprocessors:
        block_tokens = doubled
    while block_tokens > 1 and programs(block_tokens, block_heads) < _MIN_PROGRAMS_PER_MULTIPROCESSOR * multiprocessors:
        block_tokens //= 2
    num_warps = tile_warps(block_tokens * block_heads, head_dim, 512)
    if block_tokens * block_heads > 2 and programs(block_tokens, block_heads) \
            < _MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_HALVED_ROWS * multiprocessors:
        block_tokens, block_heads = (block_tokens // 2, block_heads) if block_tokens > 1 else (1, block_heads // 2)
    return block_tokens, block_heads, num_warps


def tile_warps(rows: int, head_dim: int, elements_per_warp: int) -> int:
    """Warps for a tile of ``rows`` head rows: one per ``elements_per_warp`` elements of K (rows padded to a
    power of two), 1 to 8."""
    return max(1, min(8, rows * next_power_of_2(head_dim) // elements_per_warp))


@functools.lru_cache(maxsize=None)
def _multiprocessors() -> int:
    """The current GPU's multiprocessors (132 on an H200; 1 without a GPU, where no tile runs compiled)."""
    return torch.cuda.get_device_properties().multi_processor_count if torch.cuda.is_available() else 1


# Token counts where the tile regimes of default_tile change, each where the next
# regime's tile starts to win in the draft shape.
_SHORT_CONTEXT_END = 128
_FOUR_TOKEN_TILES = (256, 384)
# Outside short contexts a tile takes fewer tokens until every multiprocessor has this many programs;
# in short contexts it takes more heads until none has more than the second.
_MIN_PROGRAMS_PER_MULTIPROCESSOR = 2
_MAX_SHORT_PROGRAMS_PER_MULTIPROCESSOR = 16
# Outside short contexts a tile of more than two head rows that would not give every multiprocessor this many
# programs gives up half its rows and keeps its warps.
_MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_HALVED_ROWS = 4
# Head rows a tile takes outside short contexts; twice as many where a row of K is this many bytes or
# fewer and the call still gives every multiprocessor the third number's programs.
_TILE_ROWS = 8
_SHORT_ROW_BYTES = 128
_MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_DOUBLED_ROWS = 8
# A gptj row with a tail is loaded as pairs throughout (piece_blocks) where every multiprocessor has this many
# programs.
_MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_WHOLE_ROWS = 8


@functools.lru_cache(maxsize=4096)
def _plan(config: FusedKVConfig, total_ctx: int, n_layers: int, itemsize: int, block_tokens: Optional[int],
          block_heads: Optional[int], num_warps: Optional[int], dependent_launch: bool) -> tuple[int, tuple, int, bool]:
    """``(grid, constexpr values in kernel order, num_warps, dependent_launch)`` of a launch."""
    default_block, default_heads, default_warps = default_tile(
        total_ctx, config.num_kv_heads, config.head_dim, n_layers=n_layers, itemsize=itemsize,
        interpret=_launcher.interpreted)
    block_tokens = block_tokens or default_block
    block_heads = block_heads or default_heads
    if config.num_kv_heads % block_heads or block_heads & (block_heads - 1):
        raise ValueError(f"Invalid block_heads for fused KV materialization: got "
                         f"{block_heads}, expected a power of two that divides {config.num_kv_heads}.")
    grid = -(-total_ctx // block_tokens) * n_layers * (config.num_kv_heads // block_heads)
    # A gptj row is loaded as pairs throughout only where a multiprocessor has many programs:
    # with few, each one's load latency decides, and the one wide load did not shorten it.
    whole_rows = grid >= _MIN_PROGRAMS_PER_MULTIPROCESSOR_OF_WHOLE_ROWS * _multiprocessors()
    num_warps = num_warps or default_warps
    constexprs = (
        n_layers, config.num_kv_heads, config.head_dim, config.rotary_dim, config.rope_style == "gptj",
        block_tokens, block_heads, *piece_blocks(config, whole_rows),
        loads_one_weight_row(config, block_heads, num_warps), dependent_launch,
    )
    return grid, constexprs, num_warps, dependent_launch


def _paired_dims(config: FusedKVConfig, whole_rows: bool) -> int:
    """The dims of a head row loaded as pairs: the rotary dims, or, given ``whole_rows``,
    every dim of a gptj row that has a partner (the pairs past the rotary dims left as they
    are) where that row's block has fewer elements than a block of the rotary dims and one
    of the tail: K is then one load, as V, instead of two that leave more lanes idle."""
    head_dim, rotary_dim = config.head_dim, config.rotary_dim
    fewer_lanes = next_power_of_2(head_dim) < next_power_of_2(rotary_dim) + next_power_of_2(head_dim - rotary_dim)
    if whole_rows and config.rope_style == "gptj" and rotary_dim < head_dim and fewer_lanes:
        return head_dim & ~1
    return rotary_dim


def piece_blocks(config: FusedKVConfig, whole_rows: bool = False) -> tuple[int, int, int, int]:
    """``(PAIRED_DIM, PAIR_BLOCK, TAIL_BLOCK, HEAD_BLOCK)`` of a head row: the dims loaded as
    pairs (:func:`_paired_dims`), the pairs' block, the block of the dims past them (0 where
    there are none) and the whole row's."""
    paired = _paired_dims(config, whole_rows)
    tail = config.head_dim - paired
    return paired, next_power_of_2(paired // 2), next_power_of_2(tail) if tail else 0, \
        next_power_of_2(config.head_dim)


def loads_one_weight_row(config: FusedKVConfig, block_heads: int, num_warps: int) -> bool:
    """Whether the forward loads the K-norm weight as one row broadcast over a tile of
    ``block_heads`` heads and ``num_warps`` warps (moved into K's register layout through
    shared memory) rather than at K's shape: where head_dim is not a power of two, the
    rotary is partial, the tile holds more than one head and is not a ``neox`` tile of one
    warp. Such rows leave lanes of their blocks masked, and a masked load of the weight
    for every element of K cost more than the row's move; with one head a tile, a full
    rotary, or ``neox`` halves in one warp (short contexts), the move cost more, as it did
    wherever every lane holds an element. Measured, not derived: BENCHMARKS.md."""
    not_a_power_of_two = config.head_dim & (config.head_dim - 1) != 0
    neox_in_one_warp = config.rope_style == "neox" and num_warps == 1
    return (not_a_power_of_two and config.rotary_dim < config.head_dim and block_heads > 1
            and not neox_in_one_warp)


def tuned_plan(config: FusedKVConfig, total_ctx: int, n_layers: int, itemsize: int, tile: tuple,
               dependent_launch: bool) -> tuple:
    """The launch plan of a ``kv`` of ``itemsize`` bytes an element, with ``tile =
    (block_tokens, block_heads, num_warps)`` overriding :func:`default_tile` where not
    None, each checked (``ValueError``/``TypeError``)."""
    block_tokens, block_heads, num_warps = tile
    # Before the plan's cache, which would take 2.0 for 2.
    block_tokens = None if block_tokens is None else tile_argument("block_tokens", block_tokens)
    block_heads = None if block_heads is None else size_argument("block_heads", block_heads)
    num_warps = None if num_warps is None else tile_argument("num_warps", num_warps)
    return _plan(config, total_ctx, n_layers, itemsize, block_tokens, block_heads, num_warps, dependent_launch)


_launcher = DirectLauncher(_fused_kv_norm_rope_kernel)


@functools.lru_cache(maxsize=None)
def supports_dependent_launch(device: torch.device) -> bool:
    """Whether launches on ``device`` use programmatic dependent launch (PDL): compiled
    kernels on sm_90 (Hopper) and later.

    With PDL the kernel may be launched while the kernel ahead of it in the stream is
    still running; it then waits for that kernel's completion before reading anything,
    so its results are as without PDL. What it saves is the launch latency between two
    such kernels, a large part of a call at decode sizes (BENCHMARKS.md).
    """
    return (device.type == "cuda" and not _launcher.interpreted
            and torch.cuda.get_device_capability(device)[0] >= 9)


def _strides(tensor, ndim: int) -> tuple:
    """A tensor's strides, or ones for one a call leaves out: Triton specializes an integer
    argument of 1 into a constant, so a left-out tensor adds no kernel parameter."""
    return (1,) * ndim if tensor is None else tensor.stride()


def launch_arguments(kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, cache_loc, k_scale,
                     v_scale, v_multiplier, layer_rope_table) -> tuple[tuple, tuple, tuple]:
    """The kernel's runtime arguments, ``(tensors, plain_ints, ints)`` in its parameter order
    (:class:`DirectLauncher`'s): what a launch reads of its tensors beyond the plan."""
    # One table is table 0 of one: its table stride is never used, and 1 is specialized away (_strides).
    table_strides = cos_sin_cache.stride() if layer_rope_table is not None else (1, *cos_sin_cache.stride())
    return (
        (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_dest, v_dest, k_scale, v_scale, v_multiplier,
         layer_rope_table),
        (kv.shape[0], cos_sin_cache.shape[-2], k_dest.shape[1],
         1 if layer_rope_table is None else cos_sin_cache.shape[0]),
        (*kv.stride(), *_strides(k_norm_weight, 2), *_strides(eps, 1), *table_strides, *positions.stride(),
         *_strides(cache_loc, 1), *_strides(k_scale, 1), *_strides(v_scale, 1), *_strides(v_multiplier, 1),
         *_strides(layer_rope_table, 1), *k_dest.stride(), *v_dest.stride()),
    )


def _launch(plan, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, cache_loc, k_scale,
            v_scale, v_multiplier, layer_rope_table=None, compiled=None):
    """Launch ``plan``; the compiled kernel's :class:`~fusedkv_torch.launcher.Launch` where it
    was launched directly, else None (:meth:`DirectLauncher.__call__`)."""
    grid, constexprs, num_warps, dependent_launch = plan
    tensors, plain_ints, ints = launch_arguments(kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest,
                                                 cache_loc, k_scale, v_scale, v_multiplier, layer_rope_table)
    return _launcher(grid, tensors, plain_ints, ints, constexprs, num_warps=num_warps, launch_pdl=dependent_launch,
                     compiled=compiled)


def launch(
    kv: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_dest: torch.Tensor,
    v_dest: torch.Tensor,
    *,
    config: FusedKVConfig,
    cache_loc: Optional[torch.Tensor] = None,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    v_multiplier: Optional[torch.Tensor] = None,
    block_tokens: Optional[int] = None,
    block_heads: Optional[int] = None,
    num_warps: Optional[int] = None,
    dependent_launch: Optional[bool] = None,
    layer_rope_table: Optional[torch.Tensor] = None,
) -> None:
    """Launch the kernel on validated arguments already on ``kv``'s device; no sync.

    ``k_dest``/``v_dest`` are ``[n_layers, rows, num_kv_heads, head_dim]``: the outputs
    (row t for token t) or, with ``cache_loc``, the caches (row ``cache_loc[t]``).
    ``block_tokens``, ``block_heads`` (a power of two dividing the heads) and
    ``num_warps`` (powers of two) override :func:`default_tile` (benchmark
    sweeps); they are the only arguments checked here. ``dependent_launch`` overrides
    :func:`supports_dependent_launch`.
    """
    total_ctx, n_layers, _ = kv.shape
    if dependent_launch is None:
        dependent_launch = supports_dependent_launch(kv.device)
    plan = tuned_plan(config, total_ctx, n_layers, kv.element_size(), (block_tokens, block_heads, num_warps),
                      dependent_launch)
    _launch(plan, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, cache_loc, k_scale, v_scale,
            v_multiplier, layer_rope_table)
