"""The one NumPy reference of the op; every test and benchmark compares against it.

All arithmetic is fp32 (as the kernels do it) with a single rounding to the output
dtype at the end; V is copied byte for byte. Positions outside
``[0, cos_sin_cache.shape[0])`` have no rotation to apply, so their whole K row is
NaN: loud, and identical in every backend, without the device-to-host sync that
raising would need.
"""

from __future__ import annotations

import numpy as np

from interop.arrays import as_numpy
from interop.spec import validate_call


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
) -> tuple[np.ndarray, np.ndarray]:
    """RMSNorm + RoPE on K, V passed through, for all layers.

    Args:
      kv: bf16/fp16/fp32[total_ctx, n_layers, 2*kv_size], per token and layer all K
        heads then all V heads; ``kv_size = num_kv_heads * head_dim``.
      k_norm_weight: float[n_layers, head_dim].
      eps: fp32[n_layers].
      cos_sin_cache: fp32[max_pos, rotary_dim], row p = cos values then sin values.
      positions: int32/int64[total_ctx].

    Returns:
      ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim].
    """
    call = validate_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_style=rope_style,
    )
    kv, k_norm_weight, eps, cos_sin_cache, positions = (
        as_numpy(a) for a in (kv, k_norm_weight, eps, cos_sin_cache, positions)
    )
    total_ctx, n_layers = call.total_ctx, call.n_layers
    heads, dim, half = num_kv_heads, head_dim, rotary_dim // 2
    kv_size = heads * dim

    k = kv[:, :, :kv_size].astype(np.float32).reshape(total_ctx, n_layers, heads, dim)
    inv_rms = 1.0 / np.sqrt(
        np.mean(k * k, axis=-1, keepdims=True, dtype=np.float32)
        + eps.astype(np.float32)[None, :, None, None]
    )
    normed = k * inv_rms * k_norm_weight.astype(np.float32)[None, :, None, :]

    pos = positions.astype(np.int64)
    in_range = (pos >= 0) & (pos < call.max_position)
    rows = cos_sin_cache[np.where(in_range, pos, 0)].astype(np.float32)
    cos = rows[:, None, None, :half]
    sin = rows[:, None, None, half:rotary_dim]

    if rope_style == "neox":
        first, second = normed[..., :half], normed[..., half:rotary_dim]
    else:
        first, second = normed[..., 0:rotary_dim:2], normed[..., 1:rotary_dim:2]
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin

    k_result = normed.copy()
    if rope_style == "neox":
        k_result[..., :half], k_result[..., half:rotary_dim] = rotated_first, rotated_second
    else:
        k_result[..., 0:rotary_dim:2], k_result[..., 1:rotary_dim:2] = rotated_first, rotated_second
    k_result[~in_range] = np.nan

    k_out = np.ascontiguousarray(k_result.transpose(1, 0, 2, 3)).astype(kv.dtype)
    v = kv[:, :, kv_size:].reshape(total_ctx, n_layers, heads, dim)
    v_out = np.ascontiguousarray(v.transpose(1, 0, 2, 3))
    return k_out, v_out


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
    """fp32[max_position, rotary_dim]: the standard RoPE table, cos values then sin values."""
    inv_freq = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
