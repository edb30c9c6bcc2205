"""Every draft layer's K/V from the context hidden states: one GEMM, then one launch of the op.

``kv = ctx_hidden @ W^T`` with the K/V projection weights of all layers stacked, so
the GEMM's output ``[total_ctx, n_layers * 2*kv_size]`` reshapes (a bitcast in XLA) to
the op's ``kv: [total_ctx, n_layers, 2*kv_size]``; then :func:`fused_kv_norm_rope`
(RMSNorm and RoPE on K, V passed through) returns the result, hands it to a per-layer
callback, or :func:`fused_kv_norm_rope_into_cache` scatters it straight into a paged KV
cache, updating the donated cache buffers in place.

The materializer is a pytree (its arrays the leaves, its configuration static), so it
can be passed into ``jax.jit`` like any array; each method is itself jitted, so an
eager call is one dispatch. Host int64 positions and slots are narrowed to int32 as the
kernel does (out-of-range values kept out of range) before they reach jit, which
would wrap them. Nothing here reads a device value back to the host.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from fusedkv_jax.devices import devices_of, on_cpu
from fusedkv_jax.ops import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_jax.indices import narrow_for_jax
from interop.core.checkpoint import read_checkpoint_layers
from interop.core.materializer import (FP8_E4M3_MAX, MIN_ACTIVATION_AMAX, LayerKV, MaterializerConfig,
                                      stacked_rope_tables, validate_layers, validate_materialize)
from interop.core.spec import check_output_buffers


@jax.tree_util.register_pytree_node_class
class FusedKVMaterializer:
    """K and V of every draft layer: ``kv = ctx_hidden @ W^T``, then RMSNorm + RoPE on K.

    ``W`` stacks the layers' ``kv_proj_weight`` (each ``[2*kv_size, hidden]``, K rows then
    V rows) into ``[n_layers*2*kv_size, hidden]``, so that the GEMM's output reshapes to
    ``kv: dtype[total_ctx, n_layers, 2*kv_size]`` for free; ``dtype`` is the weights'.
    Layers with a ``kv_proj_bias`` have it added to the GEMM's output in the same jit
    (``kv = ctx_hidden @ W^T + b``), where XLA folds it into the GEMM.

    FP8 weights (float8_e4m3fn with a ``weight_scale``) give bfloat16 ``kv`` and results. On a
    CUDA device with FP8 tensor cores (compute capability 8.9 or later), with ``hidden`` and
    the stacked rows multiples of 16, the GEMM is a dot of FP8 operands accumulated in fp32,
    the activations quantized per token to float8_e4m3fn; elsewhere (a CPU, an older GPU)
    it is dequantize-then-GEMM: fp32 weights, an fp32 dot, rounded once.

    Args:
      layers: one :class:`~interop.core.materializer.LayerKV` per draft layer, holding
        jax (or NumPy) arrays; validated by
        :func:`~interop.core.materializer.validate_layers` (the first layer that
        differs from layer 0 is named).
      cos_sin_cache: optional fp32/bf16/fp16[max_position, rotary_dim] replacing the table that
        is otherwise built from the layers' ropes (one table per distinct rope: layers of
        another RoPE base or scaling get their own, in the same launch); or
        ``[n_tables, max_position, rotary_dim]`` with ``layer_rope_table``.
      layer_rope_table: int32[n_layers], each layer's table in a given 3-D ``cos_sin_cache``.
    """

    def __init__(self, layers: Sequence[LayerKV], *, cos_sin_cache: jax.Array | None = None,
                 layer_rope_table: jax.Array | None = None):
        layers = tuple(layers)
        self.config = validate_layers(layers, cos_sin_cache, layer_rope_table=layer_rope_table, accepted="jax")
        self.kv_proj_weight = jnp.concatenate([jnp.asarray(layer.kv_proj_weight) for layer in layers])
        self.kv_proj_bias = self.k_norm_weight = self.eps = self.v_multiplier = None  # a draft without them
        self.weight_scale = None
        if self.config.fp8_weights:
            self.weight_scale = jnp.concatenate([
                jnp.broadcast_to(jnp.asarray(layer.weight_scale, jnp.float32).reshape(-1),
                                 (layer.kv_proj_weight.shape[0],)) for layer in layers])
        if self.config.biased:
            self.kv_proj_bias = jnp.concatenate([jnp.asarray(layer.kv_proj_bias) for layer in layers])
        if self.config.normed:
            self.k_norm_weight = jnp.stack(
                [jnp.asarray(layer.k_norm_weight).astype(jnp.float32) for layer in layers])
            self.eps = jnp.asarray([float(layer.eps) for layer in layers], dtype=jnp.float32)
        if self.config.v_multiplied:
            self.v_multiplier = jnp.asarray([float(layer.v_multiplier) for layer in layers], dtype=jnp.float32)
        if cos_sin_cache is None:
            cos_sin_cache, layer_rope_table = stacked_rope_tables(layers)
        self.cos_sin_cache = jnp.asarray(cos_sin_cache)
        self.layer_rope_table = None if layer_rope_table is None else jnp.asarray(layer_rope_table)

    @classmethod
    def from_pretrained(cls, path, *, layers: Sequence[int] | None = None, dtype=None,
                        device: jax.Device | None = None, max_position: int | None = None) -> FusedKVMaterializer:
        """The materializer of a checkpoint's draft layers, read from a local directory.

        ``path`` holds ``config.json`` and ``*.safetensors``: a DFlash draft, or a Llama, Qwen2
        or Qwen3 decoder whose layers serve as draft layers
        (:func:`~interop.core.checkpoint.read_checkpoint_layers`: only the K/V projections,
        their biases and K-norm weights are read; nothing is downloaded).

        Args:
          layers: indices of the checkpoint's layers to use, in order; None: all.
          dtype: the weights' dtype (bf16, fp16 or fp32); None: the checkpoint's.
          device: the jax device whose arrays the materializer holds; None: the default device.
          max_position: rows of the rotary table; None: the config's ``max_position_embeddings``.

        A checkpoint that cannot be served as asked (a missing tensor, a shape that disagrees
        with the config, a RoPE type or quantization not supported) is refused with a
        ``ValueError`` naming the key and the file, before anything is put on the device.
        """
        host_layers = read_checkpoint_layers(path, layers=layers, dtype=dtype, max_position=max_position)
        # Every array the constructor makes (weights, eps, table) lands on the one device.
        with jax.default_device(device):
            return cls(host_layers)

    def tree_flatten(self):
        # The arrays with a row per stacked output row first: head-parallel sharding splits them.
        return (self.kv_proj_weight, self.kv_proj_bias, self.weight_scale, self.k_norm_weight, self.eps,
                self.cos_sin_cache, self.v_multiplier, self.layer_rope_table), self.config

    @classmethod
    def tree_unflatten(cls, config, leaves):
        materializer = object.__new__(cls)
        materializer.config = config
        (materializer.kv_proj_weight, materializer.kv_proj_bias, materializer.weight_scale, materializer.k_norm_weight,
         materializer.eps, materializer.cos_sin_cache, materializer.v_multiplier, materializer.layer_rope_table) = leaves
        return materializer

    def project(self, ctx_hidden: jax.Array) -> jax.Array:
        """``kv = ctx_hidden @ W^T (+ b)``: dtype[total_ctx, n_layers, 2*kv_size].

        ``ctx_hidden: float[total_ctx, hidden]``, cast once to the weights' dtype.
        """
        validate_materialize(ctx_hidden, self.config, None, accepted="jax")
        return _project(self, ctx_hidden, fp8_gemm=_fp8_gemm(self.config, ctx_hidden))

    def materialize(
        self,
        ctx_hidden: jax.Array,
        positions: jax.Array,
        *,
        max_position: int | None = None,
        lowering: str | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """``fused_kv_norm_rope(ctx_hidden @ W^T, ...)`` for all layers.

        Args:
          ctx_hidden: float[total_ctx, hidden].
          positions: int32/int64[total_ctx]; a position outside the cos/sin table
            gives a NaN K row, never a read outside it.
          max_position: optional bound on the positions, checked against the table's
            rows on the host (the positions themselves are never read back).
          lowering: the op's Pallas lowering, as for :func:`fused_kv_norm_rope`.

        Returns:
          ``(k, v)``, each dtype[n_layers, total_ctx, num_kv_heads, head_dim].
        """
        validate_materialize(ctx_hidden, self.config, max_position, accepted="jax",
                             arrays=(("positions", positions),))
        return _materialize(self, ctx_hidden, narrow_for_jax(positions), interpret=on_cpu(ctx_hidden),
                            fp8_gemm=_fp8_gemm(self.config, ctx_hidden), lowering=lowering)

    def materialize_layers(
        self,
        ctx_hidden: jax.Array,
        positions: jax.Array,
        write_layer_kv: Callable[[int, jax.Array, jax.Array], None],
        *,
        max_position: int | None = None,
        lowering: str | None = None,
    ) -> None:
        """:meth:`materialize`, handing each layer's result to ``write_layer_kv(layer, k, v)``.

        ``k, v: dtype[total_ctx, num_kv_heads, head_dim]``. Under ``jax.jit`` the callback
        runs while tracing and receives tracers, so it must return what it makes (e.g.
        into a list the traced function returns) rather than mutate buffers.
        """
        k, v = self.materialize(ctx_hidden, positions, max_position=max_position, lowering=lowering)
        for layer in range(self.config.n_layers):
            write_layer_kv(layer, k[layer], v[layer])

    def materialize_into_cache(
        self,
        ctx_hidden: jax.Array,
        positions: jax.Array,
        cache_loc: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        *,
        k_scale: jax.Array | None = None,
        v_scale: jax.Array | None = None,
        max_position: int | None = None,
        lowering: str | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """:meth:`materialize` scattered into a paged KV cache in one launch, no temporary
        (on the Triton lowering; see :func:`fused_kv_norm_rope_into_cache` for Mosaic GPU's).

        Token ``t``'s K and V of every layer go to slot ``cache_loc[t]``; slots outside
        ``[0, num_slots)`` (negative ones: padding) keep their contents; slots inside it
        must be distinct (CONTRACT.md). ``k_cache`` and ``v_cache`` are donated and
        updated in place: use the returned arrays (inside your own ``jax.jit``, donate
        them there to keep the update in place).

        Args (beyond :meth:`materialize`'s):
          cache_loc: int32/int64[total_ctx].
          k_cache, v_cache: dtype or float8_e4m3fn[n_layers, num_slots, num_kv_heads,
            head_dim], one array each (per-layer lists are refused: stacking them would
            copy the whole pool on every call).
          k_scale, v_scale: fp32[n_layers], only for float8_e4m3fn caches (stored: value / scale).
          lowering: as for :meth:`materialize`.

        Returns:
          The updated ``(k_cache, v_cache)``.
        """
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(cache, (list, tuple)):
                raise ValueError(
                    f"Invalid {name} for fused KV materialization: got a list of per-layer "
                    "caches, expected one [n_layers, num_slots, num_kv_heads, head_dim] array "
                    "(stacking per-layer arrays would copy the whole pool on every call)."
                )
        caches = (("k_cache", k_cache), ("v_cache", v_cache))
        validate_materialize(ctx_hidden, self.config, max_position, accepted="jax",
                             arrays=(("positions", positions), ("cache_loc", cache_loc), *caches,
                                     ("k_scale", k_scale), ("v_scale", v_scale)))
        # Before jit, where one array passed twice becomes two tracers (and two donations).
        check_output_buffers(None, caches)
        return _materialize_into_cache(
            self, ctx_hidden, narrow_for_jax(positions),
            narrow_for_jax(cache_loc), k_cache, v_cache, k_scale, v_scale, interpret=on_cpu(ctx_hidden),
            fp8_gemm=_fp8_gemm(self.config, ctx_hidden), lowering=lowering)


def _fp8_gemm(config: MaterializerConfig, ctx_hidden) -> bool:
    """Whether the FP8 weights' GEMM runs on FP8 tensor cores: a CUDA device of compute
    capability 8.9 or later where ``ctx_hidden`` lives (the default backend's, for a tracer),
    and sizes such a GEMM takes. Decided before jit, as ``interpret`` is."""
    if not config.fp8_gemm_shapes:
        return False
    devices = devices_of(ctx_hidden) or jax.devices()[:1]
    return all(device.platform == "gpu" and _capability(device) >= 8.9 for device in devices)


def _capability(device) -> float:
    try:  # CUDA devices name theirs as "9.0"; a ROCm one ("gfx942") has no FP8 of this format
        return float(getattr(device, "compute_capability", 0))
    except ValueError:
        return 0.0


def _fp8_projection(ctx_hidden, weight, weight_scale, bias, fp8_gemm: bool) -> jax.Array:
    """``ctx_hidden @ (weight * weight_scale)^T (+ bias)`` for float8_e4m3fn weights, bfloat16.

    With ``fp8_gemm``: a dot of FP8 operands accumulated in fp32, the activations quantized
    per token (as :func:`~interop.core.materializer.quantize_per_token`), both scales applied
    after it; differentiated, dequantize-then-GEMM, forward and backward, as torch's
    materializer does (the quantization has no useful derivative). Otherwise
    dequantize-then-GEMM: fp32 weights, an fp32 dot (at full precision, not TF32). Either
    rounds once, to bfloat16.
    """
    if fp8_gemm:
        return _fp8_tensor_core_projection(ctx_hidden, weight, weight_scale, bias)
    return _dequantized_projection(ctx_hidden, weight, weight_scale, bias)


def _dequantized_projection(ctx_hidden, weight, weight_scale, bias) -> jax.Array:
    hidden = ctx_hidden.astype(jnp.bfloat16).astype(jnp.float32)
    kv = jnp.dot(hidden, (weight.astype(jnp.float32) * weight_scale[:, None]).T, precision=jax.lax.Precision.HIGHEST)
    return (kv if bias is None else kv + bias.astype(jnp.float32)).astype(jnp.bfloat16)


@jax.custom_vjp
def _fp8_tensor_core_projection(ctx_hidden, weight, weight_scale, bias) -> jax.Array:
    hidden = ctx_hidden.astype(jnp.bfloat16).astype(jnp.float32)
    inverse = FP8_E4M3_MAX / jnp.maximum(jnp.max(jnp.abs(hidden), axis=1, keepdims=True), MIN_ACTIVATION_AMAX)
    codes = (hidden * inverse).astype(jnp.float8_e4m3fn)
    products = jax.lax.dot_general(codes, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    kv = products * (1 / inverse) * weight_scale
    return (kv if bias is None else kv + bias.astype(jnp.float32)).astype(jnp.bfloat16)


def _differentiated_fp8_projection(ctx_hidden, weight, weight_scale, bias):
    return jax.vjp(_dequantized_projection, ctx_hidden, weight, weight_scale, bias)


_fp8_tensor_core_projection.defvjp(_differentiated_fp8_projection, lambda vjp, cotangent: vjp(cotangent))


@functools.partial(jax.jit, static_argnames=("fp8_gemm",))
def _project(materializer: FusedKVMaterializer, ctx_hidden: jax.Array, *, fp8_gemm: bool) -> jax.Array:
    weight = materializer.kv_proj_weight
    if materializer.config.fp8_weights:
        kv = _fp8_projection(ctx_hidden, weight, materializer.weight_scale, materializer.kv_proj_bias, fp8_gemm)
    else:
        # Full precision: XLA would otherwise run an fp32 dot on a GPU's TF32 tensor cores (torch does not).
        kv = jnp.dot(ctx_hidden.astype(weight.dtype), weight.T, precision=jax.lax.Precision.HIGHEST)
        if materializer.kv_proj_bias is not None:
            kv = kv + materializer.kv_proj_bias
    return kv.reshape(materializer.config.kv_shape(ctx_hidden.shape[0]))


def _op_arrays(materializer: FusedKVMaterializer, ctx_hidden: jax.Array, positions: jax.Array, fp8_gemm: bool):
    return (_project(materializer, ctx_hidden, fp8_gemm=fp8_gemm), materializer.k_norm_weight, materializer.eps,
            materializer.cos_sin_cache, positions)


# ``interpret`` is decided before jit, from where ``ctx_hidden`` lives: inside, the kernel
# sees tracers, which have no device, and would follow the default backend instead.
@functools.partial(jax.jit, static_argnames=("interpret", "fp8_gemm", "lowering"))
def _materialize(materializer, ctx_hidden, positions, *, interpret, fp8_gemm, lowering):
    return fused_kv_norm_rope(*_op_arrays(materializer, ctx_hidden, positions, fp8_gemm),
                              **materializer.config.op_kwargs(), v_multiplier=materializer.v_multiplier,
                              interpret=interpret, lowering=lowering, layer_rope_table=materializer.layer_rope_table)


@functools.partial(jax.jit, donate_argnames=("k_cache", "v_cache"),
                   static_argnames=("interpret", "fp8_gemm", "lowering"))
def _materialize_into_cache(materializer, ctx_hidden, positions, cache_loc, k_cache, v_cache,
                            k_scale, v_scale, *, interpret, fp8_gemm, lowering):
    return fused_kv_norm_rope_into_cache(
        *_op_arrays(materializer, ctx_hidden, positions, fp8_gemm), cache_loc, k_cache, v_cache,
        **materializer.config.op_kwargs(), k_scale=k_scale, v_scale=v_scale, v_multiplier=materializer.v_multiplier,
        interpret=interpret, lowering=lowering, layer_rope_table=materializer.layer_rope_table)
