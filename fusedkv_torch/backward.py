"""The backward pass of the op: a Triton kernel over all layers in one launch, and the
differentiable registered op it serves (``fusedkv::fused_kv_norm_rope``, whose autograd
formula ``torch.library.register_autograd`` gives).

Per token ``t``, layer ``l`` and KV head ``h`` (CONTRACT.md, Gradients), in fp32::

    gn     = rope^T(g)                                  (the pair rotated back: sin negated)
    grad_x = r * (w*gn - x*r * mean(x*r * w*gn)),  r = rsqrt(mean(x*x) + eps[l])
    grad_w[l] += gn * x*r                              (summed over t and h)
    grad_v = g_v (times v_multiplier[l]);  grad_v_multiplier[l] += sum(v * g_v)

The kernel reads ``kv``, ``k``'s and ``v``'s gradients and writes ``kv``'s gradient once,
on the forward's tiles. The residuals are the forward's inputs alone: ``r`` is recomputed
from ``x``, which the kernel reads anyway, so keeping it would add a write and a read.
Each program writes its partial sums of the weight's and the multiplier's gradients to a
row of its own, which a small second reduction adds up: deterministic, unlike atomics.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fusedkv_torch.kernel import (
    _SHORT_CONTEXT_END,
    _inverse_rms,
    _layer_multiplier,
    _layer_table,
    _load_head_rows,
    _load_rotation_and_norm,
    _rotate,
    _store_head_rows,
    _store_rotary_halves,
    _strides,
    _tile_of_program,
    _v_to_destination,
    default_tile,
    launch,
    piece_blocks,
    tile_warps,
)
from fusedkv_torch.launcher import DirectLauncher
from interop.core.spec import FusedKVConfig


@triton.jit
def _normalized_grad(x_first, x_second, x_tail, gn_first, gn_second, gn_tail, w_first, w_second, w_tail,
                     inv_rms, weight_ptr, HEAD_DIM: tl.constexpr, TAIL_BLOCK: tl.constexpr):
    """``(grad_x pieces, x*r pieces)``: ``r * (w*gn - x*r * mean(x*r * w*gn))``, or, without a
    K-norm (``weight_ptr`` None; ``inv_rms`` 1, NaN without a rotation), ``gn * inv_rms``."""
    a_first, a_second, a_tail = gn_first * w_first, gn_second * w_second, gn_tail * w_tail
    n_first, n_second, n_tail = x_first * inv_rms, x_second * inv_rms, x_tail * inv_rms
    grad_first, grad_second, grad_tail = a_first * inv_rms, a_second * inv_rms, a_tail * inv_rms
    if weight_ptr is not None:
        dot = tl.sum(n_first * a_first, 2) + tl.sum(n_second * a_second, 2)
        if TAIL_BLOCK > 0:
            dot += tl.sum(n_tail * a_tail, 2)
        mean = (dot * (1.0 / HEAD_DIM))[:, :, None]
        grad_first = inv_rms * (a_first - n_first * mean)
        grad_second = inv_rms * (a_second - n_second * mean)
        grad_tail = inv_rms * (a_tail - n_tail * mean)
    return grad_first, grad_second, grad_tail, n_first, n_second, n_tail


@triton.jit
def _store_weight_partials(partial_ptr, counted, gn_first, gn_second, gn_tail, n_first, n_second, n_tail,
                           PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PAIRED_DIM: tl.constexpr, GPTJ: tl.constexpr):
    """This program's ``sum over its tokens and heads of gn * x*r`` into its ``[HEAD_DIM]`` row,
    over the head rows ``counted`` (the others' outputs do not depend on the weight)."""
    one = tl.zeros([1, 1, 1], tl.int64)
    first = tl.sum(tl.sum(tl.where(counted, gn_first * n_first, 0.0), 0, keep_dims=True), 1, keep_dims=True)
    second = tl.sum(tl.sum(tl.where(counted, gn_second * n_second, 0.0), 0, keep_dims=True), 1, keep_dims=True)
    _store_rotary_halves(partial_ptr + one, 1, first, second, one == 0, 1, 1, PAIR_BLOCK, PAIRED_DIM, GPTJ)
    if TAIL_BLOCK > 0:
        tail = tl.sum(tl.sum(tl.where(counted, gn_tail * n_tail, 0.0), 0, keep_dims=True), 1, keep_dims=True)
        tail_dims = PAIRED_DIM + tl.arange(0, TAIL_BLOCK)[None, None, :]
        tl.store(partial_ptr + tail_dims, tail, mask=tail_dims < HEAD_DIM)


@triton.jit(do_not_specialize=["total_ctx", "max_position", "n_tables"])
def _fused_kv_norm_rope_backward_kernel(
    # Tensors (None where a call has none), then sizes, then strides, then constexprs:
    # the order DirectLauncher expects.
    kv_ptr, k_norm_weight_ptr, eps_ptr, cos_sin_ptr, positions_ptr, v_multiplier_ptr, layer_rope_table_ptr,
    grad_k_ptr, grad_v_ptr, grad_kv_ptr, weight_partials_ptr, multiplier_partials_ptr,
    total_ctx, max_position, n_tables,
    kv_stride_t, kv_stride_l, kv_stride_d, weight_stride_l, weight_stride_d, eps_stride,
    cos_sin_stride_table, cos_sin_stride_p, cos_sin_stride_d, positions_stride, v_multiplier_stride,
    layer_rope_table_stride,
    gk_stride_l, gk_stride_t, gk_stride_h, gk_stride_d, gv_stride_l, gv_stride_t, gv_stride_h, gv_stride_d,
    grad_stride_t, grad_stride_l, grad_stride_d,
    N_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    GPTJ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    PAIRED_DIM: tl.constexpr, PAIR_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr, HEAD_BLOCK: tl.constexpr,
):
    """The gradients of one ``[BLOCK_T tokens, BLOCK_HEADS heads, head_dim]`` tile of one layer,
    on the forward kernel's tiles and grid; ``weight_partials`` and ``multiplier_partials``
    (None without a K-norm, a multiplier) get one row of this program's sums.
    ``layer_rope_table_ptr`` None: one cos/sin table for every layer."""
    layer, tokens, heads = _tile_of_program(total_ctx, N_LAYERS, NUM_HEADS, BLOCK_T, BLOCK_HEADS)
    pid = tl.program_id(0).to(tl.int64)
    in_context = tokens < total_ctx
    loaded = in_context[:, None, None]
    positions = tl.load(positions_ptr + tokens * positions_stride, mask=in_context, other=0).to(tl.int64)
    head_stride = HEAD_DIM * kv_stride_d
    kv_rows = kv_ptr + tokens[:, None, None] * kv_stride_t + layer * kv_stride_l
    x_first, x_second, x_tail = _load_head_rows(kv_rows + heads * head_stride, kv_stride_d, loaded, BLOCK_T,
                                                BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    g_rows = grad_k_ptr + layer * gk_stride_l + tokens[:, None, None] * gk_stride_t + heads * gk_stride_h
    g_first, g_second, g_tail = _load_head_rows(g_rows, gk_stride_d, loaded, BLOCK_T, BLOCK_HEADS, PAIR_BLOCK,
                                                TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    head_dims = tl.arange(0, HEAD_BLOCK)[None, None, :]
    v_mask = loaded & (head_dims < HEAD_DIM)
    g_v = tl.load(grad_v_ptr + layer * gv_stride_l + tokens[:, None, None] * gv_stride_t + heads * gv_stride_h
                  + head_dims * gv_stride_d, mask=v_mask, other=0.0)

    cos_sin_table, rotatable = _layer_table(cos_sin_ptr, layer_rope_table_ptr, layer, layer_rope_table_stride,
                                            cos_sin_stride_table, n_tables,
                                            (positions >= 0) & (positions < max_position))
    cos, sin, w_first, w_second, w_tail, eps = _load_rotation_and_norm(
        cos_sin_table, positions, in_context & rotatable, tokens, heads, cos_sin_stride_p, cos_sin_stride_d,
        k_norm_weight_ptr, layer, weight_stride_l, weight_stride_d, eps_ptr, eps_stride,
        BLOCK_T, BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, ROTARY_DIM, PAIRED_DIM, GPTJ, False)
    v_multiplier = _layer_multiplier(v_multiplier_ptr, layer, v_multiplier_stride)

    grad_rows = grad_kv_ptr + tokens[:, None, None] * grad_stride_t + layer * grad_stride_l
    grad_head_stride = HEAD_DIM * grad_stride_d
    grad_v = _v_to_destination(g_v, v_multiplier_ptr, v_multiplier, None, 1.0, 1.0, grad_kv_ptr.dtype.element_ty)
    tl.store(grad_rows + (NUM_HEADS + heads) * grad_head_stride + head_dims * grad_stride_d, grad_v, mask=v_mask)
    if v_multiplier_ptr is not None:
        v = tl.load(kv_rows + (NUM_HEADS + heads) * head_stride + head_dims * kv_stride_d, mask=v_mask, other=0.0)
        v_dot = tl.sum(tl.sum(tl.sum(v.to(tl.float32) * g_v.to(tl.float32), 2), 1), 0)
        tl.store(multiplier_partials_ptr + pid, v_dot)

    inv_rms = _inverse_rms(x_first, x_second, x_tail, eps, rotatable, k_norm_weight_ptr, HEAD_DIM, TAIL_BLOCK)
    # rope^T: the rotation by -angle.
    gn_first, gn_second = _rotate(g_first, g_second, cos, -sin, PAIR_BLOCK, ROTARY_DIM, PAIRED_DIM)
    grad_first, grad_second, grad_tail, n_first, n_second, n_tail = _normalized_grad(
        x_first, x_second, x_tail, gn_first, gn_second, g_tail, w_first, w_second, w_tail, inv_rms,
        k_norm_weight_ptr, HEAD_DIM, TAIL_BLOCK)
    _store_head_rows(grad_rows + heads * grad_head_stride, grad_stride_d, grad_first, grad_second, grad_tail, loaded,
                     None, 1.0, 1.0, BLOCK_T, BLOCK_HEADS, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM, PAIRED_DIM, GPTJ)
    if k_norm_weight_ptr is not None:
        _store_weight_partials(weight_partials_ptr + pid * HEAD_DIM, loaded & (inv_rms == inv_rms), gn_first,
                               gn_second, g_tail, n_first, n_second, n_tail, PAIR_BLOCK, TAIL_BLOCK, HEAD_DIM,
                               PAIRED_DIM, GPTJ)


_launcher = DirectLauncher(_fused_kv_norm_rope_backward_kernel)


def backward_tile(total_ctx: int, num_kv_heads: int, head_dim: int, *, interpret: bool = False) -> tuple[int, int, int]:
    """``(block_tokens, block_heads, num_warps)`` of the backward: 16 tokens of one head a
    program, over threads holding 32 elements of each row they read. A program reads K and
    its gradient and writes the gradient, so it wants more rows in flight than the forward's
    tiles of about 8, and rows of one head over 16 tokens ran faster than 4 tokens of 4 heads
    (BENCHMARKS.md, the backward); short contexts and the interpreter take the forward's."""
    if interpret or total_ctx < _SHORT_CONTEXT_END:
        return default_tile(total_ctx, num_kv_heads, head_dim, interpret=interpret)
    return 16, 1, tile_warps(16, head_dim, 1024)


def launch_backward(kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, v_multiplier,
                    layer_rope_table=None, *, config: FusedKVConfig, tile: tuple = (None, None, None)
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of a validated call, on ``kv``'s device: ``(grad_kv, grad_k_norm_weight,
    grad_v_multiplier)``, the last two empty (shape ``(0,)``) where the call has no K-norm,
    no multiplier. ``grad_k``/``grad_v``: ``[n_layers, total_ctx, heads, head_dim]``, any strides.
    ``layer_rope_table``: each layer's table in a 3-D ``cos_sin_cache``, as the forward's.
    ``tile``: ``(block_tokens, block_heads, num_warps)`` overrides for tuning, unchecked; None keeps the default."""
    total_ctx, n_layers, _ = kv.shape
    grad_kv = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    weight_shape, multiplier_shape = ((n_layers, config.head_dim) if k_norm_weight is not None else (0,),
                                      (n_layers,) if v_multiplier is not None else (0,))
    if total_ctx == 0 or n_layers == 0:
        return (grad_kv, kv.new_zeros(weight_shape, dtype=_weight_dtype(k_norm_weight)),
                kv.new_zeros(multiplier_shape, dtype=torch.float32))
    default = backward_tile(total_ctx, config.num_kv_heads, config.head_dim, interpret=_launcher.interpreted)
    block_tokens, block_heads, num_warps = (given or chosen for given, chosen in zip(tile, default))
    token_blocks, head_groups = -(-total_ctx // block_tokens), config.num_kv_heads // block_heads
    grid = token_blocks * n_layers * head_groups
    weight_partials = multiplier_partials = None
    if k_norm_weight is not None:
        weight_partials = torch.empty((grid, config.head_dim), dtype=torch.float32, device=kv.device)
    if v_multiplier is not None:
        multiplier_partials = torch.empty((grid,), dtype=torch.float32, device=kv.device)
    # The rotary pieces and the tail of every row: the forward's whole gptj rows were measured on the forward alone.
    constexprs = (n_layers, config.num_kv_heads, config.head_dim, config.rotary_dim, config.rope_style == "gptj",
                  block_tokens, block_heads, *piece_blocks(config))
    # One table is table 0 of one, as in the forward: its table stride is never used.
    table_strides = cos_sin_cache.stride() if layer_rope_table is not None else (1, *cos_sin_cache.stride())
    _launcher(
        grid,
        (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table, grad_k, grad_v, grad_kv,
         weight_partials, multiplier_partials),
        (total_ctx, cos_sin_cache.shape[-2], 1 if layer_rope_table is None else cos_sin_cache.shape[0]),
        (*kv.stride(), *_strides(k_norm_weight, 2), *_strides(eps, 1), *table_strides, *positions.stride(),
         *_strides(v_multiplier, 1), *_strides(layer_rope_table, 1), *grad_k.stride(), *grad_v.stride(),
         *grad_kv.stride()),
        constexprs, num_warps=num_warps)
    # The second reduction: each program's row, summed over the token blocks (the outer axis:
    # one pass down contiguous columns; two strided axes at once ran slower), then over the
    # head groups.
    grad_weight = kv.new_zeros(weight_shape, dtype=_weight_dtype(k_norm_weight))
    if weight_partials is not None:
        grad_weight = (weight_partials.view(token_blocks, -1).sum(0).view(n_layers, head_groups, -1).sum(1)
                       .to(grad_weight.dtype))
    grad_multiplier = kv.new_zeros(multiplier_shape, dtype=torch.float32)
    if multiplier_partials is not None:
        grad_multiplier = multiplier_partials.view(token_blocks, -1).sum(0).view(n_layers, head_groups).sum(1)
    return grad_kv, grad_weight, grad_multiplier


def _weight_dtype(k_norm_weight) -> torch.dtype:
    return torch.float32 if k_norm_weight is None else k_norm_weight.dtype


# The differentiable op: a functional twin of fusedkv::write_fused_kv_norm_rope (autograd
# formulas need an op that returns its outputs rather than writing given buffers).
@torch.library.custom_op("fusedkv::fused_kv_norm_rope", mutates_args=())
def _fused_kv_norm_rope(
    kv: torch.Tensor, k_norm_weight: Optional[torch.Tensor], eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, num_kv_heads: int, head_dim: int, rotary_dim: int,
    rope_style: str, block_tokens: Optional[int] = None, block_heads: Optional[int] = None,
    num_warps: Optional[int] = None, v_multiplier: Optional[torch.Tensor] = None,
    layer_rope_table: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    config = FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style)
    k_out, v_out = (kv.new_empty(config.output_shape(kv.shape[1], kv.shape[0])) for _ in range(2))
    if kv.shape[0] and kv.shape[1]:
        launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, config=config,
               v_multiplier=v_multiplier, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
               layer_rope_table=layer_rope_table)
    return k_out, v_out


@_fused_kv_norm_rope.register_fake
def _fused_kv_norm_rope_fake(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim,
                             rope_style, block_tokens=None, block_heads=None, num_warps=None, v_multiplier=None,
                             layer_rope_table=None):
    shape = (kv.shape[1], kv.shape[0], num_kv_heads, head_dim)
    return kv.new_empty(shape), kv.new_empty(shape)


@torch.library.custom_op("fusedkv::fused_kv_norm_rope_backward", mutates_args=())
def _fused_kv_norm_rope_backward(
    kv: torch.Tensor, k_norm_weight: Optional[torch.Tensor], eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
    num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str, v_multiplier: Optional[torch.Tensor] = None,
    layer_rope_table: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_kv, grad_k_norm_weight, grad_v_multiplier)`` (:func:`launch_backward`)."""
    return launch_backward(kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, v_multiplier,
                           layer_rope_table, config=FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style))


@_fused_kv_norm_rope_backward.register_fake
def _fused_kv_norm_rope_backward_fake(kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v,
                                      num_kv_heads, head_dim, rotary_dim, rope_style, v_multiplier=None,
                                      layer_rope_table=None):
    weight_shape = (kv.shape[1], head_dim) if k_norm_weight is not None else (0,)
    return (kv.new_empty(kv.shape), kv.new_empty(weight_shape, dtype=_weight_dtype(k_norm_weight)),
            kv.new_empty((kv.shape[1],) if v_multiplier is not None else (0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    kv, k_norm_weight, eps, cos_sin_cache, positions, *static = inputs
    ctx.static = tuple(static[:4])
    ctx.save_for_backward(kv, k_norm_weight, eps, cos_sin_cache, positions, *static[-2:])


def _backward(ctx, grad_k, grad_v):
    kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table = ctx.saved_tensors
    grad_kv, grad_weight, grad_multiplier = torch.ops.fusedkv.fused_kv_norm_rope_backward(
        kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, *ctx.static, v_multiplier,
        layer_rope_table)
    # One gradient per input: kv, k_norm_weight, eps, cos_sin_cache, positions, four static
    # arguments, three tile overrides, v_multiplier, layer_rope_table.
    return (grad_kv, None if k_norm_weight is None else grad_weight, None, None, None, *(None,) * 7,
            None if v_multiplier is None else grad_multiplier, None)


torch.library.register_autograd("fusedkv::fused_kv_norm_rope", _backward, setup_context=_setup_context)
fused_kv_norm_rope_op = torch.ops.fusedkv.fused_kv_norm_rope
