"""Every draft layer's K/V from the context hidden states: one GEMM, then one launch of the op.

``kv = ctx_hidden @ W^T`` with the K/V projection weights of all layers stacked, so
the GEMM's output ``[total_ctx, n_layers * 2*kv_size]`` is, without a copy, the op's
``kv: [total_ctx, n_layers, 2*kv_size]``; then the op of ``fusedkv_torch.ops``
(RMSNorm and RoPE on K, V passed through) returns the result, hands it to a per-layer
callback, or scatters it straight into a paged KV cache.

The GEMM writes into a workspace owned by the materializer, grown when a call needs
more and otherwise reused; :meth:`FusedKVMaterializer.reserve` sizes it ahead of
CUDA-graph capture, after which no call allocates (but :meth:`materialize` without
``k_out``/``v_out``, whose outputs are the caller's). Nothing here reads a device
value back to the host.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

# The op in its two steps, so that a bad call is rejected before the GEMM launches.
from fusedkv_torch.modules import module_layers
from fusedkv_torch.ops import fused_kv_norm_rope, prepare_cache_call, prepare_call, refuse_recorded, requires_grad
from interop.core.checkpoint import read_checkpoint_layers
from interop.core.materializer import (FP8_E4M3_MAX, MIN_ACTIVATION_AMAX, LayerKV, stacked_rope_tables,
                                      validate_layers, validate_materialize, validate_reserve)
from interop.core.spec import check_arrays


_MAX_WORKSPACE_VIEWS = 4096


def _is_capturing(buffer: torch.Tensor) -> bool:
    return buffer.is_cuda and torch.cuda.is_current_stream_capturing()


def _grown(buffer: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    """``buffer`` if it holds ``numel`` elements, else a larger one (never while capturing)."""
    if buffer.numel() >= numel:
        return buffer
    if _is_capturing(buffer):
        raise RuntimeError(
            f"The fused KV materializer's {what} holds {buffer.numel()} elements, the call needs "
            f"{numel}: call reserve() with enough tokens before CUDA-graph capture."
        )
    return torch.empty(numel, dtype=buffer.dtype, device=buffer.device)


def _layout(tensor: torch.Tensor):
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device,
            tensor.untyped_storage().data_ptr())


def _layer_stride(caches: list[torch.Tensor]) -> int | None:
    """Elements from one layer's cache to the next, if all are views of one buffer with
    one layout at a uniform stride that keeps them apart; else None."""
    if not caches:
        return None
    first = caches[0]
    stride = caches[1].storage_offset() - first.storage_offset() if len(caches) > 1 else first.numel()
    span = 1 + sum((size - 1) * step for size, step in zip(first.shape, first.stride()))
    uniform = all(_layout(cache) == _layout(first)
                  and cache.storage_offset() == first.storage_offset() + index * stride
                  for index, cache in enumerate(caches))
    return stride if uniform and stride >= span else None


def _stacked_cache(cache, name: str) -> torch.Tensor:
    """A ``[n_layers, num_slots, H, D]`` tensor: the one given, or per-layer views stacked.

    Per-layer caches are accepted when they are views of one buffer (a strided view
    over them, no copy). Separately allocated ones are refused: stacking them would
    copy the whole pool on every call; allocate the pool as one buffer, or take the
    result through materialize_layers.
    """
    if not isinstance(cache, (list, tuple)):
        return cache  # one array: the op's validation checks it
    caches = list(cache)
    check_arrays(((f"{name}[{layer}]", layer_cache) for layer, layer_cache in enumerate(caches)), "torch")
    stride = _layer_stride(caches)
    if stride is None:
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got per-layer caches that are not "
            "views of one buffer at a uniform, non-overlapping layer stride, expected one "
            "[n_layers, num_slots, num_kv_heads, head_dim] buffer or such views of one; "
            "separately allocated caches can take the result through materialize_layers."
        )
    first = caches[0]
    return first.as_strided((len(caches), *first.shape), (stride, *first.stride()),
                            first.storage_offset())


# Host dtypes torch cannot take in from NumPy (ml_dtypes'): their bits go through an integer view.
_BIT_VIEWS = {"bfloat16": (np.int16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn)}


def _on_device(array: np.ndarray | None, device) -> torch.Tensor | None:
    """A host array as a tensor on ``device``; bf16 and fp8 go through their bits."""
    if array is None:
        return None
    if array.dtype.name in _BIT_VIEWS:
        bits, dtype = _BIT_VIEWS[array.dtype.name]
        return torch.from_numpy(array.view(bits)).view(dtype).to(device)
    return torch.from_numpy(array).to(device)


class FusedKVMaterializer:
    """K and V of every draft layer: ``kv = ctx_hidden @ W^T``, then RMSNorm + RoPE on K.

    ``W`` stacks the layers' ``kv_proj_weight`` (each ``[2*kv_size, hidden]``, K rows then
    V rows) into ``[n_layers*2*kv_size, hidden]``, so that the GEMM's output reshapes to
    ``kv: dtype[total_ctx, n_layers, 2*kv_size]`` for free; ``dtype`` is the weights'.
    Layers with a ``kv_proj_bias`` have it added by the GEMM (``kv = ctx_hidden @ W^T + b``).

    FP8 weights (float8_e4m3fn with a ``weight_scale``) give bfloat16 ``kv`` and results. On a
    CUDA device with FP8 tensor cores (compute capability 8.9 or later), with ``hidden`` and
    the stacked rows multiples of 16, the GEMM runs there (``torch._scaled_mm``), the
    activations quantized per token to float8_e4m3fn; elsewhere (a CPU, an older GPU) it is
    dequantize-then-GEMM: the weights dequantized once to fp32, an fp32 GEMM, rounded once.

    Args:
      layers: one :class:`~interop.core.materializer.LayerKV` per draft layer, holding
        torch tensors on the device to run on; validated by
        :func:`~interop.core.materializer.validate_layers` (the first layer that
        differs from layer 0 is named).
      cos_sin_cache: optional fp32/bf16/fp16[max_position, rotary_dim] replacing the table that
        is otherwise built from the layers' ropes (one table per distinct rope: layers of
        another RoPE base or scaling get their own, in the same launch); or
        ``[n_tables, max_position, rotary_dim]`` with ``layer_rope_table``.
      layer_rope_table: int32[n_layers], each layer's table in a given 3-D ``cos_sin_cache``.
    """

    def __init__(self, layers: Sequence[LayerKV], *, cos_sin_cache: torch.Tensor | None = None,
                 layer_rope_table: torch.Tensor | None = None):
        layers = tuple(layers)
        self.config = validate_layers(layers, cos_sin_cache, layer_rope_table=layer_rope_table, accepted="torch")
        # Read again by every call autograd records, so that it follows the tensors' current values.
        self._layer_tensors = tuple((layer.kv_proj_weight, layer.kv_proj_bias, layer.k_norm_weight)
                                    for layer in layers)
        op = self.config.op
        self._op_static = (op.num_kv_heads, op.head_dim, op.rotary_dim, op.rope_style)
        weight = torch.cat([layer.kv_proj_weight for layer in layers])
        device = weight.device
        self.kv_proj_weight = weight
        self.kv_proj_bias = self.k_norm_weight = self.eps = self.v_multiplier = None  # a draft without them
        self.weight_scale = None
        kv_dtype = getattr(torch, self.config.kv_dtype)
        if self.config.fp8_weights:
            self.weight_scale = torch.cat([layer.weight_scale.to(device=device, dtype=torch.float32).reshape(-1)
                                           .expand(layer.kv_proj_weight.shape[0]) for layer in layers])
        if self.config.biased:
            self.kv_proj_bias = torch.cat([layer.kv_proj_bias.to(device) for layer in layers])
        if self.config.normed:
            self.k_norm_weight = torch.stack(
                [layer.k_norm_weight.to(device=device, dtype=torch.float32) for layer in layers])
            self.eps = torch.tensor([float(layer.eps) for layer in layers], dtype=torch.float32, device=device)
        if self.config.v_multiplied:
            self.v_multiplier = torch.tensor([float(layer.v_multiplier) for layer in layers], dtype=torch.float32,
                                             device=device)
        if cos_sin_cache is None:
            tables, built_index = stacked_rope_tables(layers)
            cos_sin_cache = torch.from_numpy(tables)
            layer_rope_table = None if built_index is None else torch.from_numpy(built_index)
        self.cos_sin_cache = cos_sin_cache.to(device)
        self.layer_rope_table = None if layer_rope_table is None else layer_rope_table.to(device)
        self._weight_t = weight.t()
        self._fp8_gemm = self.config.fp8_gemm_shapes and _has_fp8_tensor_cores(device)
        if self._fp8_gemm:
            self._weight_scale_row = self.weight_scale[None, :]
        elif self.config.fp8_weights:  # no FP8 tensor cores: dequantize-then-GEMM, in fp32
            self._weight_t = (weight.to(torch.float32) * self.weight_scale[:, None]).t()
        self._workspace = torch.empty(0, dtype=kv_dtype, device=device)
        # Views of the workspace per total_ctx: making them costs more host time than the
        # rest of a decode step's Python.
        self._workspace_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staging = torch.empty(0, dtype=kv_dtype, device=device)

    @classmethod
    def from_pretrained(cls, path, *, layers: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None,
                        max_position: int | None = None) -> FusedKVMaterializer:
        """The materializer of a checkpoint's draft layers, read from a local directory.

        ``path`` holds ``config.json`` and ``*.safetensors``: a DFlash draft, or a Llama, Qwen2
        or Qwen3 decoder whose layers serve as draft layers
        (:func:`~interop.core.checkpoint.read_checkpoint_layers`: only the K/V projections,
        their biases and K-norm weights are read; nothing is downloaded).

        Args:
          layers: indices of the checkpoint's layers to use, in order; None: all.
          dtype: the weights' dtype (bf16, fp16 or fp32); None: the checkpoint's.
          device: where the materializer runs; None: ``"cuda"`` where available, else ``"cpu"``.
          max_position: rows of the rotary table; None: the config's ``max_position_embeddings``.

        A checkpoint that cannot be served as asked (a missing tensor, a shape that disagrees
        with the config, a RoPE type or quantization not supported) is refused with a
        ``ValueError`` naming the key and the file, before anything is put on the device.
        """
        host_layers = read_checkpoint_layers(path, layers=layers, dtype=dtype, max_position=max_position)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls([dataclasses.replace(layer, **{field: _on_device(getattr(layer, field), device)
                                                  for field in ("kv_proj_weight", "kv_proj_bias", "k_norm_weight",
                                                                "weight_scale")})
                    for layer in host_layers])

    @classmethod
    def from_modules(cls, layers: Sequence, rotary_emb=None) -> FusedKVMaterializer:
        """The materializer of a serving stack's attention modules, one per draft layer.

        Read by the attributes the modules expose (:func:`fusedkv_torch.modules.module_layers`):
        a fused ``qkv_proj`` with ``q_size`` and ``kv_size`` (vLLM, sglang) or ``k_proj`` and
        ``v_proj`` (transformers), ``k_norm`` where there is one, ``head_dim``. ``rotary_emb``
        (None: layer 0's ``rotary_emb``) gives the table: its own ``cos_sin_cache`` with
        ``rotary_dim`` and ``is_neox_style``, or a transformers rotary embedding's config. The
        materializer runs where the weights are; a module it cannot read is refused with a
        ``ValueError`` naming the attribute and the layer.
        """
        draft, cos_sin_cache = module_layers(layers, rotary_emb)
        if cos_sin_cache is not None:
            cos_sin_cache = cos_sin_cache.to(draft[0].kv_proj_weight.device)
        return cls(draft, cos_sin_cache=cos_sin_cache)

    def reserve(self, max_tokens: int, *, staging: bool = False) -> None:
        """Size the GEMM workspace for ``max_tokens``; with ``staging``, also the output
        buffers :meth:`materialize_layers` hands to its callback. Call before capture.
        ``max_tokens``: an int >= 0."""
        numel = validate_reserve(max_tokens) * self.config.kv_width
        self._grow_workspace(numel)
        if staging:
            self._staging = _grown(self._staging, numel, "staging buffer")

    def project(self, ctx_hidden: torch.Tensor) -> torch.Tensor:
        """``kv = ctx_hidden @ W^T (+ b)``: dtype[total_ctx, n_layers, 2*kv_size], a view of the workspace.

        ``ctx_hidden: float[total_ctx, hidden]``, cast once to the weights' dtype. The
        view is overwritten by the next call on this materializer.
        """
        kv, gemm_out = self._workspace_view(ctx_hidden, None)
        self._project_into(gemm_out, ctx_hidden)
        return kv

    def materialize(
        self,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        *,
        max_position: int | None = None,
        k_out: torch.Tensor | None = None,
        v_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused_kv_norm_rope(ctx_hidden @ W^T, ...)`` for all layers.

        Args:
          ctx_hidden: float[total_ctx, hidden], on the weights' device.
          positions: int32/int64[total_ctx]; a position outside the cos/sin table
            gives a NaN K row, never a read outside it.
          max_position: optional bound on the positions, checked against the table's
            rows on the host (the positions themselves are never read back).
          k_out, v_out: optional dtype[n_layers, total_ctx, num_kv_heads, head_dim].

        Returns:
          ``(k, v)``, each dtype[n_layers, total_ctx, num_kv_heads, head_dim]. Where
          ``ctx_hidden`` or a layer's tensor requires grad (and grad mode is on) they carry
          a ``grad_fn``: the GEMM is then autograd's own, on the layers' tensors as they are
          now, into a fresh ``kv`` (``k_out``/``v_out`` are refused).
        """
        if self._recorded(ctx_hidden):
            return self._materialize_differentiable(ctx_hidden, positions, max_position, k_out, v_out)
        kv, gemm_out = self._workspace_view(ctx_hidden, max_position)
        op_args = (kv, self.k_norm_weight, self.eps, self.cos_sin_cache, positions)
        prepared = prepare_call(*op_args, *self._op_static, k_out, v_out, v_multiplier=self.v_multiplier,
                                layer_rope_table=self.layer_rope_table)
        self._project_into(gemm_out, ctx_hidden)
        return prepared.launch(*op_args, k_out, v_out, False, self.v_multiplier, self.layer_rope_table)

    def _materialize_differentiable(self, ctx_hidden, positions, max_position, k_out, v_out):
        """:meth:`materialize` as autograd records it: the weights stacked anew and a GEMM of its own."""
        total_ctx = validate_materialize(ctx_hidden, self.config, max_position, accepted="torch")
        weights, biases, norm_weights = zip(*self._layer_tensors)
        weight = torch.cat(weights)
        if self.config.fp8_weights:  # dequantize-then-GEMM in fp32, rounded once to bf16
            hidden = ctx_hidden.to(torch.bfloat16).to(torch.float32)
            kv = hidden @ (weight.to(torch.float32) * self.weight_scale[:, None]).t()
            kv = (kv + torch.cat(biases).to(torch.float32) if self.config.biased else kv).to(torch.bfloat16)
        else:
            kv = ctx_hidden.to(weight.dtype) @ weight.t()
            if self.config.biased:
                kv = kv + torch.cat(biases)
        k_norm_weight = None
        if self.config.normed:
            k_norm_weight = torch.stack([w.to(device=weight.device, dtype=torch.float32) for w in norm_weights])
        op = self.config.op
        return fused_kv_norm_rope(kv.view(self.config.kv_shape(total_ctx)), k_norm_weight, self.eps,
                                  self.cos_sin_cache, positions, num_kv_heads=op.num_kv_heads, head_dim=op.head_dim,
                                  rotary_dim=op.rotary_dim, rope_style=op.rope_style,
                                  v_multiplier=self.v_multiplier, k_out=k_out, v_out=v_out,
                                  layer_rope_table=self.layer_rope_table)

    def materialize_layers(
        self,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        write_layer_kv: Callable[[int, torch.Tensor, torch.Tensor], None],
        *,
        max_position: int | None = None,
    ) -> None:
        """:meth:`materialize`, handing each layer's result to ``write_layer_kv(layer, k, v)``.

        ``k, v: dtype[total_ctx, num_kv_heads, head_dim]`` are views of a staging buffer
        the materializer reuses: copy what is needed before the next call.
        """
        total_ctx = validate_materialize(ctx_hidden, self.config, max_position, accepted="torch")
        self._check_unrecorded(ctx_hidden, "materialize_layers")
        out_shape = self.config.op.output_shape(self.config.n_layers, total_ctx)
        half = self.config.n_layers * total_ctx * self.config.op.kv_size
        self._staging = _grown(self._staging, 2 * half, "staging buffer")
        k, v = (self._staging[:half].view(out_shape), self._staging[half:2 * half].view(out_shape))
        self.materialize(ctx_hidden, positions, max_position=max_position, k_out=k, v_out=v)
        for layer in range(self.config.n_layers):
            write_layer_kv(layer, k[layer], v[layer])

    def materialize_into_cache(
        self,
        ctx_hidden: torch.Tensor,
        positions: torch.Tensor,
        cache_loc: torch.Tensor,
        k_cache: torch.Tensor | Sequence[torch.Tensor],
        v_cache: torch.Tensor | Sequence[torch.Tensor],
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        max_position: int | None = None,
    ):
        """:meth:`materialize` scattered into a paged KV cache in one launch, no temporary.

        Token ``t``'s K and V of every layer go to slot ``cache_loc[t]``; slots outside
        ``[0, num_slots)`` (negative ones: padding) are skipped; slots inside it must be
        distinct (CONTRACT.md).

        Args (beyond :meth:`materialize`'s):
          cache_loc: int32/int64[total_ctx].
          k_cache, v_cache: dtype or float8_e4m3fn[n_layers, num_slots, num_kv_heads,
            head_dim], or per-layer lists of [num_slots, num_kv_heads, head_dim] that
            are views of one buffer at a uniform layer stride (others are refused).
          k_scale, v_scale: fp32[n_layers], only for float8_e4m3fn caches (stored: value / scale).

        Returns:
          ``(k_cache, v_cache)`` as given, written in place.
        """
        stacked_k, stacked_v = _stacked_cache(k_cache, "k_cache"), _stacked_cache(v_cache, "v_cache")
        self._check_unrecorded(ctx_hidden, "materialize_into_cache")  # before the workspace can grow
        kv, gemm_out = self._workspace_view(ctx_hidden, max_position)
        op_args = (kv, self.k_norm_weight, self.eps, self.cos_sin_cache, positions,
                   cache_loc, stacked_k, stacked_v)
        prepared = prepare_cache_call(*op_args, *self._op_static, k_scale, v_scale, v_multiplier=self.v_multiplier,
                                      layer_rope_table=self.layer_rope_table)
        self._project_into(gemm_out, ctx_hidden)
        prepared.launch_into_cache(*op_args, k_scale, v_scale, self.v_multiplier, self.layer_rope_table)
        return k_cache, v_cache

    def _recorded(self, ctx_hidden: torch.Tensor) -> bool:
        """Whether autograd records a call on ``ctx_hidden`` and the layers' tensors."""
        return requires_grad(ctx_hidden, *(t for tensors in self._layer_tensors for t in tensors))

    def _check_unrecorded(self, ctx_hidden: torch.Tensor, method: str) -> None:
        """Refuse a call of ``method`` (whose results carry no gradient) that autograd would record:
        it would drop the gradients of ``ctx_hidden`` and the layers' tensors without a word."""
        if not self._recorded(ctx_hidden):
            return
        refuse_recorded([("ctx_hidden", ctx_hidden)] + [
            (f"layers[{index}].{attribute}", tensor) for index, tensors in enumerate(self._layer_tensors)
            for attribute, tensor in zip(("kv_proj_weight", "kv_proj_bias", "k_norm_weight"), tensors)],
            method, "its results carry no gradient: call it under torch.no_grad(), or differentiate materialize")

    def _grow_workspace(self, numel: int) -> None:
        workspace = _grown(self._workspace, numel, "GEMM workspace")
        if workspace is not self._workspace:
            self._workspace, self._workspace_views = workspace, {}

    def _workspace_view(self, ctx_hidden: torch.Tensor,
                        max_position: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The workspace this call's GEMM will fill (nothing launched yet), as the op's ``kv``
        and as the GEMM's ``[total_ctx, n_layers * 2*kv_size]`` output."""
        total_ctx = validate_materialize(ctx_hidden, self.config, max_position, accepted="torch")
        if ctx_hidden.device != self._workspace.device:
            raise ValueError(
                "Invalid ctx_hidden device for fused KV materialization: "
                f"got device={ctx_hidden.device}, expected device={self._workspace.device}."
            )
        views = self._workspace_views.get(total_ctx)
        if views is None:
            numel = total_ctx * self.config.kv_width
            self._grow_workspace(numel)
            if len(self._workspace_views) >= _MAX_WORKSPACE_VIEWS:
                self._workspace_views.clear()
            flat = self._workspace[:numel]
            views = self._workspace_views[total_ctx] = (
                flat.view(self.config.kv_shape(total_ctx)), flat.view(total_ctx, self.config.kv_width))
        return views

    def _project_into(self, gemm_out: torch.Tensor, ctx_hidden: torch.Tensor) -> None:
        # The workspace slice is contiguous and of the GEMM's exact output shape, so
        # mm writes it in place rather than resizing it; addmm adds a bias in the GEMM's epilogue.
        hidden = ctx_hidden.to(gemm_out.dtype)
        if self._fp8_gemm:
            _fp8_mm_into(gemm_out, hidden, self._weight_t, self._weight_scale_row, self.kv_proj_bias)
        elif self.config.fp8_weights:  # dequantized fp32 weights: one rounding, into the workspace
            gemm_out.copy_(torch.mm(hidden.to(torch.float32), self._weight_t) if self.kv_proj_bias is None else
                           torch.addmm(self.kv_proj_bias.to(torch.float32), hidden.to(torch.float32), self._weight_t))
        elif self.kv_proj_bias is None:
            torch.mm(hidden, self._weight_t, out=gemm_out)
        else:
            torch.addmm(self.kv_proj_bias, hidden, self._weight_t, out=gemm_out)


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    """A CUDA device of compute capability 8.9 or later (Ada, Hopper, Blackwell) runs
    ``torch._scaled_mm`` on FP8 tensor cores; ROCm's FP8 is another format (e4m3fnuz)."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_mm_into(out: torch.Tensor, hidden: torch.Tensor, weight_t: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
    """``out = (q * scale) @ (weight_t * weight_scale) (+ bias)`` on FP8 tensor cores, ``q`` and
    ``scale`` the per-token quantization of ``hidden`` (as :func:`~interop.core.materializer.quantize_per_token`).

    ``torch._scaled_mm`` takes two FP8 operands (so the activations are quantized, each token
    with its own scale, fp32[T, 1]), the second column-major (``weight_t``, a transposed
    row-major weight), fp32 scales of shapes (T, 1) and (1, N) for rowwise scaling, and
    writes bfloat16, accumulating in fp32 (``use_fast_accum=False``) with the bias added
    in its epilogue.
    """
    if not out.shape[0]:
        return
    hidden = hidden.to(torch.float32)
    # torch.div, not 448 / tensor: that is the tensor's reciprocal times 448, rounded twice.
    inverse = torch.div(FP8_E4M3_MAX, hidden.abs().amax(dim=1, keepdim=True).clamp(min=MIN_ACTIVATION_AMAX))
    codes = (hidden * inverse).to(torch.float8_e4m3fn)
    torch._scaled_mm(codes, weight_t, inverse.reciprocal(), weight_scale, bias=bias, out_dtype=out.dtype,
                     use_fast_accum=False, out=out)
