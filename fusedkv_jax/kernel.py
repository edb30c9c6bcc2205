"""The Pallas kernel of fused K/V materialization on its Triton lowering: every draft layer in one call.

Per token ``t``, layer ``l``, head ``h`` (CONTRACT.md, Math), in fp32 with one rounding:
``kn = k * rsqrt(mean(k*k) + eps[l]) * k_norm_weight[l]``, RoPE on the first
``rotary_dim`` dims of ``kn`` by the cos/sin row of ``positions[t]`` (``neox``:
halves, ``gptj``: interleaved pairs), the remaining dims of ``kn`` unrotated, and V
copied bit for bit. :func:`_launch` writes ``[n_layers, total_ctx, heads, head_dim]``
K and V, or the same values into slot ``slots[t]`` of paged caches (quantizing to
float8_e4m3fn where the cache is). The public functions, their validation and the choice
of lowering are in :mod:`fusedkv_jax.ops`.

The Pallas **Triton** lowering (``jax.experimental.pallas.triton``, chosen by passing
its ``CompilerParams``) offers what this kernel uses per token: gathers (the cos/sin
row of a data-dependent position, the RoPE partner of each element) and masked loads
and stores (``head_dim`` 96 or 192 in power-of-two tiles, the ragged last token block,
padding slots of a cache). It is deprecated since jax 0.11.0 (a ``DeprecationWarning``
once per lowering) but present and working in every supported jax; what is
Triton-specific here is :func:`_load`, :func:`_store` and :func:`_pallas_launch`'s
``compiler_params``.

Tiling: one program per (block of ``block_tokens`` tokens, layer, block of
``block_heads`` heads) works on a ``[block_tokens, block_heads, head_dim]`` tile,
column runs padded to powers of two and masked. At long contexts
(:func:`loops_over_layers`) a program takes every layer of its tokens instead: it loads
their cos/sin rows once for all layers, and issues the next layer's loads before it
stores a layer. With every head in the block, a program reads contiguous K and V rows
of ``kv`` and, without a cache, writes one contiguous chunk of each output; the cos/sin
rows are loaded once per token and shared by all heads. ``neox`` K that is rotated whole
is loaded as its two rotary halves, so each element meets its RoPE partner in
registers. ``gptj``'s interleaved pairs are no run of columns: its K rows are loaded whole
and split into their pairs in registers. ``neox`` halves beside an unrotated tail are runs
too narrow for wide loads: such K rows are loaded whole and again at permuted columns (an
L1-resident second load) for the partners (:func:`loads_k_rows`). By default a block
holds every head, but at most four where K is loaded as rows (:func:`tile_heads`), and
fewer in calls too short to give every multiprocessor two programs of one token each
where a tile of one token would hold more than 2 KiB of K.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fusedkv_jax import devices
from fusedkv_jax.partitioning import partitioned
from interop.core.reference import FP8_E4M3_MAX, FP8_SCALE_MAX, FP8_SCALE_MIN, SMALLEST_NORMAL_FP32
from interop.core.spec import FusedKVConfig, tile_argument
from interop.core.tiles import interpreted_block_tokens

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
# A tile that loads K as rows (loads_k_rows) takes at most this many heads: swept on the
# shape grid's fit half (head_dim 80-256, 16-32 heads), four ran as fast as every head or
# faster, fewer ran slower; one-layer calls at the longest contexts lose a little (BENCHMARKS.md).
_K_ROWS_TILE_HEADS = 4
# A short call's tiles of one token that hold more bytes of K than this are split over
# their heads while the GPU has fewer than two programs a multiprocessor: a larger tile
# takes its threads several rounds of loads, which split they issue side by side. At
# this size (the draft shape's 8 heads of 128 bf16) more, smaller programs ran slower.
_SPLIT_TILE_BYTES = 2048
# Layers whose loads a looping program has issued before it stores one: more in flight
# cost registers and lose.
LAYERS_IN_FLIGHT = 2


def _load(ref, *, mask, other, eviction_policy=None):
    return plgpu.load(ref, mask=mask, other=other, eviction_policy=eviction_policy)


def _store(ref, value, *, mask):
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def _tile_of_program(block_tokens: int, block_layers: int, block_heads: int):
    """``(first_layer, tokens, heads)`` of this program: one of the grid (token block, layer
    block, head block)."""
    first_layer = pl.program_id(1) * block_layers
    tokens = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    heads = pl.program_id(2) * block_heads + jnp.arange(block_heads)
    return first_layer, tokens, heads


class _HeadRows(NamedTuple):
    """Where a tile's head rows are in ``kv``: the token of each (``[tokens, 1, 1]``), the
    first column of its head (``[1, heads, 1]``), and which rows the tile has (``loaded``)."""

    tokens: jax.Array
    starts: jax.Array
    loaded: jax.Array


def _head_rows(tokens, heads, in_context, num_kv_heads: int, head_dim: int) -> _HeadRows:
    """The tile's head rows in ``kv``: tokens in the context, heads of the model."""
    loaded = in_context[:, None, None] & (heads < num_kv_heads)[None, :, None]
    return _HeadRows(tokens[:, None, None], heads[None, :, None] * head_dim, loaded)


def _destination_rows(tokens, in_context, slots_ref, num_rows: int):
    """``(rows, written)``: row ``t`` for token ``t``, or its cache slot, skipped outside the cache."""
    if slots_ref is None:
        return tokens, in_context
    rows = _load(slots_ref.at[tokens], mask=in_context, other=-1)
    return rows, in_context & (rows >= 0) & (rows < num_rows)


def _layer_value(ref, layer):
    """The layer's entry of a per-layer vector (eps, a scale, a V multiplier, a table index); None without one."""
    return None if ref is None else _load(ref.at[layer], mask=None, other=None)


def _load_head_rows(kv_ref, head_rows: _HeadRows, layer, columns, columns_ok):
    """``columns`` of the tile's head rows in one layer of ``kv``, zeros where the tile has none."""
    return _load(kv_ref.at[head_rows.tokens, layer, head_rows.starts + columns[None, None, :]],
                 mask=head_rows.loaded & columns_ok[None, None, :], other=0.0)


def _load_norm_weight(weight_ref, layer, columns, columns_ok):
    """The layer's K-norm weight at ``columns`` in fp32; 1 without a K-norm (K is rotated as projected)."""
    if weight_ref is None:
        return 1.0
    return _load(weight_ref.at[layer, columns], mask=columns_ok, other=0.0).astype(jnp.float32)


def _rotate(first, second, cos, sin):
    """RoPE of every pair ``(first, second)``."""
    return first * cos - second * sin, second * cos + first * sin


class _KHalves:
    """``neox`` K loaded as its two rotary halves and the unrotated tail, each a contiguous
    run of columns: ``pieces``, the ``(columns, columns_ok)`` of each load, traced where the
    layer's loads are issued.

    Every element of a tile is read once with wide loads and meets its RoPE partner in
    registers: faster than the whole row plus a second, permuted load of it when the
    rotation covers the row.
    """

    def __init__(self, head_dim: int, rotary_dim: int, rope_style: str):
        half, tail = rotary_dim // 2, head_dim - rotary_dim
        pairs, pairs_ok = self.frequencies(head_dim, rotary_dim, rope_style)
        self.pieces = [(pairs, pairs_ok), (half + pairs, pairs_ok)]
        if tail:
            tail_columns = rotary_dim + jnp.arange(pl.next_power_of_2(tail))
            self.pieces.append((tail_columns, tail_columns < head_dim))

    @staticmethod
    def frequencies(head_dim: int, rotary_dim: int, rope_style: str):
        """The cos/sin column of each loaded column, one per pair, and which of them are pairs
        (the run is padded to a power of two)."""
        del head_dim, rope_style  # one run serves both halves, which only neox K has
        pairs = jnp.arange(pl.next_power_of_2(rotary_dim // 2))
        return pairs, pairs < rotary_dim // 2

    def sum_squares(self, k):
        """``sum(k*k)`` per head row, over the pieces."""
        return sum(jnp.sum(piece * piece, axis=-1, keepdims=True) for piece in k)

    def rope(self, k, weight, inv_rms, cos, sin):
        """RoPE of ``kn = k * inv_rms * weight``, as ``(columns, values, columns_ok)`` pieces to store."""
        first, second, *tail = [piece * inv_rms * piece_weight for piece, piece_weight in zip(k, weight)]
        # The unrotated tail is kn itself: through a rotation by (cos 1, sin 0) an infinite kn
        # would meet Inf * 0 and turn into NaN.
        values = [*_rotate(first, second, cos, sin), *tail]
        return [(columns, value, ok) for (columns, ok), value in zip(self.pieces, values)]


class _KRows:
    """K loaded as whole rows and again at permuted columns for each element's RoPE partner
    (``gptj``: its pair's other member; ``neox``: the same column of the other rotary half),
    an L1-resident second load: ``pieces`` are the row's and the partners' ``(columns,
    columns_ok)``, traced where the layer's loads are issued, as :class:`_KHalves`'s."""

    def __init__(self, head_dim: int, rotary_dim: int, rope_style: str):
        dims = jnp.arange(pl.next_power_of_2(head_dim))
        dims_ok = dims < head_dim
        self.rotated = dims < rotary_dim
        if rope_style == "gptj":
            first = dims % 2 == 0
            partner = jnp.where(first, dims + 1, dims - 1)
        else:
            first = dims < rotary_dim // 2
            partner = jnp.where(first, dims + rotary_dim // 2, dims - rotary_dim // 2)
        partner = jnp.where(self.rotated, partner, dims)
        self.sin_sign = jnp.where(self.rotated, jnp.where(first, -1.0, 1.0), 0.0).astype(jnp.float32)
        self.pieces = [(dims, dims_ok), (partner, dims_ok)]

    @staticmethod
    def frequencies(head_dim: int, rotary_dim: int, rope_style: str):
        """The cos/sin column of every column of a row, and which columns are rotated."""
        dims = jnp.arange(pl.next_power_of_2(head_dim))
        rotated = dims < rotary_dim
        pair = dims // 2 if rope_style == "gptj" else dims % (rotary_dim // 2)
        return jnp.where(rotated, pair, 0), rotated

    def sum_squares(self, k):
        """``sum(k*k)`` per head row, over the row alone (the partners are its columns again)."""
        row, _ = k
        return jnp.sum(row * row, axis=-1, keepdims=True)

    def rope(self, k, weight, inv_rms, cos, sin):
        """RoPE of ``kn = k * inv_rms * weight``, as one ``(columns, values, columns_ok)`` piece to store."""
        (row, partner), (row_weight, partner_weight) = k, weight
        kn = row * inv_rms * row_weight
        rotated = kn * cos + (partner * inv_rms * partner_weight) * (sin * self.sin_sign)
        # The unrotated tail is kn itself (see _KHalves.rope).
        (dims, dims_ok), _ = self.pieces
        return [(dims, jnp.where(self.rotated, rotated, kn), dims_ok)]


class _KPairs:
    """``gptj`` K loaded as whole rows once and split into its interleaved pairs in
    registers (a ``[pairs, 2]`` reshape): each element meets its RoPE partner without the
    second, permuted load of :class:`_KRows`. ``pieces`` is the row's ``(columns,
    columns_ok)``, as :class:`_KHalves`'s."""

    def __init__(self, head_dim: int, rotary_dim: int, rope_style: str):
        dims = jnp.arange(pl.next_power_of_2(head_dim))
        self.pieces = [(dims, dims < head_dim)]
        _, self.rotated = self.frequencies(head_dim, rotary_dim, rope_style)

    @staticmethod
    def frequencies(head_dim: int, rotary_dim: int, rope_style: str):
        """The cos/sin column of each pair of a row, and which pairs are rotated."""
        del rope_style  # gptj only
        pairs = jnp.arange(pl.next_power_of_2(head_dim) // 2)
        return pairs, pairs < rotary_dim // 2

    def sum_squares(self, k):
        """``sum(k*k)`` per head row."""
        [row] = k
        return jnp.sum(row * row, axis=-1, keepdims=True)

    def rope(self, k, weight, inv_rms, cos, sin):
        """RoPE of ``kn = k * inv_rms * weight``, as one ``(columns, values, columns_ok)`` piece to store."""
        [row], [row_weight] = k, weight
        kn = row * inv_rms * row_weight
        first, second = jnp.unstack(kn.reshape(*kn.shape[:-1], kn.shape[-1] // 2, 2), axis=-1)
        # The unrotated tail is kn itself (see _KHalves.rope).
        first, second = (jnp.where(self.rotated, rotated, unrotated)
                         for rotated, unrotated in zip(_rotate(first, second, cos, sin), (first, second)))
        [(dims, dims_ok)] = self.pieces
        return [(dims, jnp.stack([first, second], axis=-1).reshape(kn.shape), dims_ok)]


class _LayerTile(NamedTuple):
    """One layer's loads, all issued before its first store: V as loaded, the K-norm's eps
    (None without one), and fp32 K with its K-norm weight at the columns of ``k_form``."""

    layer: jax.Array
    v: jax.Array
    eps: jax.Array | None
    k_form: _KHalves | _KRows
    k: list
    weight: list


def _load_layer(kv_ref, weight_ref, eps_ref, head_rows: _HeadRows, layer, *, v_columns, k_form, head_dim: int,
                rotary_dim: int, rope_style: str) -> _LayerTile:
    """Issues one layer's loads: V at ``v_columns`` (``(columns, columns_ok)`` of a head), eps,
    then K and its K-norm weight at the columns of ``k_form``."""
    columns, columns_ok = v_columns
    v = _load_head_rows(kv_ref, head_rows, layer, kv_ref.shape[2] // 2 + columns, columns_ok)
    eps = _layer_value(eps_ref, layer)
    form = k_form(head_dim, rotary_dim, rope_style)
    k = [_load_head_rows(kv_ref, head_rows, layer, *piece).astype(jnp.float32) for piece in form.pieces]
    weight = [_load_norm_weight(weight_ref, layer, *piece) for piece in form.pieces]
    return _LayerTile(layer, v, eps, form, k, weight)


def _load_cos_sin(cos_sin_ref, table, positions, rotated_tokens, frequencies, frequencies_ok):
    """The cos and sin of each token's position at ``frequencies``, ``[tokens, 1, frequencies]``,
    in the one table (``table`` None) or in table ``table`` of a 3-D ``cos_sin_ref``: 1 and 0
    for a token not ``rotated_tokens`` (``[tokens, 1]``), whose row is never read."""
    position_index, frequency_index = positions[:, None], frequencies[None, :]
    cos_sin_ok = rotated_tokens & frequencies_ok[None, :]
    in_table = () if table is None else (table,)
    # cos/sin rows kept in L2 (evict_last): every program rereads the small table while kv
    # and the outputs pass through once, and a program's first stores wait on this chain.
    cos = _load(cos_sin_ref.at[(*in_table, position_index, frequency_index)], mask=cos_sin_ok, other=1.0,
                eviction_policy="evict_last")[:, None, :]
    sin = _load(cos_sin_ref.at[(*in_table, position_index, cos_sin_ref.shape[-1] // 2 + frequency_index)],
                mask=cos_sin_ok, other=0.0, eviction_policy="evict_last")[:, None, :]
    # A bf16 or fp16 table is converted as it is loaded (an fp32 one as it is).
    return cos.astype(jnp.float32), sin.astype(jnp.float32)


def _rope_of_layers(cos_sin_ref, table_ref, positions, in_context, rotatable, frequencies, block_layers: int):
    """``layer -> (cos, sin, rotatable)`` of the tokens (:func:`_load_cos_sin`, at the columns
    ``frequencies()`` traces). The one table's rows are loaded once, for every layer. With
    per-layer tables, a program of no fewer layers than tables loads each table's rows once
    and a layer takes its own (no load waits on the layer's table index); a program of fewer
    layers loads each layer's. A layer whose ``layer_rope_table`` index is outside
    ``[0, n_tables)`` has no ``rotatable`` token."""
    def rows(table, rotated):
        return _load_cos_sin(cos_sin_ref, table, positions, (in_context & rotated)[:, None], *frequencies())

    if table_ref is None:
        shared = (*rows(None, rotatable), rotatable)
        return lambda layer: shared
    n_tables = cos_sin_ref.shape[0]
    every_table = [rows(table, rotatable) for table in range(n_tables)] if n_tables <= block_layers else None

    def layer_rope(layer):
        table = _layer_value(table_ref, layer)
        named = (table >= 0) & (table < n_tables)
        if every_table is None:
            return (*rows(jnp.where(named, table, 0), rotatable & named), rotatable & named)
        cos, sin = every_table[0]
        for index, (table_cos, table_sin) in enumerate(every_table[1:], start=1):
            cos, sin = jnp.where(table == index, table_cos, cos), jnp.where(table == index, table_sin, sin)
        return cos, sin, rotatable & named

    return layer_rope


def _inverse_rms(sum_squares, eps, head_dim: int, rotatable):
    """``rsqrt(mean(k*k) + eps)`` per head row, with the edge values of interop.core.reference.

    Zeros where there is no scale to normalize by (rsqrt flushes denormals, hence a
    threshold), NaN where the sum of squares is not finite (NaN or Inf in K, k*k
    overflowed) or the token's position is not ``rotatable`` (no cos/sin row): a NaN
    poisons the whole row, the unrotated tail included. Without a K-norm (``eps`` None):
    1, or NaN where not ``rotatable`` (the unused sum of squares is dropped by the compiler).
    """
    if eps is None:
        return jnp.where(rotatable[:, None, None], 1.0, jnp.nan)
    mean_square_eps = sum_squares / head_dim + eps
    inv_rms = jnp.where(mean_square_eps < SMALLEST_NORMAL_FP32, 0.0, jax.lax.rsqrt(mean_square_eps))
    return jnp.where(rotatable[:, None, None] & (sum_squares < jnp.inf), inv_rms, jnp.nan)


def _multiply_v(v, v_multiplier_ref, layer):
    """V as loaded (bit for bit), or ``v * v_multiplier[layer]`` in fp32."""
    if v_multiplier_ref is None:
        return v
    return v.astype(jnp.float32) * _layer_value(v_multiplier_ref, layer)


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


def _to_destination(values, scale_ref, layer, *, interpret: bool):
    """Values as their destination holds them: an fp8 cache (given ``scale_ref``) the layer's
    :func:`_quantize`, any other destination the values themselves (the store rounds them)."""
    if scale_ref is None:
        return values
    scale = _layer_value(scale_ref, layer)
    return _quantize(values.astype(jnp.float32), scale, interpret=interpret)


def _store_head_rows(dest_ref, scale_ref, layer, pieces, *, rows, heads, written, interpret: bool):
    """Each ``(columns, values, columns_ok)`` of ``pieces`` into ``rows`` (``[tokens, 1, 1]``) of
    ``dest_ref[layer]`` where ``written``, as the destination holds it (:func:`_to_destination`)."""
    for columns, values, columns_ok in pieces:
        values = _to_destination(values, scale_ref, layer, interpret=interpret)
        _store(dest_ref.at[layer, rows, heads[None, :, None], columns[None, None, :]], values,
               mask=written & columns_ok[None, None, :])


def _fused_kv_norm_rope_kernel(
    kv_ref, cos_sin_ref, positions_ref, weight_ref, eps_ref, slots_ref, k_scale_ref, v_scale_ref,
    v_multiplier_ref, layer_rope_table_ref, k_given_ref, v_given_ref, k_dest_ref, v_dest_ref, *,
    num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str, k_rows: bool,
    block_tokens: int, block_layers: int, block_heads: int, interpret: bool,
):
    """One ``[block_tokens, block_heads, head_dim]`` tile of K and V for each of
    ``block_layers`` layers, which share the tile's cos/sin rows (each table's, where there
    are several: :func:`_rope_of_layers`).

    Refs are whole arrays: ``kv[total_ctx, n_layers, 2*kv_size]``, ``cos_sin[max_pos,
    rotary_dim]`` (or ``[n_tables, max_pos, rotary_dim]`` with ``layer_rope_table[n_layers]``),
    ``positions[total_ctx]``, ``weight[n_layers, head_dim]`` and
    ``eps[n_layers]`` (a K-norm), ``slots[total_ctx]``, ``k_scale``, ``v_scale`` and
    ``v_multiplier[n_layers]``, the destinations as given (aliased, unread), and the
    destinations ``k_dest, v_dest[n_layers, rows, num_kv_heads, head_dim]``. What a call
    leaves out is None and carried by the helpers. ``k_rows`` loads K as whole rows
    (``gptj``: :class:`_KPairs`, ``neox``: :class:`_KRows`), else as ``neox`` runs (:class:`_KHalves`).
    """
    del k_given_ref, v_given_ref  # their memory is k_dest_ref's and v_dest_ref's
    k_form = (_KPairs if rope_style == "gptj" else _KRows) if k_rows else _KHalves
    first_layer, tokens, heads = _tile_of_program(block_tokens, block_layers, block_heads)
    in_context = tokens < kv_ref.shape[0]
    head_rows = _head_rows(tokens, heads, in_context, num_kv_heads, head_dim)
    # Every load that does not wait for another is issued first: the cos/sin rows wait
    # for the positions, and at short contexts that chain is most of the kernel's time.
    positions = _load(positions_ref.at[tokens], mask=in_context, other=0)
    rows, written = _destination_rows(tokens, in_context, slots_ref, k_dest_ref.shape[1])
    v_columns = jnp.arange(pl.next_power_of_2(head_dim))
    v_columns_ok = v_columns < head_dim
    load_layer = functools.partial(_load_layer, kv_ref, weight_ref, eps_ref, head_rows,
                                   v_columns=(v_columns, v_columns_ok), k_form=k_form, head_dim=head_dim,
                                   rotary_dim=rotary_dim, rope_style=rope_style)
    layers = [load_layer(first_layer + i) for i in range(min(LAYERS_IN_FLIGHT, block_layers))]
    rotatable = (positions >= 0) & (positions < cos_sin_ref.shape[-2])
    # An out-of-range position (or table index) is never read: its row is masked and becomes NaN.
    layer_rope = _rope_of_layers(cos_sin_ref, layer_rope_table_ref, positions, in_context, rotatable,
                                 functools.partial(k_form.frequencies, head_dim, rotary_dim, rope_style), block_layers)
    # Skipped rows point one past the end: masked on the GPU, and dropped (not written
    # back with a stale value) by interpret mode's scatter.
    rows = jnp.where(written, rows, k_dest_ref.shape[1])[:, None, None]
    written = head_rows.loaded & written[:, None, None]
    store = functools.partial(_store_head_rows, rows=rows, heads=heads, written=written, interpret=interpret)
    for step in range(block_layers):
        tile = layers[step]
        # Later layers' loads go before this layer's stores, which the compiler may not
        # move them past (it cannot tell kv from the outputs).
        if step + LAYERS_IN_FLIGHT < block_layers:
            layers.append(load_layer(first_layer + step + LAYERS_IN_FLIGHT))
        cos, sin, rotated = layer_rope(tile.layer)
        inv_rms = _inverse_rms(tile.k_form.sum_squares(tile.k), tile.eps, head_dim, rotated)
        k = tile.k_form.rope(tile.k, tile.weight, inv_rms, cos, sin)
        v = _multiply_v(tile.v, v_multiplier_ref, tile.layer)
        store(k_dest_ref, k_scale_ref, tile.layer, k)
        store(v_dest_ref, v_scale_ref, tile.layer, [(v_columns, v, v_columns_ok)])


def loads_k_rows(config: FusedKVConfig) -> bool:
    """Whether the kernel loads K as whole rows (:class:`_KPairs`, :class:`_KRows`): always for ``gptj``, and
    for ``neox`` with an unrotated tail, whose rotary halves are runs too narrow for wide
    loads (three narrow runs lose to one row and an L1-resident second load, in either
    grid). Else K is loaded as its ``neox`` runs (:class:`_KHalves`)."""
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
    return pl.cdiv(total_ctx, block_tokens) >= _ONE_WAVE_PROGRAMS_PER_MULTIPROCESSOR * devices.multiprocessors()


def tile_heads(num_kv_heads: int, *, k_rows: bool, interpret: bool = False) -> int:
    """The heads of a tile: all of them (as a power of two), but at most
    ``_K_ROWS_TILE_HEADS`` where the kernel loads K as rows (``interpret``: all)."""
    heads = pl.next_power_of_2(num_kv_heads)
    return heads if interpret or not k_rows else min(heads, _K_ROWS_TILE_HEADS)


def default_tile(total_ctx: int, n_layers: int, num_kv_heads: int, head_dim: int, *,
                 rotary_dim: int | None = None, rope_style: str = "neox",
                 block_tokens: int | None = None, block_heads: int | None = None,
                 num_warps: int | None = None, itemsize: int = 4,
                 interpret: bool = False) -> tuple[int, int, int]:
    """``(block_tokens, block_heads, num_warps)`` for a call of this size: the overrides
    given, the rest chosen (``interpret``: few, large programs). ``n_layers`` counts in
    the number of programs, which sets how many tokens a tile takes (:func:`loops_over_layers`
    says whether a program takes one layer or all) and, in calls too short for tiles of one
    token to fill the GPU, how many heads, where a tile would hold more than
    ``_SPLIT_TILE_BYTES`` of K (``itemsize``: the bytes of an element of ``kv``);
    ``rotary_dim`` (``head_dim`` when None) and ``rope_style`` set the width of the loads,
    which sets the threads."""
    block_tokens, block_heads, num_warps = (
        None if value is None else tile_argument(name, value)
        for name, value in (("block_tokens", block_tokens), ("block_heads", block_heads),
                            ("num_warps", num_warps)))
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    block_dim = pl.next_power_of_2(head_dim)
    k_rows = loads_k_rows(FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style))
    heads_chosen = block_heads is None
    if heads_chosen:
        block_heads = tile_heads(num_kv_heads, k_rows=k_rows, interpret=interpret)
    layer_loop = loops_over_layers(total_ctx, n_layers, num_kv_heads, head_dim, interpret=interpret)
    layer_blocks = 1 if layer_loop else n_layers

    def programs(block_tokens):
        return pl.cdiv(total_ctx, block_tokens) * layer_blocks * pl.cdiv(num_kv_heads, block_heads)

    if block_tokens is None and interpret:
        block_tokens = interpreted_block_tokens(total_ctx, block_heads, head_dim)
    enough_programs = 1 if interpret else _MIN_PROGRAMS_PER_MULTIPROCESSOR * devices.multiprocessors()
    if block_tokens is None:
        tile_elements = _LAYER_LOOP_TILE_ELEMENTS if layer_loop else _TILE_ELEMENTS
        block_tokens = max(1, tile_elements // (block_heads * block_dim))
        while block_tokens > 1 and programs(block_tokens) < enough_programs:
            block_tokens //= 2
    if heads_chosen and block_tokens == 1 and block_heads * block_dim * itemsize > _SPLIT_TILE_BYTES:
        while block_heads > 1 and programs(block_tokens) < enough_programs:
            block_heads //= 2
    if num_warps is None:
        run = pl.next_power_of_2(head_dim if k_rows else rotary_dim // 2)
        run_elements_per_thread = _RUN_ELEMENTS_PER_THREAD[rope_style]
        if layer_loop and not k_rows and run >= _LAYER_LOOP_WIDE_HALF:
            run_elements_per_thread *= 2
        if programs(block_tokens) < enough_programs:
            # Too few programs to fill the GPU: spread each over more threads so more
            # loads are in flight at once.
            run_elements_per_thread = max(1, run_elements_per_thread // 2)
        elif not interpret and programs(block_tokens) <= _ONE_WAVE_PROGRAMS_PER_MULTIPROCESSOR * devices.multiprocessors():
            run_elements_per_thread *= 2
        num_warps = min(8, max(1, block_tokens * block_heads * run // (32 * run_elements_per_thread)))
    return block_tokens, block_heads, num_warps


@functools.partial(jax.jit, static_argnames=(
    "config", "block_tokens", "block_heads", "num_warps", "layer_loop", "k_rows", "interpret"))
def _launch(kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
            k_scale, v_scale, v_multiplier, layer_rope_table=None, *, config: FusedKVConfig, block_tokens,
            block_heads, num_warps, layer_loop, k_rows, interpret):
    """:func:`_pallas_launch`, run by each device on its tokens and layers under a sharded jit.

    On one device, and inside ``jax.shard_map``, it is :func:`_pallas_launch` itself
    (:mod:`fusedkv_jax.partitioning` says how, and why kv's columns are never split).
    """
    return partitioned(
        _pallas_launch, (kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
                         k_scale, v_scale, v_multiplier, layer_rope_table),
        config=config, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
        layer_loop=layer_loop, k_rows=k_rows, interpret=interpret)


def _varying_axes(arrays) -> jax.sharding.ManualAxisType:
    """The manual mesh axes the outputs vary over inside ``jax.shard_map``: those of any input.

    Outside ``shard_map`` every input varies over none, and so do the outputs.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return jax.sharding.ManualAxisType(varying=varying)


def _pallas_launch(kv, k_norm_weight, eps, cos_sin_cache, positions, slots, k_dest, v_dest,
                   k_scale, v_scale, v_multiplier, layer_rope_table, *, config: FusedKVConfig, block_tokens,
                   block_heads, num_warps, layer_loop, k_rows, interpret):
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
    # The kernel's refs in its order; a None is no operand, and the kernel gets None for it.
    inputs = (kv, cos_sin_cache, positions, k_norm_weight, eps, slots, k_scale, v_scale, v_multiplier,
              layer_rope_table, *destinations)
    operands = [a for a in inputs if a is not None]
    # Inside jax.shard_map (check_vma, its default) each output must say which mesh axes
    # it varies over; jax 0.10-0.11 spell that ShapeDtypeStruct(manual_axis_type=...).
    varying = _varying_axes(operands)
    out_shape = [jax.ShapeDtypeStruct(shape if d is None else d.shape,
                                      kv.dtype if d is None else d.dtype,
                                      manual_axis_type=varying)
                 for d in destinations]
    # Aliases index the operands, which the destinations given end.
    aliases = {}
    read = len(operands) - sum(d is not None for d in destinations)
    for output_index, destination in enumerate(destinations):
        if destination is not None:
            aliases[read + len(aliases)] = output_index
    kernel = functools.partial(
        _fused_kv_norm_rope_kernel,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, k_rows=k_rows,
        block_tokens=block_tokens, block_layers=block_layers, block_heads=block_heads, interpret=interpret,
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
