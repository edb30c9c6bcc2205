"""The backward pass of the op: a ``jax.custom_vjp`` around the Pallas kernel's launch, whose
backward is one Pallas kernel over all layers.

Per token ``t``, layer ``l`` and KV head ``h`` (CONTRACT.md, Gradients), in fp32::

    gn     = rope^T(g)                                  (the pair rotated back: sin negated)
    grad_x = r * (w*gn - x*r * mean(x*r * w*gn)),  r = rsqrt(mean(x*x) + eps[l])
    grad_w[l] += gn * x*r                              (summed over t and h)
    grad_v = g_v (times v_multiplier[l]);  grad_v_multiplier[l] += sum(v * g_v)

The residuals are the forward's inputs alone: ``r`` is recomputed from ``x``, which the
backward reads anyway, so keeping it would add a write and a read. Each program writes
its partial sums of the weight's and the multiplier's gradients to a row of its own,
summed by jnp after the kernel: deterministic, unlike atomics. ``eps``, ``cos_sin_cache``,
``positions`` and given ``k_out``/``v_out`` (overwritten whole) get zero cotangents.

The backward runs on the forward's tiles over half the forward's threads (each holds 16
elements of a tile, the fastest in a sweep of tiles on the H200), K loaded as whole rows
and again at permuted columns for each element's RoPE partner (the forward's
:class:`~fusedkv_jax.kernel._KRows`), in every form. Under a jit sharded by XLA its one
``pallas_call`` is not partitioned (inside ``jax.shard_map`` each device runs it on its own
tokens). The Mosaic GPU lowering's forward has a Mosaic GPU backward of its own
(:mod:`fusedkv_jax.mosaic_backward`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fusedkv_jax import mosaic_backward, mosaic_kernel
from fusedkv_jax.kernel import (
    _KRows,
    _head_rows,
    _inverse_rms,
    _launch,
    _layer_value,
    _load,
    _load_head_rows,
    _load_norm_weight,
    _rope_of_layers,
    _store,
    _varying_axes,
)
from interop.core.spec import FusedKVConfig


def _normalized_grad(x, gn, weight, inv_rms, eps, head_dim: int):
    """``(grad_x, x*r)``: ``r * (w*gn - x*r * mean(x*r * w*gn))``, or, without a K-norm
    (``eps`` None; ``inv_rms`` 1, NaN without a rotation), ``gn * inv_rms``."""
    normed = x * inv_rms
    if eps is None:
        return gn * inv_rms, normed
    weighted = gn * weight
    mean = jnp.sum(normed * weighted, axis=-1, keepdims=True) / head_dim
    return inv_rms * (weighted - normed * mean), normed


def _column_sums(values, counted):
    """``values`` summed over a tile's tokens and heads where ``counted``: ``[columns]``."""
    return jnp.sum(jnp.where(counted, values, 0.0), axis=(0, 1))


def _backward_kernel(kv_ref, cos_sin_ref, positions_ref, grad_k_ref, grad_v_ref, weight_ref, eps_ref,
                     v_multiplier_ref, layer_rope_table_ref, grad_kv_ref, weight_partials_ref,
                     multiplier_partials_ref, *,
                     num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str,
                     block_tokens: int, block_heads: int):
    """The gradients of one ``[block_tokens, block_heads, head_dim]`` tile of one layer.

    Refs are whole arrays: the forward's inputs, ``grad_k, grad_v[n_layers, total_ctx,
    heads, head_dim]``, ``grad_kv`` as ``kv``, and the partial sums ``[token blocks,
    n_layers, head blocks, head_dim]`` (None without a K-norm, a multiplier; and
    ``layer_rope_table`` None for one cos/sin table).
    """
    layer = pl.program_id(1)
    tokens = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    heads = pl.program_id(2) * block_heads + jnp.arange(block_heads)
    in_context = tokens < kv_ref.shape[0]
    head_rows = _head_rows(tokens, heads, in_context, num_kv_heads, head_dim)
    positions = _load(positions_ref.at[tokens], mask=in_context, other=0)
    form = _KRows(head_dim, rotary_dim, rope_style)
    (dims, dims_ok), (partner, _) = form.pieces
    x = _load_head_rows(kv_ref, head_rows, layer, dims, dims_ok).astype(jnp.float32)
    g = [_load(grad_k_ref.at[layer, head_rows.tokens, heads[None, :, None], columns[None, None, :]],
               mask=head_rows.loaded & dims_ok[None, None, :], other=0.0).astype(jnp.float32)
         for columns in (dims, partner)]
    rotatable = (positions >= 0) & (positions < cos_sin_ref.shape[-2])
    layer_rope = _rope_of_layers(cos_sin_ref, layer_rope_table_ref, positions, in_context, rotatable,
                                 functools.partial(form.frequencies, head_dim, rotary_dim, rope_style), 1)
    cos, sin, rotatable = layer_rope(layer)
    eps = _layer_value(eps_ref, layer)
    inv_rms = _inverse_rms(jnp.sum(x * x, axis=-1, keepdims=True), eps, head_dim, rotatable)
    # rope^T: the rotation by -angle.
    [(_, gn, _)] = form.rope(g, (1.0, 1.0), 1.0, cos, -sin)
    weight = _load_norm_weight(weight_ref, layer, dims, dims_ok)
    grad_x, normed = _normalized_grad(x, gn, weight, inv_rms, eps, head_dim)
    kv_columns = head_rows.starts + dims[None, None, :]
    written = head_rows.loaded & dims_ok[None, None, :]
    _store(grad_kv_ref.at[head_rows.tokens, layer, kv_columns], grad_x, mask=written)

    g_v = _load(grad_v_ref.at[layer, head_rows.tokens, heads[None, :, None], dims[None, None, :]], mask=written,
                other=0.0)
    partial_row = (pl.program_id(0), layer, pl.program_id(2), dims)
    if v_multiplier_ref is not None:
        v = _load_head_rows(kv_ref, head_rows, layer, kv_ref.shape[2] // 2 + dims, dims_ok)
        _store(multiplier_partials_ref.at[partial_row],
               _column_sums(v.astype(jnp.float32) * g_v.astype(jnp.float32), written), mask=dims_ok)
        g_v = g_v.astype(jnp.float32) * _layer_value(v_multiplier_ref, layer)
    _store(grad_kv_ref.at[head_rows.tokens, layer, kv_ref.shape[2] // 2 + kv_columns], g_v, mask=written)
    if eps is not None:
        # A head whose output the forward poisons (NaN r) does not depend on the weight.
        _store(weight_partials_ref.at[partial_row], _column_sums(gn * normed, written & (inv_rms == inv_rms)),
               mask=dims_ok)


_ELEMENTS_PER_THREAD = 16


def backward_tile(block_tokens: int, block_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(block_tokens, block_heads, num_warps)`` of the backward of a call whose forward ran on
    ``block_tokens x block_heads`` tiles: those tiles, over threads holding 16 of their elements
    each. A thread of the backward reads K and its gradient and keeps both, so it takes more
    elements than the forward's."""
    elements = block_tokens * block_heads * pl.next_power_of_2(head_dim)
    return block_tokens, block_heads, max(1, min(8, elements // (32 * _ELEMENTS_PER_THREAD)))


# Jitted: a jit of many backward calls then traces and lowers the kernel once.
@functools.partial(jax.jit, static_argnames=("config", "block_tokens", "block_heads", "num_warps", "interpret"))
def _pallas_backward(kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, grad_k, grad_v,
                     layer_rope_table=None, *, config: FusedKVConfig, block_tokens: int, block_heads: int,
                     num_warps: int, interpret: bool):
    """``(grad_kv, grad_k_norm_weight, grad_v_multiplier)``, the last two None without a K-norm,
    a multiplier: the kernel on the forward's tiles, then its partial sums added up."""
    total_ctx, n_layers, _ = kv.shape
    grid = (pl.cdiv(total_ctx, block_tokens), n_layers, pl.cdiv(config.num_kv_heads, block_heads))
    inputs = (kv, cos_sin_cache, positions, grad_k, grad_v, k_norm_weight, eps, v_multiplier, layer_rope_table)
    varying = _varying_axes([a for a in inputs if a is not None])
    partials = jax.ShapeDtypeStruct((*grid, config.head_dim), jnp.float32, manual_axis_type=varying)
    out_shape = (jax.ShapeDtypeStruct(kv.shape, kv.dtype, manual_axis_type=varying),
                 None if k_norm_weight is None else partials, None if v_multiplier is None else partials)
    kernel = functools.partial(
        _backward_kernel, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, block_tokens=block_tokens,
        block_heads=block_heads)
    grad_kv, weight_partials, multiplier_partials = pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid, compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret, name="fused_kv_norm_rope_backward",
    )(*inputs)
    grad_weight = grad_multiplier = None
    if weight_partials is not None:
        grad_weight = weight_partials.sum(axis=(0, 2)).astype(k_norm_weight.dtype)
    if multiplier_partials is not None:
        grad_multiplier = multiplier_partials.sum(axis=(0, 2, 3))
    return grad_kv, grad_weight, grad_multiplier


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_launch(options: tuple, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest,
                          v_multiplier, layer_rope_table):
    """:func:`fusedkv_jax.kernel._launch` of a call without a cache, differentiable:
    ``options`` are its static arguments as ``tuple(dict.items())``."""
    return _launch(kv, k_norm_weight, eps, cos_sin_cache, positions, None, k_dest, v_dest, None, None,
                   v_multiplier, layer_rope_table, **dict(options))


def _forward(options, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, v_multiplier,
             layer_rope_table):
    outputs = _differentiable_launch(options, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest,
                                    v_multiplier, layer_rope_table)
    return outputs, (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table)


def _backward(options, residuals, cotangents):
    options = dict(options)
    block_tokens, block_heads, num_warps = backward_tile(
        options["block_tokens"], options["block_heads"], options["config"].head_dim)
    static = dict(config=options["config"], block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
                  interpret=options["interpret"])
    return _cotangents(_first_order_backward, static, residuals, cotangents)


def _cotangents(first_order_backward, static: dict, residuals, cotangents) -> tuple:
    """The launch's cotangents from ``first_order_backward`` (with its ``static`` arguments)
    on the forward's residuals and the outputs' cotangents, in ``kv``'s dtype."""
    kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table = residuals
    grad_k, grad_v = cotangents
    grad_kv, grad_weight, grad_multiplier = first_order_backward(
        tuple(static.items()), kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier,
        grad_k.astype(kv.dtype), grad_v.astype(kv.dtype), layer_rope_table)
    # None: a zero cotangent (eps, the tables, positions, outputs the forward overwrote whole, the tables' index).
    return grad_kv, grad_weight, None, None, None, None, None, grad_multiplier, None


_differentiable_launch.defvjp(_forward, _backward)


def refusing_derivatives(function, names: tuple, got: str, expected: str):
    """``function(static, *arrays)`` behind a ``jax.custom_jvp`` whose derivative raises the
    project's ``TypeError``, naming the first of ``names`` that is differentiated, instead of
    letting jax differentiate what it cannot and fail inside; jitted, as
    this module's launches are, so an eager call traces it once per shape."""
    wrapped = jax.custom_jvp(function, nondiff_argnums=(0,))

    def refuse(static, primals, tangents):
        name = next(name for name, tangent in zip(names, tangents)
                    if not isinstance(tangent, jax.custom_derivatives.SymbolicZero))
        raise TypeError(f"Invalid {name} for fused KV materialization: got {got}, expected {expected}.")

    wrapped.defjvp(refuse, symbolic_zeros=True)
    return jax.jit(wrapped, static_argnums=0)


def _first_order(backward_kernel):
    """``backward_kernel(*arrays, **static)`` as ``function(static, *arrays)``, which a second
    derivative refuses: autodiff of its kernel would fail inside jax."""
    return refusing_derivatives(
        lambda static, *arrays: backward_kernel(*arrays, **dict(static)),
        ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "v_multiplier", "grad_k", "grad_v",
         "layer_rope_table"),
        got="a second derivative through the op (jax.grad of jax.grad, jax.hessian)",
        expected="first-order gradients (its backward kernel has no derivative of its own: differentiate a "
                 "plain-array formulation for higher orders)")


# The kernels looked up by name at each trace, as a call of them would be.
_first_order_backward = _first_order(lambda *arrays, **static: _pallas_backward(*arrays, **static))
_first_order_mosaic_backward = _first_order(lambda *arrays, **static: mosaic_backward.backward(*arrays, **static))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_mosaic_launch(options: tuple, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest,
                                  v_multiplier, layer_rope_table):
    """:func:`fusedkv_jax.mosaic_kernel.launch`, differentiable: its backward is
    :mod:`fusedkv_jax.mosaic_backward`'s kernel."""
    options = dict(options)
    return mosaic_kernel.launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, v_multiplier,
                                layer_rope_table, config=options["config"], interpret=options["interpret"])


def _mosaic_forward(options, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest, v_dest, v_multiplier,
                    layer_rope_table):
    outputs = _differentiable_mosaic_launch(options, kv, k_norm_weight, eps, cos_sin_cache, positions, k_dest,
                                            v_dest, v_multiplier, layer_rope_table)
    return outputs, (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table)


def _mosaic_backward(options, residuals, cotangents):
    options = dict(options)
    static = dict(config=options["config"], interpret=options["interpret"])
    return _cotangents(_first_order_mosaic_backward, static, residuals, cotangents)


_differentiable_mosaic_launch.defvjp(_mosaic_forward, _mosaic_backward)

# Jitted: called eagerly, a custom_vjp traces its function on every call; a jit once per shape.
differentiable_launch = jax.jit(_differentiable_launch, static_argnums=0)
differentiable_mosaic_launch = jax.jit(_differentiable_mosaic_launch, static_argnums=0)
