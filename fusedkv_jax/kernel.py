"""Fused K/V materialization for all draft layers: one Pallas GPU kernel, two entry points.

Per token ``t``, layer ``l``, head ``h`` (CONTRACT.md, Math), in fp32 with one rounding:
``kn = k * rsqrt(mean(k*k) + eps[l]) * k_norm_weight[l]``, RoPE on the first
``rotary_dim`` dims of ``kn`` by the cos/sin row of ``positions[t]`` (``neox``:
halves, ``gptj``: interleaved pairs), the remaining dims of ``kn`` unrotated, and V
copied bit for bit. :func:`fused_kv_norm_rope` writes ``[n_layers, total_ctx, heads,
head_dim]`` outputs; :func:`fused_kv_norm_rope_into_cache` writes the same values into
slot ``cache_loc[t]`` of paged caches (quantizing to float8_e4m3fn where the cache is).

Lowerings (``lowering=``, None for :func:`default_lowering`): the Pallas **Triton**
lowering (``jax.experimental.pallas.triton``, chosen by passing its ``CompilerParams``)
serves every configuration by default, on the GPU and in interpret mode. It offers
what this kernel uses per token: gathers (the cos/sin row of a data-dependent
position, the RoPE partner of each element) and masked loads and stores (``head_dim``
96 or 192 in power-of-two tiles, the ragged last token block, padding slots of a
cache). It is deprecated since jax 0.11.0 (a ``DeprecationWarning`` once per
lowering) but present and working in every supported jax; what is
Triton-specific here is :func:`_load`, :func:`_store` and :func:`_launch`'s
``compiler_params``.

``lowering="mosaic_gpu"`` runs :mod:`fusedkv_jax.mosaic_kernel` (Mosaic GPU has no
gather on Hopper: TMA copies with scalar starts fetch one cos/sin row per token). It
takes ``neox`` with rotary halves and tail in multiples of 8 columns, and ``total_ctx``
at most 8 or a multiple of 8 (a multiple of 64 in interpret mode); other calls with it
are refused. It is not the default because it is slower: it passes the reference
checks on the GPU, but timed in jit as a jit user runs it (``fusedkv bench``'s
``pallas-mosaic`` row, which checks that the compiled jit launches it once per call)
it loses to the Triton lowering at every size (BENCHMARKS.md). Its outputs are also fresh arrays,
never a caller's ``k_out``/``v_out`` written in place (jax 0.11.2 lowers Mosaic GPU
only through ``plgpu.kernel``, which has no aliasing). The paged-cache entry point
stays on Triton: its slots scatter rows to data-dependent places, which a Mosaic GPU
kernel would do with one copy per token, slower than the plain op it already loses to.

Tiling: one program per (block of ``block_tokens`` tokens, layer, block of
``block_heads`` heads) works on a ``[block_tokens, block_heads, head_dim]`` tile,
column runs padded to powers of two and masked. At long contexts
(:func:`loops_over_layers`) a program takes every layer of its tokens instead: it loads
their cos/sin rows once for all layers, and issues the next layer's loads before it
stores a layer. With every head in the block (the default), a program reads contiguous
K and V rows of ``kv`` and, without a cache, writes one contiguous chunk of each output;
the cos/sin rows are loaded once per token and shared by all heads. ``neox`` K that is
rotated whole is loaded as its two rotary halves, so each element meets its RoPE
partner in registers. ``gptj``'s interleaved pairs are no run of columns, and ``neox``
halves beside an unrotated tail are runs too narrow for wide loads: such K rows are
loaded whole and again at permuted columns (an L1-resident second load) for the
partners (:func:`loads_k_rows`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fusedkv_jax.partitioning import partitioned
from fusedkv_jax.indices import narrow_for_jax
from interop.core.reference import FP8_E4M3_MAX, FP8_SCALE_MAX, FP8_SCALE_MIN, SMALLEST_NORMAL_FP32
from interop.core.spec import (
    AcceptedCall,
    CallShape,
    FusedKVConfig,
    accept_cache_call,
    accept_call,
    check_arrays,
    check_output_buffers,
    check_positions_in_range,
    tile_argument,
)
from interop.core.tiles import interpreted_block_tokens

from fusedkv_jax import mosaic_kernel

# A tile of about this many K elements per program keeps K, V, cos and sin in registers
# without spills: one token of all heads, the fastest tile of the draft shape.
_TILE_ELEMENTS = 1024
# Threads per program: each holds this many elements of the narrowest run of columns a
# tile loads (a rotary half, or a whole row where loads_k_rows): twice as many (draft,
# hd256) or half (rotary64) run slower (BENCHMARKS.md; looping: _LAYER_LOOP_WIDE_HALF).
_RUN_ELEMENTS_PER_THREAD = {"neox": 4, "gptj": 16}
# Below this many programs per multiprocessor a short context leaves the GPU idle, so
# smaller token blocks are taken instead.
_MIN_PROGRAMS_PER_MULTIPROCESSOR = 2
# Up to this many programs per multiprocessor all start at once (one wave): the call then
# takes about one program's latency, which fewer threads with twice the loads each in
# flight shorten.
_ONE_WAVE_PROGRAMS_PER_MULTIPROCESSOR = 16
# A program that takes every layer (loops_over_layers) holds about this many K elements a
# layer: one token of all heads, at least as fast as two in every shape measured.
_LAYER_LOOP_TILE_ELEMENTS = 512
# A program that takes every layer gives each thread twice the elements of a rotary half at
# least this wide: such halves run faster on half the warps, narrower halves and whole
# rows slower (BENCHMARKS.md).
_LAYER_LOOP_WIDE_HALF = 128
# Layers whose loads a looping program has issued before it stores one: more in flight
# cost registers and lose.
LAYERS_IN_FLIGHT = 2


def _load(ref, *, mask, other, eviction_policy=None):
    return plgpu.load(ref, mask=mask, other=other, eviction_policy=eviction_policy)


def _store(ref, value, *, mask):
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def _inverse_rms(sum_squares, eps, head_dim: int, position_ok):
    """``rsqrt(mean(k*k) + eps)`` per head row, with the edge values of interop.core.reference.

    Zeros where there is no scale to normalize by (rsqrt flushes denormals, hence a
    threshold), NaN where the sum of squares is not finite (NaN or Inf in K, k*k
    overflowed) or the token has no rotation: a NaN poisons the whole row, the unrotated
    tail included. Without a K-norm (``eps`` None): 1, or NaN where the token has no
    rotation (the unused sum of squares is dropped by the compiler).
    """
    if eps is None:
        return jnp.where(position_ok[:, None, None], 1.0, jnp.nan)
    mean_square_eps = sum_squares / head_dim + eps
    inv_rms = jnp.where(mean_square_eps < SMALLEST_NORMAL_FP32, 0.0, jax.lax.rsqrt(mean_square_eps))
    return jnp.where(position_ok[:, None, None] & (sum_squares < jnp.inf), inv_rms, jnp.nan)


def _divide(values, scale, *, interpret: bool):
    """The correctly rounded fp32 ``values / scale``, which neither lowering's ``/`` is:
    Triton's is approximate on the GPU, and XLA turns a division by a broadcast scalar into
    a product with its reciprocal (an opaque broadcast keeps it a division)."""
    divisor = jnp.broadcast_to(scale, values.shape)
    if interpret:
        return values / jax.lax.optimization_barrier(divisor)
    [quotient] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[values, divisor], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(values.shape, jnp.float32)])
    return quotient


def _quantize(values, scale, *, interpret: bool):
    """fp32 values as an fp8 cache holds them (interop.core.reference): ``values / scale``
    saturated to +-448, NaN kept, and NaN for a scale outside its range."""
    values = _divide(values, scale, interpret=interpret)
    # Comparisons, not jnp.clip: the Triton lowering's min/max (minnumf/maxnumf) would turn
    # the NaN of a poisoned row into 448.
    values = jnp.where(values > FP8_E4M3_MAX, FP8_E4M3_MAX,
                       jnp.where(values < -FP8_E4M3_MAX, -FP8_E4M3_MAX, values))
    return jnp.where((scale >= FP8_SCALE_MIN) & (scale <= FP8_SCALE_MAX), values, jnp.nan)


def _halves_frequencies(rotary_dim: int):
    """The cos/sin columns :func:`_neox_halves_k` rotates by: one per pair, ``[half]``, and
    which of them are pairs (the run is padded to a power of two)."""
    half = rotary_dim // 2
    pairs = jnp.arange(pl.next_power_of_2(half))
    return pairs, pairs < half


def _neox_halves_k(load_k, load_weight, *, head_dim: int, rotary_dim: int):
    """Issues the loads of ``neox`` K as the two rotary halves and the unrotated tail, each a
    contiguous run of columns; returns ``finish(cos, sin, eps, position_ok)``, which gives
    K as ``(columns, values, columns_ok)`` pieces.

    Loaded as separate runs, every element of a tile is read once with wide loads and
    meets its RoPE partner in registers: faster than the whole row plus a second, permuted
    load of it when the rotation covers the row.
    """
    half, tail = rotary_dim // 2, head_dim - rotary_dim
    pairs, pairs_ok = _halves_frequencies(rotary_dim)
    pieces = [(pairs, pairs_ok), (half + pairs, pairs_ok)]
    if tail:
        tail_columns = rotary_dim + jnp.arange(pl.next_power_of_2(tail))
        pieces.append((tail_columns, tail_columns < head_dim))
    parts = [load_k(columns, ok) for columns, ok in pieces]
    weights = [load_weight(columns, ok) for columns, ok in pieces]

    def finish(cos, sin, eps, position_ok):
        inv_rms = _inverse_rms(sum(jnp.sum(part * part, axis=-1, keepdims=True) for part in parts),
                               eps, head_dim, position_ok)
        first, second, *rest = [part * inv_rms * weight for part, weight in zip(parts, weights)]
        # The unrotated tail is kn itself: through a rotation by (cos 1, sin 0) an infinite kn
        # would meet Inf * 0 and turn into NaN.
        values = [first * cos - second * sin, second * cos + first * sin, *rest]
        return [(columns, value, ok) for (columns, ok), value in zip(pieces, values)]
    return finish


def _row_frequencies(head_dim: int, rotary_dim: int, rope_style: str):
    """The cos/sin column of every column of a K row (:func:`_row_k`), masked past the rotation."""
    dims = jnp.arange(pl.next_power_of_2(head_dim))
    rotated = dims < rotary_dim
    pair = dims // 2 if rope_style == "gptj" else dims % (rotary_dim // 2)
    return jnp.where(rotated, pair, 0), rotated


def _row_k(load_k, load_weight, *, head_dim: int, rotary_dim: int, rope_style: str):
    """Issues the loads of K as whole rows; returns ``finish(cos, sin, eps, position_ok)``,
    which gives K as one ``(columns, values, columns_ok)`` piece.

    Each element's RoPE partner (``gptj``: its pair's other member; ``neox``: the same
    column of the other rotary half) comes from a second, L1-resident load of the row at
    permuted columns.
    """
    dims = jnp.arange(pl.next_power_of_2(head_dim))
    dim_ok = dims < head_dim
    rotated = dims < rotary_dim
    if rope_style == "gptj":
        first = dims % 2 == 0
        partner = jnp.where(first, dims + 1, dims - 1)
    else:
        first = dims < rotary_dim // 2
        partner = jnp.where(first, dims + rotary_dim // 2, dims - rotary_dim // 2)
    partner = jnp.where(rotated, partner, dims)
    sign = jnp.where(rotated, jnp.where(first, -1.0, 1.0), 0.0).astype(jnp.float32)
    k, k_partner = load_k(dims, dim_ok), load_k(partner, dim_ok)
    weight, weight_partner = load_weight(dims, dim_ok), load_weight(partner, dim_ok)

    def finish(cos, sin, eps, position_ok):
        inv_rms = _inverse_rms(jnp.sum(k * k, axis=-1, keepdims=True), eps, head_dim, position_ok)
        k_normed = k * inv_rms * weight
        k_rotated = k_normed * cos + (k_partner * inv_rms * weight_partner) * (sin * sign)
        # The unrotated tail is kn itself (see _neox_halves_k).
        return [(dims, jnp.where(rotated, k_rotated, k_normed), dim_ok)]
    return finish


def _fused_kv_norm_rope_kernel(
    kv_ref, cos_sin_ref, positions_ref, *refs,
    num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str, k_rows: bool,
    block_tokens: int, block_layers: int, block_heads: int, normed: bool, slotted: bool, k_quantized: bool,
    v_quantized: bool, v_multiplied: bool, interpret: bool,
):
    """One ``[block_tokens, block_heads, head_dim]`` tile of K and V for each of
    ``block_layers`` layers, which share the tile's cos/sin rows.

    Refs are whole arrays: ``kv[total_ctx, n_layers, 2*kv_size]``, ``cos_sin[max_pos,
    rotary_dim]``, ``positions[total_ctx]``; then, as the static switches say,
    ``weight[n_layers, head_dim]`` and ``eps[n_layers]`` (a K-norm), ``slots[total_ctx]``,
    ``k_scale[n_layers]``, ``v_scale[n_layers]``, ``v_multiplier[n_layers]``, the aliased destinations (unread),
    and the outputs ``k_out, v_out[n_layers, rows, num_kv_heads, head_dim]``. ``k_rows``
    loads K as whole rows (:func:`_row_k`), else as ``neox`` runs (:func:`_neox_halves_k`).
    """
    optional = iter(refs)
    weight_ref, eps_ref = (next(optional), next(optional)) if normed else (None, None)
    slots_ref = next(optional) if slotted else None
    k_scale_ref = next(optional) if k_quantized else None
    v_scale_ref = next(optional) if v_quantized else None
    v_multiplier_ref = next(optional) if v_multiplied else None
    k_out_ref, v_out_ref = refs[-2:]
    total_ctx, max_position = kv_ref.shape[0], cos_sin_ref.shape[0]
    num_rows = k_out_ref.shape[1]
    kv_size = num_kv_heads * head_dim

    first_layer = pl.program_id(1) * block_layers
    tokens = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    heads = pl.program_id(2) * block_heads + jnp.arange(block_heads)
    token_ok = tokens < total_ctx
    rows_ok = token_ok[:, None, None] & (heads < num_kv_heads)[None, :, None]
    token_index = tokens[:, None, None]
    head_base = heads[None, :, None] * head_dim

    def load_kv(layer, columns, columns_ok):
        return _load(kv_ref.at[token_index, layer, head_base + columns[None, None, :]],
                     mask=rows_ok & columns_ok[None, None, :], other=0.0)

    # Every load that does not wait for another is issued first: the cos/sin rows wait
    # for the positions, and at short contexts that chain is most of the kernel's time.
    positions = _load(positions_ref.at[tokens], mask=token_ok, other=0)
    if slotted:
        rows = _load(slots_ref.at[tokens], mask=token_ok, other=-1)
        row_ok = token_ok & (rows >= 0) & (rows < num_rows)
    else:
        rows, row_ok = tokens, token_ok
    v_columns = jnp.arange(pl.next_power_of_2(head_dim))
    v_columns_ok = v_columns < head_dim
    k_of_layer = (functools.partial(_row_k, rope_style=rope_style) if k_rows else _neox_halves_k)

    def load_weight(layer, columns, ok):
        if weight_ref is None:  # no K-norm: K is rotated as projected
            return 1.0
        return _load(weight_ref.at[layer, columns], mask=ok, other=0.0).astype(jnp.float32)

    def load_layer(layer):
        """Issues one layer's loads; returns ``(layer, v, eps, finish_k)``."""
        v = load_kv(layer, kv_size + v_columns, v_columns_ok)
        eps = None if eps_ref is None else _load(eps_ref.at[layer], mask=None, other=None)
        finish_k = k_of_layer(
            lambda columns, ok: load_kv(layer, columns, ok).astype(jnp.float32),
            functools.partial(load_weight, layer), head_dim=head_dim, rotary_dim=rotary_dim)
        return layer, v, eps, finish_k

    in_flight = [load_layer(first_layer + i) for i in range(min(LAYERS_IN_FLIGHT, block_layers))]
    position_ok = (positions >= 0) & (positions < max_position)
    # An out-of-range position is never read: its row is masked and becomes NaN.
    rotation_ok = (token_ok & position_ok)[:, None]
    frequencies, frequencies_ok = (_row_frequencies(head_dim, rotary_dim, rope_style) if k_rows
                                   else _halves_frequencies(rotary_dim))
    position_index, frequency_index = positions[:, None], frequencies[None, :]
    cos_sin_ok = rotation_ok & frequencies_ok[None, :]
    # cos/sin rows kept in L2 (evict_last): every program rereads the small table while kv
    # and the outputs pass through once, and a program's first stores wait on this chain.
    cos = _load(cos_sin_ref.at[position_index, frequency_index], mask=cos_sin_ok, other=1.0,
                eviction_policy="evict_last")[:, None, :]
    sin = _load(cos_sin_ref.at[position_index, rotary_dim // 2 + frequency_index], mask=cos_sin_ok, other=0.0,
                eviction_policy="evict_last")[:, None, :]

    # Skipped rows point one past the end: masked on the GPU, and dropped (not written
    # back with a stale value) by interpret mode's scatter.
    row_index = jnp.where(row_ok, rows, num_rows)[:, None, None]
    store_ok = rows_ok & row_ok[:, None, None]
    for layer_in_block in range(block_layers):
        layer, v, eps, finish_k = in_flight.pop(0)
        # Later layers' loads go before this layer's stores, which the compiler may not
        # move them past (it cannot tell kv from the outputs).
        if layer_in_block + LAYERS_IN_FLIGHT < block_layers:
            in_flight.append(load_layer(first_layer + layer_in_block + LAYERS_IN_FLIGHT))
        pieces = [(k_out_ref, k_scale_ref, piece) for piece in finish_k(cos, sin, eps, position_ok)]
        if v_multiplier_ref is not None:
            v = v.astype(jnp.float32) * _load(v_multiplier_ref.at[layer], mask=None, other=None)
        pieces.append((v_out_ref, v_scale_ref, (v_columns, v, v_columns_ok)))
        for out_ref, scale_ref, (columns, value, columns_ok) in pieces:
            if scale_ref is not None:
                scale = _load(scale_ref.at[layer], mask=None, other=None)
                value = _quantize(value.astype(jnp.float32), scale, interpret=interpret)
            _store(out_ref.at[layer, row_index, heads[None, :, None], columns[None, None, :]],
                   value, mask=store_ok & columns_ok[None, None, :])


def loads_k_rows(config: FusedKVConfig) -> bool:
    """Whether the kernel loads K as whole rows (:func:`_row_k`): always for ``gptj``, and
    for ``neox`` with an unrotated tail, whose rotary halves are runs too narrow for wide
    loads (three narrow runs lose to one row and an L1-resident second load, in either
    grid). Else K is loaded as its ``neox`` runs (:func:`_neox_halves_k`)."""
    return config.rope_style == "gptj" or config.rotary_dim < config.head_dim


def loops_over_layers(total_ctx: int, n_layers: int, num_kv_heads: int, head_dim: int, *,
                      interpret: bool = False) -> bool:
    """Whether each program takes every layer of its tokens (loading their cos/sin rows
    once, the next layer's K and V in flight while a layer is stored): when, so looped,
    the call still has a wave of programs for every multiprocessor. With fewer it is
    latency that counts, and one layer a program has more programs in flight: the loop
    loses at short contexts and wins at long ones."""
    if interpret or n_layers == 1:
        return False
    tile = pl.next_power_of_2(num_kv_heads) * pl.next_power_of_2(head_dim)
    block_tokens = max(1, _LAYER_LOOP_TILE_ELEMENTS // tile)
    return pl.cdiv(total_ctx, block_tokens) >= _ONE_WAVE_PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors()


def default_tile(total_ctx: int, n_layers: int, num_kv_heads: int, head_dim: int, *,
                 rotary_dim: int | None = None, rope_style: str = "neox",
                 block_tokens: int | None = None, block_heads: int | None = None,
                 num_warps: int | None = None, interpret: bool = False) -> tuple[int, int, int]:
    """``(block_tokens, block_heads, num_warps)`` for a call of this size: the overrides
    given, the rest chosen (``interpret``: few, large programs). ``n_layers`` counts in
    the number of programs, which sets how many tokens a tile takes (:func:`loops_over_layers`
    says whether a program takes one layer or all); ``rotary_dim`` (``head_dim`` when
    None) and ``rope_style`` set the width of the loads, which sets the threads."""
    block_tokens, block_heads, num_warps = (
        None if value is None else tile_argument(name, value)
        for name, value in (("block_tokens", block_tokens), ("block_heads", block_heads),
                            ("num_warps", num_warps)))
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    block_dim = pl.next_power_of_2(head_dim)
    if block_heads is None:
        block_heads = pl.next_power_of_2(num_kv_heads)
    layer_loop = loops_over_layers(total_ctx, n_layers, num_kv_heads, head_dim, interpret=interpret)
    layer_blocks = 1 if layer_loop else n_layers

    def programs(block_tokens):
        return pl.cdiv(total_ctx, block_tokens) * layer_blocks * pl.cdiv(num_kv_heads, block_heads)

    if block_tokens is None and interpret:
        block_tokens = interpreted_block_tokens(total_ctx, block_heads, head_dim)
    enough_programs = 1 if interpret else _MIN_PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors()
    if block_tokens is None:
        tile_elements = _LAYER_LOOP_TILE_ELEMENTS if layer_loop else _TILE_ELEMENTS
        block_tokens = max(1, tile_elements // (block_heads * block_dim))
        while block_tokens > 1 and programs(block_tokens) < enough_programs:
            block_tokens //= 2
    if num_warps is None:
        k_rows = loads_k_rows(FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style))
        run = pl.next_power_of_2(head_dim if k_rows else rotary_dim // 2)
        run_elements_per_thread = _RUN_ELEMENTS_PER_THREAD[rope_style]
        if layer_loop and not k_rows and run >= _LAYER_LOOP_WIDE_HALF:
            run_elements_per_thread *= 2
        if programs(block_tokens) < enough_programs:
            # Too few programs to fill the GPU: spread each over more threads so more
            # loads are in flight at once.
            run_elements_per_thread = max(1, run_elements_per_thread // 2)
        elif not interpret and programs(block_tokens) <= _ONE_WAVE_PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors():
            run_elements_per_thread *= 2
        num_warps = min(8, max(1, block_tokens * block_heads * run // (32 * run_elements_per_thread)))
    return block_tokens, block_heads, num_warps


@functools.cache
def _multiprocessors() -> int:
    """The multiprocessors of jax's first GPU, 1 without a GPU."""
    try:
        return max(1, int(getattr(jax.devices("gpu")[0], "core_count", 1)))
    except RuntimeError:  # no GPU backend
        return 1


@functools.partial(jax.jit, static_argnames=(
    "config", "block_tokens", "block_heads", "num_warps", "layer_loop", "k_rows", "interpret"))
def _launch(kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
            k_scale, v_scale, v_multiplier, *, config: FusedKVConfig, block_tokens, block_heads, num_warps,
            layer_loop, k_rows, interpret):
    """:func:`_pallas_launch`, run by each device on its tokens and layers under a sharded jit.

    On one device, and inside ``jax.shard_map``, it is :func:`_pallas_launch` itself
    (:mod:`fusedkv_jax.partitioning` says how, and why kv's columns are never split).
    """
    return partitioned(
        _pallas_launch, (kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
                         k_scale, v_scale, v_multiplier),
        config=config, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
        layer_loop=layer_loop, k_rows=k_rows, interpret=interpret)


def _varying_axes(arrays) -> jax.sharding.ManualAxisType:
    """The manual mesh axes the outputs vary over inside ``jax.shard_map``: those of any input.

    Outside ``shard_map`` every input varies over none, and so do the outputs.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return jax.sharding.ManualAxisType(varying=varying)


def _pallas_launch(kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
                   k_scale, v_scale, v_multiplier, *, config: FusedKVConfig, block_tokens, block_heads,
                   num_warps, layer_loop, k_rows, interpret):
    """The one ``pallas_call``: writes ``[n_layers, rows, heads, head_dim]`` K and V.

    ``slots`` None: row ``t`` is token ``t`` and ``rows == total_ctx``; else token ``t``
    goes to row ``slots[t]`` of ``k_dest``/``v_dest`` (rows outside ``[0, rows)`` are
    skipped). A destination given is aliased to its output, so a donated buffer is
    written in place; one not given is a fresh array. ``layer_loop``: each program takes
    every layer of its tokens (this device's layers, under a sharded jit), else one.
    """
    total_ctx, n_layers, _ = kv.shape
    block_layers = n_layers if layer_loop else 1
    shape = config.output_shape(n_layers, total_ctx)
    destinations = (k_dest, v_dest)
    inputs = [kv, cos_sin_cache, positions]
    inputs += [a for a in (k_norm_weight, eps, slots, k_scale, v_scale, v_multiplier) if a is not None]
    # Inside jax.shard_map (check_vma, its default) each output must say which mesh axes
    # it varies over; jax 0.10-0.11 spell that ShapeDtypeStruct(manual_axis_type=...).
    varying = _varying_axes(inputs + [d for d in destinations if d is not None])
    out_shape = [jax.ShapeDtypeStruct(shape if d is None else d.shape,
                                      kv.dtype if d is None else d.dtype,
                                      manual_axis_type=varying)
                 for d in destinations]
    aliases = {}
    for output_index, destination in enumerate(destinations):
        if destination is not None:
            aliases[len(inputs)] = output_index
            inputs.append(destination)
    kernel = functools.partial(
        _fused_kv_norm_rope_kernel,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, k_rows=k_rows,
        block_tokens=block_tokens, block_layers=block_layers, block_heads=block_heads,
        normed=k_norm_weight is not None, slotted=slots is not None, k_quantized=k_scale is not None,
        v_quantized=v_scale is not None, v_multiplied=v_multiplier is not None, interpret=interpret,
    )
    grid = (pl.cdiv(total_ctx, block_tokens), n_layers // block_layers, pl.cdiv(config.num_kv_heads, block_heads))
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="fused_kv_norm_rope",
    )(*inputs)


def on_cpu(kv) -> bool:
    """Whether ``kv`` lives on the CPU; NumPy input and jit tracers have no device of their
    own, so the default backend decides."""
    try:
        return all(device.platform == "cpu" for device in kv.devices())
    except (AttributeError, jax.errors.ConcretizationTypeError):
        return jax.default_backend() == "cpu"


def _on_default_device(array):
    """A host (NumPy) array where jax computes on it, so that ``kv`` and the buffers it
    writes are checked on the device the kernel runs on rather than the host. One jax
    would hold in another dtype (float64 and int64 with x64 off) stays as given, so that
    validation refuses the dtype the caller passed instead of computing in another."""
    if isinstance(array, np.ndarray) and jax.dtypes.canonicalize_dtype(array.dtype) == array.dtype:
        return jnp.asarray(array)
    return array


def fused_kv_norm_rope(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    v_multiplier=None,
    k_out=None,
    v_out=None,
    check_positions: bool = False,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
    interpret: bool | None = None,
    lowering: str | None = None,
):
    """RMSNorm + RoPE on K, V passed through, for all layers in one kernel.

    ``kn = k * rsqrt(mean(k*k) + eps[l]) * k_norm_weight[l]``; ``neox``:
    ``k_out[i] = kn[i]*c[i] - kn[i+R/2]*s[i]``, ``k_out[i+R/2] = kn[i+R/2]*c[i] + kn[i]*s[i]``
    for ``i < R/2`` (``gptj``: the same on pairs ``(2i, 2i+1)``), ``k_out[j] = kn[j]`` for
    ``j >= R``, with ``c, s`` the cos/sin halves of ``cos_sin_cache[positions[t]]``;
    ``v_out = v``. fp32 math, one rounding to ``kv``'s dtype; V bit-exact. A position
    outside ``[0, max_pos)`` gives an all-NaN K row and is never read.

    All arrays are jax or NumPy arrays (other frameworks' arrays:
    ``interop.fused_kv_norm_rope``).

    Args:
      kv: bf16/fp16/fp32[total_ctx, n_layers, 2*kv_size], per token and layer all K
        heads then all V heads; ``kv_size = num_kv_heads * head_dim``. jax arrays are
        dense: under ``jax.jit`` a slice of a larger GEMM output is materialized by XLA
        before the kernel reads it.
      k_norm_weight: float[n_layers, head_dim], or None for a draft without a K-norm (K is
        then RoPE of the projected K, rounded once).
      eps: fp32[n_layers]; None exactly when ``k_norm_weight`` is.
      cos_sin_cache: fp32[max_pos, rotary_dim], row p = cos values then sin values.
      positions: int32/int64[total_ctx]. With x64 off jax holds int64 as int32: a host
        (NumPy) int64 array is narrowed here with out-of-range values kept out of range;
        a jax array is already int32. A position outside ``[0, max_pos)`` gives an
        all-NaN K row, unless ``check_positions`` raises for it.
      num_kv_heads, head_dim, rotary_dim, rope_style: static configuration (ints, a str).
      v_multiplier: optional fp32[n_layers]: V is ``v * v_multiplier[l]`` in fp32, rounded
        once (a model's per-layer value scale); None copies V bit for bit.
      k_out, v_out: optional dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim];
        aliased to the outputs, so under ``jax.jit`` with these buffers donated the
        results are written in place (without donation XLA copies them first). One
        array given as both is refused, as are NumPy outputs the other backends would
        refuse (read-only, zero strides, memory shared with each other or ``kv``).
      check_positions: raise ``ValueError`` for out-of-range positions, before anything is
        launched; this waits for the positions' values on the host, so it is off by
        default and refused under ``jax.jit`` and other transformations, where the values
        do not exist yet.
      block_tokens, block_heads, num_warps: tile overrides (powers of two) for tuning
        the Triton lowering; :func:`default_tile` otherwise.
      interpret: run in Pallas interpret mode; None means "when ``kv`` is on the CPU".
      lowering: ``"triton"``, ``"mosaic_gpu"``, or None for the default of the
        configuration (:func:`default_lowering`).

    Returns:
      ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim].

    Usable inside ``jax.jit`` (the configuration is static) and under ``jax.vmap``.
    """
    outputs, given_kv = (("k_out", k_out), ("v_out", v_out)), kv
    check_arrays((("kv", kv), ("k_norm_weight", k_norm_weight), ("eps", eps),
                  ("cos_sin_cache", cos_sin_cache), ("positions", positions), ("v_multiplier", v_multiplier),
                  *outputs), "jax")
    kv, k_out, v_out = (_on_default_device(a) for a in (kv, k_out, v_out))
    accepted = accept_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        v_multiplier=v_multiplier,
    )
    # On the caller's own arrays: a NumPy array's memory is not seen once moved to jax.
    check_output_buffers(given_kv, outputs)
    if check_positions and accepted.shape.total_ctx:
        check_positions_in_range(*_position_range(positions), accepted.shape.max_position)
    return fused_kv_norm_rope_accepted(
        accepted, kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier=v_multiplier, k_out=k_out,
        v_out=v_out,
        block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps, interpret=interpret,
        lowering=lowering)


def _position_range(positions) -> tuple[int, int]:
    """The least and the greatest position, on the host (a wait for a jax array's values)."""
    try:
        return int(positions.min()), int(positions.max())
    except jax.errors.ConcretizationTypeError:
        raise ValueError(
            "Invalid check_positions for fused KV materialization: got True on traced positions "
            "(inside jax.jit or another transformation), expected False there (the values are not "
            "known until the call runs; out-of-range positions give all-NaN K rows)."
        ) from None


def fused_kv_norm_rope_accepted(accepted: AcceptedCall, kv, k_norm_weight, eps, cos_sin_cache, positions, *,
                                v_multiplier=None, k_out=None, v_out=None, block_tokens=None, block_heads=None,
                                num_warps=None, interpret=None, lowering=None):
    """:func:`fused_kv_norm_rope` on jax arrays (and NumPy ones but ``kv``) that were
    validated as ``accepted`` (``interop.core.spec.accept_call``, then ``check_output_buffers``):
    those checks are not run again. ``interop``'s and :func:`fused_kv_norm_rope`'s own path;
    the public function checks everything."""
    call = accepted.shape
    options = _launch_options(call, kv, block_tokens, block_heads, num_warps, interpret)
    lowering = _lowering(lowering, call, kv.dtype, options["interpret"],
                         tuned=(block_tokens, block_heads, num_warps) != (None, None, None),
                         plain=k_norm_weight is not None and v_multiplier is None)
    if call.total_ctx == 0 or call.n_layers == 0:
        empty = jnp.empty(call.output_shape, kv.dtype)
        return (empty if k_out is None else k_out), (empty if v_out is None else v_out)
    positions = narrow_for_jax(positions)
    if lowering == "mosaic_gpu":
        return mosaic_kernel.launch(kv, k_norm_weight, eps, cos_sin_cache, positions,
                                    config=call.config, interpret=options["interpret"])
    return _launch(kv, k_norm_weight, eps, cos_sin_cache, positions, None, k_out, v_out, None, None, v_multiplier,
                   **options)


def _launch_options(call: CallShape, kv, block_tokens, block_heads, num_warps, interpret) -> dict:
    """:func:`_launch`'s static arguments for an accepted call: its configuration, tile
    (:func:`default_tile`, with the overrides given), form and interpret mode (None: where
    ``kv`` lives)."""
    config = call.config
    interpret = on_cpu(kv) if interpret is None else interpret
    block_tokens, block_heads, num_warps = default_tile(
        call.total_ctx, call.n_layers, config.num_kv_heads, config.head_dim, rotary_dim=config.rotary_dim,
        rope_style=config.rope_style, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
        interpret=interpret)
    return dict(config=config, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
                layer_loop=loops_over_layers(call.total_ctx, call.n_layers, config.num_kv_heads, config.head_dim,
                                             interpret=interpret),
                k_rows=loads_k_rows(config), interpret=interpret)


LOWERINGS = ("triton", "mosaic_gpu")


def default_lowering(config: FusedKVConfig, kv_dtype, *, interpret: bool = False) -> str:
    """The lowering :func:`fused_kv_norm_rope` takes for ``config`` when none is named.

    The Triton lowering, for every configuration: the faster in jit wherever Mosaic GPU
    takes the configuration at all (module docstring, "Lowerings").
    """
    del config, kv_dtype, interpret  # one answer today; the signature is the question
    return "triton"


def _lowering(lowering, call, kv_dtype, interpret: bool, *, tuned: bool, plain: bool) -> str:
    """The lowering named (checked against what it can run), or the default. ``plain``: the
    call has a K-norm and no V multiplier, the only form the Mosaic GPU kernel has."""
    if lowering is None:
        return default_lowering(call.config, kv_dtype, interpret=interpret)
    if lowering not in LOWERINGS:
        raise ValueError(f"Invalid lowering for fused KV materialization: got {lowering!r}, "
                         f"expected one of {LOWERINGS} or None.")
    if lowering == "mosaic_gpu":
        config = call.config
        if not mosaic_kernel.supports(config, kv_dtype):
            raise ValueError(
                "Invalid lowering for fused KV materialization: got 'mosaic_gpu' for "
                f"rope_style={config.rope_style!r}, head_dim={config.head_dim}, "
                f"rotary_dim={config.rotary_dim}, dtype={jnp.dtype(kv_dtype).name}, expected "
                "'triton' (Mosaic GPU takes bf16/fp16 neox with rotary halves and tail in "
                "multiples of 8 columns and 32 bytes, head_dim <= 256).")
        if not plain:
            raise ValueError("Invalid lowering for fused KV materialization: got 'mosaic_gpu' for a call "
                             "without a K-norm or with a v_multiplier, expected 'triton' (the Mosaic GPU "
                             "kernel normalizes K and copies V).")
        if tuned:
            raise ValueError("Invalid tile override for fused KV materialization: got "
                             "block_tokens/block_heads/num_warps with lowering='mosaic_gpu', "
                             "expected them only with the Triton lowering.")
        if not mosaic_kernel.supports_context(call.total_ctx, interpret=interpret):
            expected = (f"a multiple of {mosaic_kernel.BLOCK_TOKENS} in interpret mode"
                        if interpret else "at most 8 or a multiple of 8")
            raise ValueError("Invalid total_ctx for fused KV materialization with "
                             f"lowering='mosaic_gpu': got {call.total_ctx}, expected {expected}.")
    return lowering


def fused_kv_norm_rope_into_cache(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    cache_loc,
    k_cache,
    v_cache,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    k_scale=None,
    v_scale=None,
    v_multiplier=None,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
    interpret: bool | None = None,
):
    """:func:`fused_kv_norm_rope` written straight into slot ``cache_loc[t]`` of paged caches.

    ``k_cache[l, cache_loc[t]] = k_out[l, t]``, ``v_cache[l, cache_loc[t]] = v_out[l, t]``
    for every token whose slot is in ``[0, num_slots)``; other slots (negative ones
    are padding) are skipped and every other cache entry keeps its value. A
    float8_e4m3fn cache holds ``value / scale[l]`` saturated to +-448, rounded once
    from fp32. Slots in range must be distinct (which token wins a shared slot is
    unspecified).

    Args (beyond :func:`fused_kv_norm_rope`'s):
      cache_loc: int32/int64[total_ctx] (int64 as for ``positions``).
      k_cache, v_cache: dtype-of-kv or float8_e4m3fn[n_layers, num_slots, num_kv_heads,
        head_dim]; aliased to the outputs, so under ``jax.jit`` with the caches donated
        they are updated in place.
      k_scale, v_scale: fp32[n_layers], for (and only for) a float8_e4m3fn cache.
      v_multiplier: as for :func:`fused_kv_norm_rope`; an fp8 V cache holds
        ``(v * v_multiplier[l]) / v_scale[l]``.

    Returns:
      ``(k_cache, v_cache)`` updated.
    """
    caches, given_kv = (("k_cache", k_cache), ("v_cache", v_cache)), kv
    check_arrays((("kv", kv), ("k_norm_weight", k_norm_weight), ("eps", eps),
                  ("cos_sin_cache", cos_sin_cache), ("positions", positions), ("cache_loc", cache_loc),
                  *caches, ("k_scale", k_scale), ("v_scale", v_scale), ("v_multiplier", v_multiplier)), "jax")
    kv, k_cache, v_cache = (_on_default_device(a) for a in (kv, k_cache, v_cache))
    call = accept_cache_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale, v_scale,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        v_multiplier=v_multiplier,
    ).shape
    check_output_buffers(given_kv, caches)
    options = _launch_options(call, kv, block_tokens, block_heads, num_warps, interpret)
    if call.total_ctx == 0 or call.n_layers == 0 or k_cache.shape[1] == 0:  # nothing to write
        return k_cache, v_cache
    positions = narrow_for_jax(positions)
    cache_loc = narrow_for_jax(cache_loc)
    return _launch(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                   k_scale, v_scale, v_multiplier, **options)
