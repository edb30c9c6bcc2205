"""The NumPy reference of the op's backward pass, in float64, written from the formula.

Per token ``t``, layer ``l``, head ``h``, with ``x`` the K head row, ``w = k_norm_weight[l]``,
``r = rsqrt(mean(x*x) + eps[l])`` and ``g`` the incoming gradient of the K output::

    gn = rope^T(g)                          the rotation by -angle (sin negated); the tail as g
    grad_x = r * (w*gn - x*r * mean(x*r * w*gn))
    grad_k_norm_weight[l] = sum over t, h of gn * x*r
    grad_v = g_v                            (times v_multiplier[l] where given)
    grad_v_multiplier[l] = sum over t, h, d of v * g_v

``grad_x`` is ``r * w*gn - x * r**3 * mean(x * w*gn)`` factored so that the forward's edge
values carry over (CONTRACT.md, Gradients). Which heads take an edge value is decided in
fp32, as the forward decides it; the values are float64:

- a head the forward zeroes (fp32 ``mean(k*k) + eps`` below the smallest normal fp32) has
  ``r = 0``: zero K gradient and nothing added to ``grad_k_norm_weight``;
- a head the forward poisons (fp32 sum of squares not finite), every head of a token
  whose position is outside the table and every K head of a layer whose
  ``layer_rope_table`` entry names no table get an all-NaN K gradient and add nothing to
  ``grad_k_norm_weight`` (its output does not depend on the weight);
- otherwise IEEE arithmetic: a NaN or Inf in the incoming gradient propagates.

Without a K-norm (``k_norm_weight=None``) ``grad_x = rope^T(g)``, NaN for a token without a
rotation. ``cos_sin_cache``, ``positions`` and ``eps`` are not differentiated.
"""

from __future__ import annotations

import numpy as np

from interop.core.arrays import as_numpy
from interop.core.reference import SMALLEST_NORMAL_FP32, _cos_sin_rows
from interop.core.spec import validate_call


def fused_kv_norm_rope_backward_reference(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    grad_k,
    grad_v,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    v_multiplier=None,
    layer_rope_table=None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The gradients of :func:`~interop.core.reference.fused_kv_norm_rope_reference`.

    Args (beyond the forward's):
      grad_k, grad_v: float[n_layers, total_ctx, num_kv_heads, head_dim], the gradients
        of the forward's ``k_out`` and ``v_out``.
      layer_rope_table: as the forward's: with a 3-D ``cos_sin_cache``, each layer's table.

    Returns:
      ``(grad_kv, grad_k_norm_weight, grad_v_multiplier)`` in float64:
      ``[total_ctx, n_layers, 2*kv_size]``, ``[n_layers, head_dim]`` (None without a
      K-norm) and ``[n_layers]`` (None without a ``v_multiplier``).
    """
    kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, v_multiplier, layer_rope_table = (
        None if a is None else as_numpy(a)
        for a in (kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, v_multiplier,
                  layer_rope_table))
    call = validate_call(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
                         v_multiplier=v_multiplier, layer_rope_table=layer_rope_table)
    for name, grad in (("grad_k", grad_k), ("grad_v", grad_v)):
        if grad.shape != call.output_shape:
            raise ValueError(f"Invalid {name} shape for fused KV materialization: got {grad.shape}, "
                             f"expected {call.output_shape}.")
    config = call.config
    token_major = (call.total_ctx, call.n_layers, config.num_kv_heads, config.head_dim)
    x = kv[:, :, :config.kv_size].astype(np.float64).reshape(token_major)
    g = grad_k.astype(np.float64).transpose(1, 0, 2, 3)
    rows, in_range = _cos_sin_rows(cos_sin_cache, positions, layer_rope_table, call)
    gn = _rotate_back(g, rows.astype(np.float64), config)

    grad_weight = None
    if k_norm_weight is None:
        grad_x = gn
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # edge values, not errors
            inv_rms = _inverse_rms(kv[:, :, :config.kv_size].reshape(token_major), eps)
            normed = x * inv_rms
            weighted = k_norm_weight.astype(np.float64)[None, :, None, :] * gn
            grad_x = inv_rms * (weighted - normed * np.mean(normed * weighted, axis=-1, keepdims=True))
            counted = np.isfinite(inv_rms) & in_range[:, :, None, None]
            grad_weight = np.where(counted, gn * normed, 0.0).sum(axis=(0, 2))
    grad_x[~in_range] = np.nan

    v = kv[:, :, config.kv_size:].astype(np.float64).reshape(token_major)
    g_v = grad_v.astype(np.float64).transpose(1, 0, 2, 3)
    grad_v_multiplier = None
    if v_multiplier is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            grad_v_multiplier = (v * g_v).sum(axis=(0, 2, 3))
            g_v = g_v * v_multiplier.astype(np.float64)[None, :, None, None]
    grad_kv = np.concatenate([grad_x.reshape(kv.shape[0], kv.shape[1], -1),
                              g_v.reshape(kv.shape[0], kv.shape[1], -1)], axis=-1)
    return grad_kv, grad_weight, grad_v_multiplier


def _rotate_back(g, rows, config):
    """``rope^T(g)``: each rotated pair turned back by its angle (sin negated), the tail as is;
    ``rows`` ``[total_ctx, n_layers, rotary_dim]``, each token's in each layer's table."""
    half, rotary_dim = config.rotary_dim // 2, config.rotary_dim
    cos = rows[:, :, None, :half]
    sin = rows[:, :, None, half:rotary_dim]
    pair = (slice(0, half), slice(half, rotary_dim)) if config.rope_style == "neox" else (
        slice(0, rotary_dim, 2), slice(1, rotary_dim, 2))
    first, second = g[..., pair[0]], g[..., pair[1]]
    gn = g.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        gn[..., pair[0]] = first * cos + second * sin
        gn[..., pair[1]] = second * cos - first * sin
    return gn


def _inverse_rms(k, eps):
    """float64 ``rsqrt(mean(k*k) + eps)`` per head, ``[.., 1]``: 0 where the forward zeroes the
    head and NaN where it poisons it, both decided in fp32 as the forward decides them."""
    # A head of zeros with eps 0 divides by zero here; the edge value below replaces it.
    with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):
        k32 = k.astype(np.float32)
        eps32 = eps.astype(np.float32)[None, :, None, None]
        mean_square32 = np.mean(k32 * k32, axis=-1, keepdims=True, dtype=np.float32)
        k64 = k.astype(np.float64)
        inv_rms = 1.0 / np.sqrt(np.mean(k64 * k64, axis=-1, keepdims=True) + eps32.astype(np.float64))
    inv_rms = np.where(mean_square32 + eps32 < SMALLEST_NORMAL_FP32, 0.0, inv_rms)
    return np.where(np.isfinite(mean_square32), inv_rms, np.nan)
