"""The op written as a model author would write it, in plain PyTorch and in jnp: the baselines.

Both compute the reference's math (fp32, one rounding at the end) with the framework's
own ops; ``torch.compile`` and ``jax.jit`` fuse them as they can. They are what the
kernels are measured against, not references: every benchmark checks them against
:func:`interop.core.reference.fused_kv_norm_rope_reference` like any other implementation.
Positions must lie inside the cos/sin table (the op's NaN row for one outside it is
not modelled: torch's indexing raises, jnp's clamps); the benchmarks draw them so.
"""

from __future__ import annotations

from interop.core.spec import FusedKVConfig


def torch_reference_math(kv, k_norm_weight, eps, cos_sin_cache, positions, *, config: FusedKVConfig):
    """The op in plain PyTorch ops: ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, heads, head_dim]."""
    import torch

    total_ctx, n_layers, _ = kv.shape
    heads, dim, rotary_dim = config.num_kv_heads, config.head_dim, config.rotary_dim
    half = rotary_dim // 2
    k = kv[:, :, :config.kv_size].float().reshape(total_ctx, n_layers, heads, dim)
    k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps[None, :, None, None])
    k = k * k_norm_weight.float()[None, :, None, :]
    rows = cos_sin_cache[positions.long()]
    cos, sin = rows[:, None, None, :half], rows[:, None, None, half:rotary_dim]
    if config.rope_style == "neox":
        first, second = k[..., :half], k[..., half:rotary_dim]
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    else:
        first, second = k[..., 0:rotary_dim:2], k[..., 1:rotary_dim:2]
        rotated = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=-1).flatten(-2)
    k = torch.cat([rotated, k[..., rotary_dim:]], dim=-1)
    k_out = k.to(kv.dtype).transpose(0, 1).contiguous()
    v_out = kv[:, :, config.kv_size:].reshape(total_ctx, n_layers, heads, dim).transpose(0, 1).contiguous()
    return k_out, v_out


def jnp_reference_math(kv, k_norm_weight, eps, cos_sin_cache, positions, *, config: FusedKVConfig):
    """The op in plain jnp ops: ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, heads, head_dim]."""
    import jax
    import jax.numpy as jnp

    total_ctx, n_layers, _ = kv.shape
    heads, dim, rotary_dim = config.num_kv_heads, config.head_dim, config.rotary_dim
    half = rotary_dim // 2
    k = kv[:, :, :config.kv_size].astype(jnp.float32).reshape(total_ctx, n_layers, heads, dim)
    k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + eps[None, :, None, None])
    k = k * k_norm_weight.astype(jnp.float32)[None, :, None, :]
    rows = cos_sin_cache[positions]
    cos, sin = rows[:, None, None, :half], rows[:, None, None, half:rotary_dim]
    if config.rope_style == "neox":
        first, second = k[..., :half], k[..., half:rotary_dim]
        rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    else:
        first, second = k[..., 0:rotary_dim:2], k[..., 1:rotary_dim:2]
        rotated = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
        rotated = rotated.reshape(*rotated.shape[:-2], rotary_dim)
    k = jnp.concatenate([rotated, k[..., rotary_dim:]], axis=-1)
    k_out = k.astype(kv.dtype).transpose(1, 0, 2, 3)
    v_out = kv[:, :, config.kv_size:].reshape(total_ctx, n_layers, heads, dim).transpose(1, 0, 2, 3)
    return k_out, v_out
