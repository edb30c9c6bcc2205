"""The jax backend's public functions: validation, the choice of lowering, the launch.

:func:`fused_kv_norm_rope` writes ``[n_layers, total_ctx, heads, head_dim]`` K and V;
:func:`fused_kv_norm_rope_into_cache` writes the same values into slot ``cache_loc[t]`` of
paged caches. Each validates its call (``interop.core.spec``) before anything is launched,
then launches the kernel of the lowering it takes, differentiable through
:mod:`fusedkv_jax.backward`.

Lowerings (``lowering=``, None for :func:`default_lowering`): the Pallas Triton lowering
(:mod:`fusedkv_jax.kernel`) serves every configuration by default, on the GPU and in
interpret mode.

``lowering="mosaic_gpu"`` runs :mod:`fusedkv_jax.mosaic_kernel` (Mosaic GPU has no
gather on Hopper: TMA copies with scalar starts fetch the cos/sin rows). It takes
bf16/fp16 ``kv`` with ``head_dim`` (at most 256) and ``rotary_dim`` multiples of 32 (a
copy into shared memory moves a multiple of 128 bytes: a row of fp32 cos/sin or weight),
and ``total_ctx`` at most 8 or a multiple of 8 (a multiple of 64 in interpret mode), with
every option of the op (no K-norm, ``v_multiplier``, ``layer_rope_table``); other calls
with it are refused. It is not the default because it is slower where it matters most: it passes
the reference checks on the GPU, but timed in jit as a jit user runs it (``fusedkv
bench``'s ``pallas-mosaic`` row, which checks that the compiled jit launches it once per
call) it matches the Triton lowering only at long contexts with many heads a program,
and loses at short ones, where its chain of copies (the positions, then the cos/sin rows:
one copy for a block whose positions count up, else one a token) costs more than the
Triton lowering's whole call (BENCHMARKS.md). It writes a caller's
``k_out``/``v_out`` in place through refs (under a jit that donates them), but not
under ``jax.vmap``, which batches it only with fresh outputs. The paged-cache entry point
on it (caches in ``kv``'s dtype) writes fresh K and V and lets XLA scatter their rows:
a Mosaic GPU kernel would write each row to its slot by a copy of its own, as it reads a
cos/sin row, the copies that already cost it most.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The kernel's rules are read through its module at each call: `fusedkv bench --forms` forces them there.
from fusedkv_jax import backward, kernel, mosaic_kernel
from fusedkv_jax.backward import refusing_derivatives
from fusedkv_jax.devices import on_cpu
from fusedkv_jax.indices import narrow_for_jax
from interop.core.spec import (
    AcceptedCall,
    CallShape,
    FusedKVConfig,
    accept_cache_call,
    accept_call,
    check_arrays,
    check_output_buffers,
    check_positions_in_range,
)


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
    layer_rope_table=None,
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
      cos_sin_cache: fp32/bf16/fp16[max_pos, rotary_dim], row p = cos values then sin values;
        read as fp32. Or ``[n_tables, max_pos, rotary_dim]``, one table per RoPE, with
        ``layer_rope_table``.
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
        the Triton lowering; :func:`fusedkv_jax.kernel.default_tile` otherwise.
      interpret: run in Pallas interpret mode; None means "when ``kv`` is on the CPU".
      lowering: ``"triton"``, ``"mosaic_gpu"``, or None for the default of the
        configuration (:func:`default_lowering`).
      layer_rope_table: int32[n_layers], exactly with a 3-D ``cos_sin_cache``: layer l is
        rotated by table ``layer_rope_table[l]``; an index outside [0, n_tables) gives that
        layer an all-NaN K.

    Returns:
      ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim]. They
      differentiate (``jax.grad``, ``jax.vjp``: a Pallas backward kernel on the forward's
      lowering, :mod:`fusedkv_jax.backward`, :mod:`fusedkv_jax.mosaic_backward`) with respect
      to ``kv``,
      ``k_norm_weight`` and ``v_multiplier``;
      ``eps``, ``cos_sin_cache``, ``positions`` and given ``k_out``/``v_out`` get zero cotangents.

    Usable inside ``jax.jit`` (the configuration is static) and under ``jax.vmap``
    (with ``lowering="mosaic_gpu"``, without ``k_out``/``v_out``).
    """
    outputs, given_kv = (("k_out", k_out), ("v_out", v_out)), kv
    check_arrays((("kv", kv), ("k_norm_weight", k_norm_weight), ("eps", eps),
                  ("cos_sin_cache", cos_sin_cache), ("positions", positions), ("v_multiplier", v_multiplier),
                  *outputs, ("layer_rope_table", layer_rope_table)), "jax")
    kv, k_out, v_out = (_on_default_device(a) for a in (kv, k_out, v_out))
    accepted = accept_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        v_multiplier=v_multiplier, layer_rope_table=layer_rope_table,
    )
    # On the caller's own arrays: a NumPy array's memory is not seen once moved to jax.
    check_output_buffers(given_kv, outputs)
    if check_positions and accepted.shape.total_ctx:
        check_positions_in_range(*_position_range(positions), accepted.shape.max_position)
    return fused_kv_norm_rope_accepted(
        accepted, kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier=v_multiplier, k_out=k_out,
        v_out=v_out,
        block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps, interpret=interpret,
        lowering=lowering, layer_rope_table=layer_rope_table)


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
                                num_warps=None, interpret=None, lowering=None, layer_rope_table=None):
    """:func:`fused_kv_norm_rope` on jax arrays (and NumPy ones but ``kv``) that were
    validated as ``accepted`` (``interop.core.spec.accept_call``, then ``check_output_buffers``):
    those checks are not run again. ``interop``'s and :func:`fused_kv_norm_rope`'s own path;
    the public function checks everything."""
    call = accepted.shape
    options = _launch_options(call, kv, block_tokens, block_heads, num_warps, interpret)
    lowering = _lowering(lowering, call, kv.dtype, options["interpret"],
                         tuned=(block_tokens, block_heads, num_warps) != (None, None, None))
    if call.total_ctx == 0 or call.n_layers == 0:
        empty = jnp.empty(call.output_shape, kv.dtype)
        return (empty if k_out is None else k_out), (empty if v_out is None else v_out)
    positions = narrow_for_jax(positions)
    # Differentiable (jax.grad, jax.vjp): fusedkv_jax.backward's custom_vjp around the same launch.
    if lowering == "mosaic_gpu":
        return backward.differentiable_mosaic_launch(tuple(options.items()), kv, k_norm_weight, eps, cos_sin_cache,
                                                     positions, k_out, v_out, v_multiplier, layer_rope_table)
    return backward.differentiable_launch(tuple(options.items()), kv, k_norm_weight, eps, cos_sin_cache, positions,
                                          k_out, v_out, v_multiplier, layer_rope_table)


def _launch_options(call: CallShape, kv, block_tokens, block_heads, num_warps, interpret) -> dict:
    """:func:`fusedkv_jax.kernel._launch`'s static arguments for an accepted call: its
    configuration, tile (:func:`fusedkv_jax.kernel.default_tile`, with the overrides given),
    form and interpret mode (None: where ``kv`` lives)."""
    config = call.config
    interpret = on_cpu(kv) if interpret is None else interpret
    block_tokens, block_heads, num_warps = kernel.default_tile(
        call.total_ctx, call.n_layers, config.num_kv_heads, config.head_dim, rotary_dim=config.rotary_dim,
        rope_style=config.rope_style, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
        itemsize=kv.dtype.itemsize, interpret=interpret)
    return dict(config=config, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
                layer_loop=kernel.loops_over_layers(call.total_ctx, call.n_layers, config.num_kv_heads,
                                                    config.head_dim, interpret=interpret),
                k_rows=kernel.loads_k_rows(config), interpret=interpret)


LOWERINGS = ("triton", "mosaic_gpu")


def default_lowering(config: FusedKVConfig, kv_dtype, *, interpret: bool = False) -> str:
    """The lowering :func:`fused_kv_norm_rope` takes for ``config`` when none is named.

    The Triton lowering, for every configuration: the faster in jit wherever Mosaic GPU
    takes the configuration at all (module docstring, "Lowerings").
    """
    del config, kv_dtype, interpret  # one answer today; the signature is the question
    return "triton"


def _lowering(lowering, call, kv_dtype, interpret: bool, *, tuned: bool) -> str:
    """The lowering named (checked against what it can run), or the default."""
    if lowering is None:
        return default_lowering(call.config, kv_dtype, interpret=interpret)
    if lowering not in LOWERINGS:
        raise ValueError(f"Invalid lowering for fused KV materialization: got {lowering!r}, "
                         f"expected one of {LOWERINGS} or None.")
    if lowering == "mosaic_gpu":
        refused = mosaic_kernel.refused_config(call.config, kv_dtype)
        if refused:
            raise ValueError(f"Invalid lowering for fused KV materialization: {refused}.")
        if tuned:
            raise ValueError("Invalid tile override for fused KV materialization: got "
                             "block_tokens/block_heads/num_warps with lowering='mosaic_gpu', "
                             "expected them only with the Triton lowering.")
        refused = mosaic_kernel.refused_context(call.total_ctx, interpret=interpret)
        if refused:
            raise ValueError(f"Invalid total_ctx for fused KV materialization with lowering='mosaic_gpu': {refused}.")
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
    lowering: str | None = None,
    layer_rope_table=None,
):
    """:func:`fused_kv_norm_rope` written straight into slot ``cache_loc[t]`` of paged caches.

    ``k_cache[l, cache_loc[t]] = k_out[l, t]``, ``v_cache[l, cache_loc[t]] = v_out[l, t]``
    for every token whose slot is in ``[0, num_slots)``; other slots (negative ones
    are padding) are skipped and every other cache entry keeps its value. A
    float8_e4m3fn cache holds ``value / scale[l]`` saturated to +-448, rounded once
    from fp32. Slots in range must be distinct (a slot two tokens name holds an
    unspecified mix of their rows; not checked).

    Args (beyond :func:`fused_kv_norm_rope`'s):
      cache_loc: int32/int64[total_ctx] (int64 as for ``positions``).
      k_cache, v_cache: dtype-of-kv or float8_e4m3fn[n_layers, num_slots, num_kv_heads,
        head_dim]; aliased to the outputs, so under ``jax.jit`` with the caches donated
        they are updated in place.
      k_scale, v_scale: fp32[n_layers], for (and only for) a float8_e4m3fn cache.
      v_multiplier: as for :func:`fused_kv_norm_rope`; an fp8 V cache holds
        ``(v * v_multiplier[l]) / v_scale[l]``.
      lowering: as for :func:`fused_kv_norm_rope`. On ``"mosaic_gpu"`` (caches in ``kv``'s
        dtype only) the Mosaic GPU kernel writes fresh K and V and XLA scatters their rows
        into the caches in the same jit: one more write and read of K and V than the
        Triton lowering, which stores each row in its slot.
      layer_rope_table: as for :func:`fused_kv_norm_rope`.

    Returns:
      ``(k_cache, v_cache)`` updated.
    """
    caches, given_kv = (("k_cache", k_cache), ("v_cache", v_cache)), kv
    check_arrays((("kv", kv), ("k_norm_weight", k_norm_weight), ("eps", eps),
                  ("cos_sin_cache", cos_sin_cache), ("positions", positions), ("cache_loc", cache_loc),
                  *caches, ("k_scale", k_scale), ("v_scale", v_scale), ("v_multiplier", v_multiplier),
                  ("layer_rope_table", layer_rope_table)), "jax")
    kv, k_cache, v_cache = (_on_default_device(a) for a in (kv, k_cache, v_cache))
    call = accept_cache_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale, v_scale,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        v_multiplier=v_multiplier, layer_rope_table=layer_rope_table,
    ).shape
    check_output_buffers(given_kv, caches)
    options = _launch_options(call, kv, block_tokens, block_heads, num_warps, interpret)
    lowering = _lowering(lowering, call, kv.dtype, options["interpret"],
                         tuned=(block_tokens, block_heads, num_warps) != (None, None, None))
    if lowering == "mosaic_gpu" and (k_scale is not None or v_scale is not None):
        raise ValueError("Invalid lowering for fused KV materialization: got 'mosaic_gpu' for a float8_e4m3fn "
                         "cache, expected 'triton' (the Mosaic GPU kernel writes K and V in kv's dtype; an fp8 "
                         "cache is quantized from their fp32 values by the Triton lowering).")
    if call.total_ctx == 0 or call.n_layers == 0 or k_cache.shape[1] == 0:  # nothing to write
        return k_cache, v_cache
    positions = narrow_for_jax(positions)
    cache_loc = narrow_for_jax(cache_loc)
    if lowering == "mosaic_gpu":
        return _mosaic_cache_launch((("config", call.config), ("interpret", options["interpret"])), kv,
                                    k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                                    v_multiplier, layer_rope_table)
    return _cache_launch(tuple(options.items()), kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc,
                         k_cache, v_cache, k_scale, v_scale, v_multiplier, layer_rope_table)


def _mosaic_into_cache(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                       v_multiplier, layer_rope_table, *, config: FusedKVConfig, interpret: bool):
    """The cache variant on the Mosaic GPU lowering: its kernel's fresh K and V, each row
    scattered by XLA into slot ``cache_loc[t]`` of the caches, a slot out of range dropped.
    Mosaic GPU on Hopper would write a row to a slot read at run time by a copy of its own,
    the way its kernel reads a cos/sin row, the copies that already cost it most."""
    k, v = mosaic_kernel.launch(kv, k_norm_weight, eps, cos_sin_cache, positions, None, None, v_multiplier,
                                layer_rope_table, config=config, interpret=interpret)
    num_slots = k_cache.shape[1]
    # A negative index would count from the end: every slot out of range is sent past it,
    # each to its own, so that the slots stay distinct (the contract's slots in range are).
    past_end = num_slots + jnp.arange(cache_loc.shape[0], dtype=cache_loc.dtype)
    slots = jnp.where((cache_loc >= 0) & (cache_loc < num_slots), cache_loc, past_end)
    return _scatter_rows(k_cache, k, slots), _scatter_rows(v_cache, v, slots)


def _scatter_rows(cache, rows, slots):
    """``cache[:, slots[t]] = rows[:, t]``, a slot past the end dropped; ``slots`` distinct.
    XLA's scatter moves an element a thread: the rows move as 32-bit words (two 16-bit
    values each), half the elements."""
    def words(array):
        return jax.lax.bitcast_convert_type(array.reshape(*array.shape[:2], -1, 2), jnp.uint32)

    written = words(cache).at[:, slots].set(words(rows), mode="drop", unique_indices=True)
    return jax.lax.bitcast_convert_type(written, cache.dtype).reshape(cache.shape)


def _refusing_cache_derivatives(function, names: tuple):
    """A cache call's launch, which jax.grad and jax.jvp refuse: they would differentiate
    its partitioning, or the caches it writes in place."""
    return refusing_derivatives(
        function, names,
        got="a value jax differentiates (jax.grad, jax.jvp) in a cache variant (fused_kv_norm_rope_into_cache, "
            "materialize_into_cache)",
        expected="none (the caches are written in place and carry no gradient: differentiate fused_kv_norm_rope "
                 "or materialize, and write their outputs into the cache)")


_cache_launch = _refusing_cache_derivatives(
    lambda options, *arrays: kernel._launch(*arrays, **dict(options)),
    ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "cache_loc", "k_cache", "v_cache", "k_scale",
     "v_scale", "v_multiplier", "layer_rope_table"))
_mosaic_cache_launch = _refusing_cache_derivatives(
    lambda options, *arrays: _mosaic_into_cache(*arrays, **dict(options)),
    ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "cache_loc", "k_cache", "v_cache", "v_multiplier",
     "layer_rope_table"))
