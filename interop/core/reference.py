"""The one NumPy reference of the op; every test and benchmark compares against it.

All arithmetic is fp32 (as the kernels do it) with a single rounding to the output
dtype at the end; V is copied byte for byte, unless a ``v_multiplier`` scales it (then
``v * v_multiplier[l]`` in fp32, rounded once). A draft without a K-norm passes
``k_norm_weight=None`` (and ``eps=None``): K is then the rotation of the projected K,
and the two K-norm rules below (a non-finite sum of squares, no scale to normalize
by) do not apply.

Edge values, the same in the reference and both kernels (README, "Edge values"):

- NaN and Inf in V pass through bit for bit (payload and sign included; the JAX
  kernel in interpret mode on a CPU quiets bf16 NaNs, see README).
- A K head whose fp32 sum of squares is not finite (a NaN or Inf among its K
  inputs, or ``|k|`` so large that ``k*k`` overflows fp32) comes out all NaN: that
  head only, other heads and V of the same token untouched.
- A K head whose fp32 ``mean(k*k) + eps`` is below the smallest normal fp32
  (``2**-126``; e.g. ``eps`` 0 and an all-zero or denormal K) comes out all zeros
  (``k * 0 * k_norm_weight``, so with finite weights): there is no scale to
  normalize by. The GPU's rsqrt flushes denormals, so a threshold, not ``== 0``,
  is what every implementation can agree on.
- A position outside ``[0, max_pos)`` has no rotation to apply, so the token's whole
  K row is NaN: loud, and identical in every backend, without the device-to-host sync
  that raising would need. Likewise a ``layer_rope_table`` entry outside
  ``[0, n_tables)`` names no table: that layer's K is all NaN (its V as usual).
- Otherwise IEEE arithmetic of the formula: the unrotated tail (dims ``>=
  rotary_dim``) is ``kn`` itself, so an fp32 overflow there is +-Inf, not NaN; an
  fp16/bf16 result beyond the dtype's range rounds to +-Inf; a float8_e4m3fn cache
  holds the correctly rounded fp32 quotient ``value / scale`` rounded once to fp8,
  +-Inf and every quotient beyond the range saturated to +-448, NaN kept.
- An fp8 scale outside ``[2**-100, 2**100]`` (zero, negative, NaN, Inf, a denormal,
  or merely extreme) has no quantization every implementation computes alike (a
  reciprocal overflows, a CPU flushes denormals): the entries it would quantize
  are NaN, without the device-to-host sync that raising would need.
"""

from __future__ import annotations

import numpy as np

from interop.core.arrays import as_numpy
from interop.core.rope import base_inverse_frequencies, cos_sin_rows
from interop.core.spec import validate_cache_call, validate_call


def fused_kv_norm_rope_reference(
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
    layer_rope_table=None,
) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm + RoPE on K, V passed through, for all layers.

    Args:
      kv: bf16/fp16/fp32[total_ctx, n_layers, 2*kv_size], per token and layer all K
        heads then all V heads; ``kv_size = num_kv_heads * head_dim``.
      k_norm_weight: float[n_layers, head_dim], or None for a draft without a K-norm
        (K is then RoPE of the projected K, not normalized).
      eps: fp32[n_layers]; None exactly when ``k_norm_weight`` is.
      cos_sin_cache: fp32/bf16/fp16[max_pos, rotary_dim], row p = cos values then sin
        values; read as fp32. Or ``[n_tables, max_pos, rotary_dim]``: one table per RoPE
        (layers with another RoPE base), each layer's named by ``layer_rope_table``.
      positions: int32/int64[total_ctx].
      v_multiplier: fp32[n_layers] or None: V is ``v * v_multiplier[l]`` rounded once
        (None: V is copied bit for bit).
      layer_rope_table: int32[n_layers], the table of each layer, exactly when
        ``cos_sin_cache`` is 3-D.

    Returns:
      ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim].
    """
    # Host copies first: the reference reads arrays of any framework on any device.
    kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table = (
        _host(a) for a in (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table))
    call = validate_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_style=rope_style, v_multiplier=v_multiplier, layer_rope_table=layer_rope_table,
    )
    k, v = _k_fp32_and_v(call, kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table)
    with np.errstate(over="ignore"):  # beyond the dtype's range is +-Inf, by design
        return k.astype(kv.dtype), v.astype(kv.dtype)


def _host(array):
    return None if array is None else as_numpy(array)


def fused_kv_norm_rope_into_cache_reference(
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
    layer_rope_table=None,
) -> tuple[np.ndarray, np.ndarray]:
    """The op written straight into a paged KV cache; returns updated copies of the caches.

    Args (beyond :func:`fused_kv_norm_rope_reference`'s):
      cache_loc: int32/int64[total_ctx], the cache slot of each token; slots outside
        ``[0, num_slots)`` (negative ones are padding) are skipped.
      k_cache, v_cache: dtype-of-kv or float8_e4m3fn[n_layers, num_slots, num_kv_heads, head_dim].
      k_scale, v_scale: fp32[n_layers], only for a float8_e4m3fn cache: the cache holds
        ``value / scale`` saturated to +-448, rounded once from fp32; a layer whose scale
        lies outside ``[FP8_SCALE_MIN, FP8_SCALE_MAX]`` gets NaN entries.
    """
    kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache = (
        _host(a) for a in (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc,
                           k_cache, v_cache))
    k_scale, v_scale, v_multiplier, layer_rope_table = (
        _host(a) for a in (k_scale, v_scale, v_multiplier, layer_rope_table))
    # The caches are read, never written (the results are copies): one array may be both.
    call = validate_cache_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_style=rope_style, k_scale=k_scale, v_scale=v_scale, v_multiplier=v_multiplier,
        check_buffers=False, layer_rope_table=layer_rope_table,
    )
    k, v = _k_fp32_and_v(call, kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table)
    k_cache, v_cache = k_cache.copy(), v_cache.copy()
    slots = cache_loc.astype(np.int64)
    written = (slots >= 0) & (slots < k_cache.shape[1])
    # V rounds once into its cache: from the fp32 product where multiplied, else from itself.
    for cache, values, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if scale is not None:
            values = values.astype(np.float32)
            layer_scale = scale.astype(np.float32)[:, None, None, None]
            # np.clip keeps NaN; +-Inf saturate like every other quotient beyond the range.
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                values = np.clip(values / layer_scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
            values = np.where(fp8_scale_ok(layer_scale), values, np.float32(np.nan))
        with np.errstate(over="ignore", invalid="ignore"):
            cache[:, slots[written]] = values[:, written].astype(cache.dtype)
    return k_cache, v_cache


FP8_E4M3_MAX = 448.0
# The fp8 scales whose quotient every implementation computes alike: the reciprocal is a
# normal fp32, and a denormal value (which a CPU flushes) over any of them is below fp8's
# smallest code, so it rounds to zero either way.
FP8_SCALE_MIN = 2.0 ** -100
FP8_SCALE_MAX = 2.0 ** 100


def fp8_scale_ok(scale):
    """Whether an fp8 scale is in ``[FP8_SCALE_MIN, FP8_SCALE_MAX]`` (NaN is not)."""
    return (scale >= np.float32(FP8_SCALE_MIN)) & (scale <= np.float32(FP8_SCALE_MAX))


# Below this fp32 mean(k*k) + eps a K head comes out zeros (module docstring).
SMALLEST_NORMAL_FP32 = 2.0 ** -126


def _k_fp32_and_v(call, kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table):
    """fp32 K[n_layers, total_ctx, heads, head_dim] before its one rounding, and V: as given,
    or its fp32 product with ``v_multiplier`` before its one rounding."""
    config = call.config
    total_ctx, n_layers = call.total_ctx, call.n_layers
    heads, dim, rotary_dim = config.num_kv_heads, config.head_dim, config.rotary_dim
    half = rotary_dim // 2

    k = kv[:, :, :config.kv_size].astype(np.float32).reshape(total_ctx, n_layers, heads, dim)
    # Overflow, NaN and Inf are values here (the module docstring's edge values), not errors.
    normed = k if k_norm_weight is None else _normalized(k, k_norm_weight, eps)

    rows, in_range = _cos_sin_rows(cos_sin_cache, positions, layer_rope_table, call)
    cos = rows[:, :, None, :half]
    sin = rows[:, :, None, half:rotary_dim]

    pair = (slice(0, half), slice(half, rotary_dim)) if config.rope_style == "neox" else (
        slice(0, rotary_dim, 2), slice(1, rotary_dim, 2))
    first, second = normed[..., pair[0]], normed[..., pair[1]]
    k_result = normed.copy()  # dims past rotary_dim stay kn
    with np.errstate(over="ignore", invalid="ignore"):
        k_result[..., pair[0]] = first * cos - second * sin
        k_result[..., pair[1]] = second * cos + first * sin
    k_result[~in_range] = np.nan

    v = kv[:, :, config.kv_size:].reshape(total_ctx, n_layers, heads, dim)
    if v_multiplier is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            v = v.astype(np.float32) * v_multiplier.astype(np.float32)[None, :, None, None]
    return (np.ascontiguousarray(k_result.transpose(1, 0, 2, 3)),
            np.ascontiguousarray(v.transpose(1, 0, 2, 3)))


def _cos_sin_rows(cos_sin_cache, positions, layer_rope_table, call):
    """fp32 ``[total_ctx, n_layers, rotary_dim]`` rows of each token's position in each layer's
    table, and ``[total_ctx, n_layers]``: whether there is one (position and table index in range)."""
    tables = cos_sin_cache[None] if layer_rope_table is None else cos_sin_cache
    table = np.zeros(call.n_layers, np.int64) if layer_rope_table is None else layer_rope_table.astype(np.int64)
    pos = positions.astype(np.int64)
    in_range = ((pos >= 0) & (pos < call.max_position))[:, None] & ((table >= 0) & (table < len(tables)))[None, :]
    rows = tables[np.where(in_range, table[None, :], 0), np.where(in_range, pos[:, None], 0)]
    return rows.astype(np.float32), in_range


def _normalized(k, k_norm_weight, eps):
    """fp32 ``k * rsqrt(mean(k*k) + eps) * k_norm_weight`` with the module docstring's edge values."""
    # Overflow, NaN and Inf are values here (the module docstring's edge values), not errors.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        mean_square = np.mean(k * k, axis=-1, keepdims=True, dtype=np.float32)
        mean_square_eps = mean_square + eps.astype(np.float32)[None, :, None, None]
        inv_rms = np.where(mean_square_eps < SMALLEST_NORMAL_FP32, np.float32(0.0),
                           np.float32(1.0) / np.sqrt(mean_square_eps))
        inv_rms = np.where(np.isfinite(mean_square), inv_rms, np.float32(np.nan))
        return k * inv_rms * k_norm_weight.astype(np.float32)[None, :, None, :]


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """fp32[max_position, rotary_dim]: the standard RoPE table, cos values then sin values.

    The ``default`` type of :func:`interop.core.rope.rope_cos_sin_table`, without its checks.
    """
    return cos_sin_rows(base_inverse_frequencies(base, rotary_dim), max_position)
