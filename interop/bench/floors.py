"""The floors of the Pallas kernel: its data movement alone, measured as the kernel is.

A bandwidth bar the kernel misses is judged against what moving its bytes costs in the
same form: the same lowering (Triton), default tile and grid (programs that take every
layer where the kernel's do, ``fusedkv_jax.kernel.loops_over_layers``, with as many
layers' loads in flight), indexed loads and masked stores, with none of the op's work.
:func:`copy_kernel` copies K and V of ``kv`` into ``k_out``/``v_out`` unchanged; with
``cos_sin=True`` it also loads each token's position and cos/sin row in the kernel's
indexed form (added to K times zero, which the compiler must keep: ``0 * x`` is not
``0`` for every float). Where the copy runs at the copy's speed and the kernel does not,
the gap is the kernel's work, not the layout or the lowering. The ``cos_sin`` variant
locates that work rather than bounding it: it loads the rows once a program, after
issuing the first layers' K and V, as the kernel does (the kernel issues its positions
load before those; this floor after them, a few instructions later).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu



def copy_kernel(kv_ref, cos_sin_ref, positions_ref, k_dest_ref, v_dest_ref, k_out_ref, v_out_ref, *,
                num_kv_heads: int, head_dim: int, block_tokens: int, block_layers: int, layers_in_flight: int,
                block_heads: int, cos_sin: bool):
    """One ``[block_tokens, block_heads, head_dim]`` tile of K and of V copied for each of
    ``block_layers`` layers, later layers' loads issued before a layer's stores as the
    kernel issues them."""
    total_ctx = kv_ref.shape[0]
    first_layer = pl.program_id(1) * block_layers
    tokens = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    heads = pl.program_id(2) * block_heads + jnp.arange(block_heads)
    columns = jnp.arange(pl.next_power_of_2(head_dim))
    token_ok = tokens < total_ctx
    ok = token_ok[:, None, None] & (heads < num_kv_heads)[None, :, None] & (columns < head_dim)[None, None, :]
    token_index, head_index, column_index = tokens[:, None, None], heads[None, :, None], columns[None, None, :]

    def load_layer(layer):
        return layer, [plgpu.load(kv_ref.at[token_index, layer, offset + head_index * head_dim + column_index],
                                  mask=ok, other=0.0) for offset in (0, num_kv_heads * head_dim)]

    in_flight = [load_layer(first_layer + i) for i in range(min(layers_in_flight, block_layers))]
    table = None
    if cos_sin:
        half = cos_sin_ref.shape[1] // 2
        frequencies = jnp.arange(pl.next_power_of_2(half))
        row = plgpu.load(positions_ref.at[tokens], mask=token_ok, other=0)[:, None]
        frequency_ok = (frequencies < half)[None, :]
        cos = plgpu.load(cos_sin_ref.at[row, frequencies[None, :]], mask=frequency_ok, other=0.0)
        sin = plgpu.load(cos_sin_ref.at[row, half + frequencies[None, :]], mask=frequency_ok, other=0.0)
        table = jnp.sum(cos, axis=1) + jnp.sum(sin, axis=1)
    for layer_in_block in range(block_layers):
        layer, (k, v) = in_flight.pop(0)
        if layer_in_block + layers_in_flight < block_layers:
            in_flight.append(load_layer(first_layer + layer_in_block + layers_in_flight))
        if table is not None:
            k = k.astype(jnp.float32) + 0.0 * table[:, None, None]
        for value, out_ref in ((k, k_out_ref), (v, v_out_ref)):
            plgpu.store(out_ref.at[layer, token_index, head_index, column_index], value.astype(out_ref.dtype),
                        mask=ok)


# Jitted, as the kernel's launch is: a jit of many calls then traces and lowers one of them.
@functools.partial(jax.jit, static_argnames=("num_kv_heads", "head_dim", "rotary_dim", "rope_style", "cos_sin"))
def copy(kv, cos_sin_cache, positions, k_dest, v_dest, *, num_kv_heads: int, head_dim: int, rotary_dim: int,
         rope_style: str, cos_sin: bool):
    """``k_dest``/``v_dest`` (aliased, so donated ones are written in place) holding K and V
    of ``kv`` as ``[n_layers, total_ctx, num_kv_heads, head_dim]``, in the production
    kernel's default tile and grid, its programs taking every layer where the kernel's
    do (interpreted where ``kv`` is on the CPU, as the kernel is)."""
    from fusedkv_jax import devices
    from fusedkv_jax import kernel as pallas_kernel

    total_ctx, n_layers, _ = kv.shape
    interpret = devices.on_cpu(kv)
    block_tokens, block_heads, num_warps = pallas_kernel.default_tile(
        total_ctx, n_layers, num_kv_heads, head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        itemsize=kv.dtype.itemsize, interpret=interpret)
    looped = pallas_kernel.loops_over_layers(total_ctx, n_layers, num_kv_heads, head_dim, interpret=interpret)
    block_layers = n_layers if looped else 1
    kernel = functools.partial(copy_kernel, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_tokens=block_tokens, block_layers=block_layers,
                               layers_in_flight=pallas_kernel.LAYERS_IN_FLIGHT, block_heads=block_heads,
                               cos_sin=cos_sin)
    return pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(k_dest.shape, k_dest.dtype)] * 2,
        grid=(pl.cdiv(total_ctx, block_tokens), n_layers // block_layers, pl.cdiv(num_kv_heads, block_heads)),
        input_output_aliases={3: 0, 4: 1}, compiler_params=plgpu.CompilerParams(num_warps=num_warps),
        interpret=interpret, name="fused_kv_floor")(kv, cos_sin_cache, positions, k_dest, v_dest)
