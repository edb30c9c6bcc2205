"""The public torch functions of fusedkv, their validation and their torch.library ops.

:func:`fused_kv_norm_rope` and :func:`fused_kv_norm_rope_into_cache` validate a call
(``interop.core.spec``) and launch the Triton kernel of :mod:`fusedkv_torch.kernel`: eager
calls launch it directly, traced calls (``torch.compile``) through the registered op,
which the graph then records. Each op sits with its fake and its public function.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._C import _functorch
from torch._subclasses.fake_tensor import FakeTensor

from fusedkv_torch import backward, repeated  # backward registers fusedkv::fused_kv_norm_rope and its autograd formula
from fusedkv_torch.kernel import _launch, _launcher, launch, supports_dependent_launch, tuned_plan
from interop.core.spec import (
    AcceptedCall,
    CallShape,
    FusedKVConfig,
    accept_cache_call,
    accept_call,
    check_output_buffers,
    check_positions_in_range,
)

# Validation of shapes, dtypes and devices (interop.core.spec) costs more host time than the
# launch: an eager call whose signature (interop.core.spec.call_signature) passed before is not
# checked again, and its launch plan and compiled kernels are kept with it (the signature
# names every tensor's dtype and device, as DirectLauncher's ``compiled`` needs). What the
# signature cannot tell is checked on every call: that the outputs overlap neither each
# other nor kv (addresses). Rejected calls are never remembered, so a bad call raises
# every time.
# An eager call that repeats a layout (every tensor's shape, strides, dtype and device)
# launched directly before skips even the signature (fusedkv_torch.repeated).
# Traced calls (torch.compile) validate every time and go through the registered op, so
# the graph records the mutation, and the op checks the outputs' memory when it runs;
# eager calls skip the op, whose dispatcher costs more host time than the launch. A traced
# call that validation refuses goes into the graph as a refusal (RefusedCall). Calls on
# meta tensors or FakeTensorMode's fakes, which have no memory, go through the registered
# op too, whose fake gives the outputs' shapes.


_NO_TILE = (None, None, None)


class PreparedCall:
    """A call that validation accepted, with what launching it needs.

    ``call``: the validated sizes; ``plan``: the kernel's launch plan, None for a traced
    call or one on tensors without memory (which go through the registered op);
    ``compiled``: the compiled kernels of this call's metadata (``DirectLauncher``'s
    ``compiled``; None for a tile override, whose kernels the launcher keeps by their
    constexprs); ``tile``: the override
    ``(block_tokens, block_heads, num_warps)``, Nones where not given. The materializer
    prepares a call before its GEMM and launches it after.
    """

    __slots__ = ("call", "plan", "compiled", "tile")

    def __init__(self, call: CallShape, plan: Optional[tuple], compiled: Optional[dict], tile: tuple = _NO_TILE):
        self.call = call
        self.plan = plan
        self.compiled = compiled
        self.tile = tile

    def launch(self, kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
               check_positions: bool, v_multiplier=None, layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The op on the arguments :func:`prepare_call` accepted: ``(k_out, v_out)``,
        allocated here where None."""
        call, device = self.call, kv.device
        positions = _moved(positions, device, non_blocking=True)
        v_multiplier, layer_rope_table = _moved(v_multiplier, device), _moved(layer_rope_table, device)
        if check_positions and call.total_ctx:
            _check_positions_in_range(positions, call.max_position)
        if k_out is None:
            k_out = kv.new_empty(call.output_shape)
        if v_out is None:
            v_out = kv.new_empty(call.output_shape)
        if call.total_ctx == 0 or call.n_layers == 0:
            return k_out, v_out
        if self.plan is None:
            config = call.config
            torch.ops.fusedkv.write_fused_kv_norm_rope(
                kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
                config.num_kv_heads, config.head_dim, config.rotary_dim, config.rope_style, *self.tile, v_multiplier,
                layer_rope_table)
        else:
            _launch(self.plan, kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, None, None, None,
                    v_multiplier, layer_rope_table, self.compiled)
        return k_out, v_out

    def launch_differentiable(self, kv, k_norm_weight, eps, cos_sin_cache, positions, check_positions: bool,
                              v_multiplier=None, layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The op through its differentiable registered op (outputs with a ``grad_fn``), for a
        call whose ``kv``, ``k_norm_weight`` or ``v_multiplier`` requires grad."""
        positions = _moved(positions, kv.device, non_blocking=True)
        v_multiplier, layer_rope_table = _moved(v_multiplier, kv.device), _moved(layer_rope_table, kv.device)
        if check_positions and self.call.total_ctx:
            _check_positions_in_range(positions, self.call.max_position)
        config = self.call.config
        return backward.fused_kv_norm_rope_op(kv, k_norm_weight, eps, cos_sin_cache, positions, config.num_kv_heads,
                                              config.head_dim, config.rotary_dim, config.rope_style, *self.tile,
                                              v_multiplier, layer_rope_table)

    def launch_into_cache(self, kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                          k_scale, v_scale, v_multiplier=None,
                          layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The op into a cache on the arguments :func:`prepare_cache_call` accepted."""
        call = self.call
        if call.total_ctx == 0 or call.n_layers == 0 or k_cache.shape[1] == 0:  # nothing to write
            return k_cache, v_cache
        device = kv.device
        positions = _moved(positions, device, non_blocking=True)
        cache_loc = _moved(cache_loc, device, non_blocking=True)
        k_scale, v_scale = _moved(k_scale, device), _moved(v_scale, device)
        v_multiplier, layer_rope_table = _moved(v_multiplier, device), _moved(layer_rope_table, device)
        if self.plan is None:
            config = call.config
            torch.ops.fusedkv.write_fused_kv_norm_rope_into_cache(
                kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                config.num_kv_heads, config.head_dim, config.rotary_dim, config.rope_style, k_scale, v_scale,
                *self.tile, v_multiplier, layer_rope_table)
        else:
            _launch(self.plan, kv, k_norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache, cache_loc,
                    k_scale, v_scale, v_multiplier, layer_rope_table, self.compiled)
        return k_cache, v_cache


def _moved(array: Optional[torch.Tensor], device: torch.device, *, non_blocking: bool = False):
    """A call's small array (positions, slots, per-layer values) on ``kv``'s ``device``, where
    the contract lets it come from any device; None and arrays already there stay as they are."""
    if array is None or array.device == device:
        return array
    return array.to(device, non_blocking=non_blocking)


class RefusedCall:
    """A call validation refused while torch.compile traced it, launched as a
    :class:`PreparedCall` is.

    An exception raised while dynamo traces reaches the caller as dynamo's own error
    (``Unsupported`` under ``fullgraph=True``), the contract's only as its cause. So the
    graph records the refusal instead: ``fusedkv::refuse`` raises the contract's
    ``ValueError`` or ``TypeError``, message and all, when the compiled code runs,
    before anything is written.
    """

    __slots__ = ("error", "message")

    def __init__(self, error: Exception):
        self.error = "TypeError" if isinstance(error, TypeError) else "ValueError"
        self.message = str(error)

    def launch(self, kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
               check_positions: bool, v_multiplier=None, layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._refuse(k_out, v_out)

    def launch_differentiable(self, kv, k_norm_weight, eps, cos_sin_cache, positions, check_positions: bool,
                              v_multiplier=None, layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._refuse()

    def launch_into_cache(self, kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                          k_scale, v_scale, v_multiplier=None,
                          layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._refuse(k_cache, v_cache)

    def _refuse(self, *buffers) -> tuple[torch.Tensor, torch.Tensor]:
        # Declared as writing the call's buffers, the refusal stays in the graph wherever the call would.
        written = [buffer for buffer in buffers if isinstance(buffer, torch.Tensor)]
        return torch.ops.fusedkv.refuse(written, self.error, self.message)


def _tile(block_tokens, block_heads, num_warps) -> tuple:
    if block_tokens is None and block_heads is None and num_warps is None:
        return _NO_TILE
    return block_tokens, block_heads, num_warps


def _check_runnable(device: torch.device) -> None:
    """Refuse a call the launcher could only end in an assertion: tensors off the GPU
    while Triton compiles for one (its interpreter, which runs on the CPU, is chosen
    by ``TRITON_INTERPRET=1`` when the kernel is defined, at import)."""
    if device.type != "cuda" and not _launcher.interpreted:
        raise ValueError(
            f"Invalid kv device for fused KV materialization: got device={device}, expected a CUDA "
            "device (to run the Triton kernel on the CPU, set TRITON_INTERPRET=1 before "
            "fusedkv_torch is imported)."
        )


def _has_no_memory(tensor: torch.Tensor) -> bool:
    """Meta tensors and FakeTensorMode's fakes: shapes, dtypes and devices, no data."""
    return tensor.is_meta or isinstance(tensor, FakeTensor)


def _prepared(accepted: AcceptedCall, kv: torch.Tensor, tile: tuple = _NO_TILE) -> PreparedCall:
    """The launch plan of an accepted call, made once per call signature; with a tile
    override (checked here, before anything is written), made for the call alone. A kv
    without memory (its own signatures: they name kv's type and device) gets no plan, so
    the call goes through the registered op, whose fake runs."""
    prepared = None if tile is not _NO_TILE else accepted.prepared.get("torch")
    if prepared is None:
        device = kv.device
        if device.type != "meta":  # a call on meta tensors runs nowhere
            _check_runnable(device)
        call = accepted.shape
        plan = tuned_plan(call.config, call.total_ctx, call.n_layers, kv.element_size(), tile,
                          supports_dependent_launch(device))
        if _has_no_memory(kv):  # planned all the same: planning checks the tile override
            plan = None
        if tile is not _NO_TILE:
            return PreparedCall(call, plan, None, tile)
        prepared = accepted.prepared["torch"] = PreparedCall(call, plan, {})
    return prepared


def _traced(accept, arrays: tuple, static: dict, tile: tuple) -> PreparedCall | RefusedCall:
    """A call as torch.compile traces it, validated by ``accept`` (``accept_call`` or
    ``accept_cache_call``) without the array kinds (dynamo traces tensors) and addresses
    (none yet); the registered op plans it (and checks the tile) when it runs."""
    try:
        accepted = accept(*arrays, **static, remember=False)
        _check_runnable(arrays[0].device)
    except (TypeError, ValueError) as error:
        return RefusedCall(error)
    return PreparedCall(accepted.shape, None, None, tile)


def _check_untransformed(function: str, names: tuple, arrays: tuple) -> None:
    """Inside a torch.func transform: refuse its tensors (vmap's batched ones, grad's
    wrappers), which hold no memory the kernel could read; a call signature cannot tell
    them from plain tensors."""
    for name, array in zip(names, arrays):
        if isinstance(array, torch.Tensor) and _functorch.is_functorch_wrapped_tensor(array):
            what = "batched by torch.func.vmap" if _functorch.is_batchedtensor(array) else "of a torch.func transform"
            raise TypeError(
                f"Invalid {name} for fused KV materialization: got a tensor {what}, expected a plain tensor "
                f"(fusedkv_torch.{function} has no rule for torch.func transforms: call it once per batch "
                "member, or fold the batch into total_ctx)."
            )


_ARRAY_NAMES = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions")


def requires_grad(*tensors) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode is on and one of them requires grad."""
    if torch.is_grad_enabled():
        for tensor in tensors:  # a loop, not any(): this runs on every eager call
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                return True
    return False


def _check_differentiable(kv, k_norm_weight, v_multiplier, k_out, v_out) -> None:
    """Refuse what a call autograd records cannot take: outputs given (buffers written in place
    carry no gradient)."""
    if (k_out is not None or v_out is not None) and requires_grad(kv, k_norm_weight, v_multiplier):
        for name, out in (("k_out", k_out), ("v_out", v_out)):
            if out is not None:
                raise ValueError(
                    f"Invalid {name} for fused KV materialization: got an output buffer while kv, k_norm_weight "
                    f"or v_multiplier requires grad, expected {name}=None there (outputs written in place carry "
                    "no gradient: the differentiable op allocates its own).")


def prepare_call(kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim,
                 rope_style, k_out, v_out, tile: tuple = _NO_TILE, v_multiplier=None,
                 layer_rope_table=None) -> PreparedCall | RefusedCall:
    """A :func:`fused_kv_norm_rope` call validated, ready for :meth:`PreparedCall.launch`."""
    static = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
                  v_multiplier=v_multiplier, layer_rope_table=layer_rope_table)
    if torch.compiler.is_compiling():
        prepared = _traced(accept_call, (kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out), static,
                           tile)
        try:
            _check_differentiable(kv, k_norm_weight, v_multiplier, k_out, v_out)
        except ValueError as error:
            return prepared if isinstance(prepared, RefusedCall) else RefusedCall(error)
        return prepared
    if _functorch.maybe_current_level() is not None:  # inside vmap, grad...
        _check_untransformed("fused_kv_norm_rope", _ARRAY_NAMES + ("k_out", "v_out", "v_multiplier",
                                                                   "layer_rope_table"),
                             (kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, v_multiplier,
                              layer_rope_table))
    accepted = accept_call(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, **static, takes="torch")
    _check_differentiable(kv, k_norm_weight, v_multiplier, k_out, v_out)
    prepared = _prepared(accepted, kv, tile)
    if prepared.plan is not None:  # a kv without memory has no addresses to check
        check_output_buffers(kv, (("k_out", k_out), ("v_out", v_out)))
    return prepared


def prepare_cache_call(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                       num_kv_heads, head_dim, rotary_dim, rope_style, k_scale,
                       v_scale, tile: tuple = _NO_TILE, v_multiplier=None,
                       layer_rope_table=None) -> PreparedCall | RefusedCall:
    """A :func:`fused_kv_norm_rope_into_cache` call validated, ready for
    :meth:`PreparedCall.launch_into_cache`."""
    arrays = (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale, v_scale)
    static = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
                  v_multiplier=v_multiplier, layer_rope_table=layer_rope_table)
    if torch.compiler.is_compiling():
        return _traced(accept_cache_call, arrays, static, tile)
    if _functorch.maybe_current_level() is not None:
        _check_untransformed("fused_kv_norm_rope_into_cache",
                             _ARRAY_NAMES + ("cache_loc", "k_cache", "v_cache", "k_scale", "v_scale", "v_multiplier",
                                             "layer_rope_table"),
                             arrays + (v_multiplier, layer_rope_table))
    accepted = accept_cache_call(*arrays, **static, takes="torch")
    _check_unrecorded(kv, k_norm_weight, v_multiplier)
    prepared = _prepared(accepted, kv, tile)
    if prepared.plan is not None:
        check_output_buffers(kv, (("k_cache", k_cache), ("v_cache", v_cache)))
    return prepared


def refuse_recorded(named_tensors, function: str, reason: str) -> None:
    """Refuse a call of ``function``, whose results carry no gradient (``reason``), on the first
    of ``named_tensors`` (``(name, tensor)`` pairs) that autograd would record: it would drop
    that tensor's gradient without a word."""
    for name, tensor in named_tensors:
        if requires_grad(tensor):
            raise ValueError(f"Invalid {name} for fused KV materialization: got a tensor that requires grad for "
                             f"{function}, expected one that does not ({reason}).")


def _check_unrecorded(kv, k_norm_weight, v_multiplier) -> None:
    refuse_recorded((("kv", kv), ("k_norm_weight", k_norm_weight), ("v_multiplier", v_multiplier)),
                    "fused_kv_norm_rope_into_cache",
                    "the caches are written in place and carry no gradient: call it under torch.no_grad(), "
                    "or differentiate fused_kv_norm_rope and write its outputs into the cache")


def _check_positions_in_range(positions: torch.Tensor, max_position: int) -> None:
    if _has_no_memory(positions):
        raise ValueError(
            "Invalid check_positions for fused KV materialization: got True on positions without values "
            "(meta or fake tensors), expected False there (out-of-range positions give all-NaN K rows)."
        )
    low, high = (int(value) for value in torch.aminmax(positions))  # the one host sync
    check_positions_in_range(low, high, max_position)


# The registered ops: the kernel launch as torch.compile and CUDA graphs see it. A custom op
# may not return an alias of an input, so they write into the given buffers and return nothing.
@torch.library.custom_op("fusedkv::write_fused_kv_norm_rope", mutates_args=("k_out", "v_out"))
def _write_fused_kv_norm_rope(
    kv: torch.Tensor, k_norm_weight: Optional[torch.Tensor], eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor,
    num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str,
    block_tokens: Optional[int] = None, block_heads: Optional[int] = None, num_warps: Optional[int] = None,
    v_multiplier: Optional[torch.Tensor] = None, layer_rope_table: Optional[torch.Tensor] = None,
) -> None:
    # Traced calls are validated while tracing, when addresses are not known yet: here they are.
    check_output_buffers(kv, (("k_out", k_out), ("v_out", v_out)))
    launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
           config=FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style), v_multiplier=v_multiplier,
           block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
           layer_rope_table=layer_rope_table)


@_write_fused_kv_norm_rope.register_fake
def _write_fused_kv_norm_rope_fake(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
                                   num_kv_heads, head_dim, rotary_dim, rope_style, block_tokens=None,
                                   block_heads=None, num_warps=None, v_multiplier=None, layer_rope_table=None):
    return None


_CONTRACT_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


@torch.library.custom_op("fusedkv::refuse", mutates_args=("written",))
def _refuse(written: list[torch.Tensor], error: str, message: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A call validation refused while torch.compile traced it (:class:`RefusedCall`):
    raises ``error`` (``'TypeError'`` or ``'ValueError'``) with ``message`` when it runs.
    ``written``: the buffers the refused call would write, declared so that the graph
    keeps the refusal wherever it would keep the call."""
    raise _CONTRACT_ERRORS[error](message)


@_refuse.register_fake
def _refuse_fake(written, error, message):
    return torch.empty(0), torch.empty(0)


def fused_kv_norm_rope(
    kv: torch.Tensor,
    k_norm_weight: Optional[torch.Tensor],
    eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    v_multiplier: Optional[torch.Tensor] = None,
    k_out: Optional[torch.Tensor] = None,
    v_out: Optional[torch.Tensor] = None,
    check_positions: bool = False,
    block_tokens: Optional[int] = None,
    block_heads: Optional[int] = None,
    num_warps: Optional[int] = None,
    layer_rope_table: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm + RoPE on K, V passed through, for all layers (formula in the module docstring).

    All arrays are torch tensors (other frameworks' arrays: ``interop.fused_kv_norm_rope``);
    ``num_kv_heads``, ``head_dim`` and ``rotary_dim`` are ints.

    Args:
      kv: bf16/fp16/fp32[total_ctx, n_layers, 2*kv_size], per token and layer all K heads
        then all V heads; any strides (a slice of a GEMM workspace is read in place).
      k_norm_weight: float[n_layers, head_dim], or None for a draft without a K-norm (K is
        then RoPE of the projected K, rounded once).
      eps: fp32[n_layers]; None exactly when ``k_norm_weight`` is.
      cos_sin_cache: fp32/bf16/fp16[max_pos, rotary_dim], row p = rotary_dim/2 cos values then sin
        values; read as fp32. Or ``[n_tables, max_pos, rotary_dim]``, one table per RoPE, with
        ``layer_rope_table``.
      positions: int32/int64[total_ctx], any device (moved to kv's). A position outside
        [0, max_pos) gives an all-NaN K row, unless ``check_positions`` raises for it.
      v_multiplier: optional fp32[n_layers]: V is ``v * v_multiplier[l]`` in fp32, rounded
        once (a model's per-layer value scale); None copies V bit for bit.
      k_out, v_out: optional dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim], any
        strides but zero (views into a bigger cache), written in place; sharing memory
        with each other or with ``kv`` is refused.
      check_positions: raise ``ValueError`` for out-of-range positions, before anything is
        written; this syncs with the device, so it is off by default and cannot be used
        under CUDA graph capture.
      block_tokens, block_heads, num_warps: tile overrides (powers of two; ``block_heads``
        dividing ``num_kv_heads``) for tuning; :func:`fusedkv_torch.kernel.default_tile`
        otherwise.
      layer_rope_table: int32[n_layers], any device (moved to kv's), exactly with a 3-D
        ``cos_sin_cache``: layer l is rotated by table ``layer_rope_table[l]``; an index
        outside [0, n_tables) gives that layer an all-NaN K.

    Returns:
      ``(k_out, v_out)``, each dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim]. Where
      ``kv``, ``k_norm_weight`` or ``v_multiplier`` requires grad (and grad mode is on) they
      carry a ``grad_fn`` (the Triton backward kernel, :mod:`fusedkv_torch.backward`), and
      ``k_out``/``v_out`` are refused; ``eps``, ``cos_sin_cache`` and ``positions`` get no gradient.
    """
    tile = _tile(block_tokens, block_heads, num_warps)
    key = tensors = None
    if tile is _NO_TILE and not check_positions:
        tensors = (kv, k_norm_weight, eps, cos_sin_cache, positions, None, k_out, v_out, None, None, v_multiplier,
                   layer_rope_table)
        key = repeated.layout_key("call", (num_kv_heads, head_dim, rotary_dim, rope_style), tensors)
        outputs = repeated.launch_again(key, tensors)
        if outputs is not None:
            return outputs
    prepared = prepare_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, num_kv_heads, head_dim, rotary_dim, rope_style,
        k_out, v_out, tile, v_multiplier, layer_rope_table,
    )
    outputs = repeated.launch_first(key, prepared, tensors) if key is not None else None
    if outputs is not None:
        return outputs
    return _run(prepared, kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, check_positions,
                v_multiplier, layer_rope_table)


def _run(prepared, kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, check_positions: bool,
         v_multiplier, layer_rope_table) -> tuple[torch.Tensor, torch.Tensor]:
    """A validated call's launch: through the differentiable op where autograd records it."""
    if requires_grad(kv, k_norm_weight, v_multiplier):
        return prepared.launch_differentiable(kv, k_norm_weight, eps, cos_sin_cache, positions, check_positions,
                                              v_multiplier, layer_rope_table)
    return prepared.launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, check_positions,
                           v_multiplier, layer_rope_table)


def fused_kv_norm_rope_accepted(accepted: AcceptedCall, kv, k_norm_weight, eps, cos_sin_cache, positions, *,
                                 v_multiplier=None, k_out=None, v_out=None,
                                 layer_rope_table=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_kv_norm_rope` on torch tensors made from arrays that ``interop`` validated
    as ``accepted`` (``interop.core.spec.accept_call``, then ``check_output_buffers``): those
    checks are not run again. Not for other callers: the public function checks everything.
    Differentiable as the public function is."""
    _check_differentiable(kv, k_norm_weight, v_multiplier, k_out, v_out)  # the one check interop does not make
    return _run(_prepared(accepted, kv), kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, False,
                v_multiplier, layer_rope_table)


@torch.library.custom_op("fusedkv::write_fused_kv_norm_rope_into_cache",
                         mutates_args=("k_cache", "v_cache"))
def _write_fused_kv_norm_rope_into_cache(
    kv: torch.Tensor, k_norm_weight: Optional[torch.Tensor], eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str,
    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
    block_tokens: Optional[int] = None, block_heads: Optional[int] = None, num_warps: Optional[int] = None,
    v_multiplier: Optional[torch.Tensor] = None, layer_rope_table: Optional[torch.Tensor] = None,
) -> None:
    check_output_buffers(kv, (("k_cache", k_cache), ("v_cache", v_cache)))
    launch(kv, k_norm_weight, eps, cos_sin_cache, positions, k_cache, v_cache,
           config=FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style),
           cache_loc=cache_loc, k_scale=k_scale, v_scale=v_scale, v_multiplier=v_multiplier,
           block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps,
           layer_rope_table=layer_rope_table)


@_write_fused_kv_norm_rope_into_cache.register_fake
def _write_fused_kv_norm_rope_into_cache_fake(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc,
                                              k_cache, v_cache, num_kv_heads, head_dim, rotary_dim,
                                              rope_style, k_scale, v_scale, block_tokens=None, block_heads=None,
                                              num_warps=None, v_multiplier=None, layer_rope_table=None):
    return None


def fused_kv_norm_rope_into_cache(
    kv: torch.Tensor,
    k_norm_weight: Optional[torch.Tensor],
    eps: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    cache_loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    v_multiplier: Optional[torch.Tensor] = None,
    block_tokens: Optional[int] = None,
    block_heads: Optional[int] = None,
    num_warps: Optional[int] = None,
    layer_rope_table: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_kv_norm_rope` written straight into a paged KV cache, one launch.

    ``k_cache[l, cache_loc[t]]`` and ``v_cache[l, cache_loc[t]]`` receive token t's K and V
    for every layer l. Slots outside [0, num_slots) (negative ones are padding) are
    skipped without a device sync; slots inside it must be distinct (a slot two tokens
    name holds an unspecified mix of their rows; not checked).

    Args (beyond :func:`fused_kv_norm_rope`'s):
      cache_loc: int32/int64[total_ctx], any device (moved to kv's).
      k_cache, v_cache: dtype-of-kv or float8_e4m3fn[n_layers, num_slots, num_kv_heads,
        head_dim], any strides but zero, written in place; sharing memory with each other
        or with ``kv`` is refused.
      k_scale, v_scale: fp32[n_layers], only for a float8_e4m3fn cache, which then holds
        ``value / scale`` saturated to +-448, rounded once from fp32.
      v_multiplier: as for :func:`fused_kv_norm_rope`; an fp8 V cache holds ``(v * v_multiplier[l]) / v_scale[l]``.
      layer_rope_table: as for :func:`fused_kv_norm_rope`.

    Returns:
      ``(k_cache, v_cache)``.
    """
    tile = _tile(block_tokens, block_heads, num_warps)
    key = tensors = None
    if tile is _NO_TILE:
        tensors = (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale, v_scale,
                   v_multiplier, layer_rope_table)
        key = repeated.layout_key("cache", (num_kv_heads, head_dim, rotary_dim, rope_style), tensors)
        caches = repeated.launch_again(key, tensors)
        if caches is not None:
            return caches
    prepared = prepare_cache_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, num_kv_heads, head_dim,
        rotary_dim, rope_style, k_scale, v_scale, tile, v_multiplier, layer_rope_table,
    )
    caches = repeated.launch_first(key, prepared, tensors) if key is not None else None
    if caches is not None:
        return caches
    return prepared.launch_into_cache(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                                      k_scale, v_scale, v_multiplier, layer_rope_table)
