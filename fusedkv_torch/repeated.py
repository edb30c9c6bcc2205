"""Eager calls that repeat a layout, launched from what the layout's first call worked out.

A serving or training loop calls the op with the same shapes, strides, dtypes and devices
on every step, and at most new addresses. Validation (``interop.core.spec``), the launch
plan and the kernel's integer arguments depend on nothing else, so the first call of a
layout that launches directly keeps them, with the compiled kernel it launched; later calls
of that layout read each tensor's layout and address, check by the outputs' spans that
they overlap neither ``kv`` nor each other (the full check, remembered, where the spans
meet), and hand the addresses to the compiled kernel. The layout's key is finer than the
validation memo's signature (it adds strides), so a call it lets through is one
validation accepted.

Everything else takes the full path every time: a tile override, ``check_positions``,
autograd, ``torch.compile``, ``torch.func``, a small array on another device than ``kv``,
tensors without memory, a float or bool where an int is expected, an alignment or device
not launched before, and launches a hook or Triton's debug mode watches.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._C import _functorch

from fusedkv_torch.kernel import _launch, _launcher, launch_arguments
from interop.core.spec import check_output_buffers

_MAX_LAYOUTS = 1024

# A call's tensors in the kernel's order (launch_arguments): kv, k_norm_weight, eps,
# cos_sin_cache, positions, cache_loc, k_dest, v_dest, k_scale, v_scale, v_multiplier,
# layer_rope_table.
_K_DEST, _V_DEST = 6, 7
_OUTPUT_NAMES = {"call": ("k_out", "v_out"), "cache": ("k_cache", "v_cache")}


class _Layout:
    """What a layout's first direct launch worked out: the grid, the kernel's integer and
    constexpr arguments, the byte spans of ``kv`` and the destinations from their first
    element, the shape of outputs to allocate (None where they are given), and the
    compiled kernels launched so far by ``(device, address bits)``."""

    __slots__ = ("grid", "arguments", "spans", "output_shape", "launches")

    def __init__(self, grid, arguments, spans, output_shape):
        self.grid = grid
        self.arguments = arguments
        self.spans = spans
        self.output_shape = output_shape
        self.launches: dict[tuple, object] = {}


_LAYOUTS: dict[tuple, _Layout] = {}


def layout_key(kind: str, static: tuple, tensors: tuple) -> Optional[tuple]:
    """The key of a call of ``kind`` (``'call'`` or ``'cache'``) with ``static``
    ``(num_kv_heads, head_dim, rotary_dim, rope_style)`` and ``tensors`` in the kernel's
    order: every tensor's type, shape, strides, dtype and device index; None for a call
    that takes the full path whatever its layout (``torch.compile``, a ``torch.func``
    transform, autograd, sizes not of type int, arrays that are not torch tensors)."""
    num_kv_heads, head_dim, rotary_dim, rope_style = static
    if (type(num_kv_heads) is not int or type(head_dim) is not int or type(rotary_dim) is not int
            or type(rope_style) is not str or torch.compiler.is_compiling()
            or _functorch.maybe_current_level() is not None):
        return None
    if torch.is_grad_enabled():
        kv, k_norm_weight, v_multiplier = tensors[0], tensors[1], tensors[10]
        for tensor in (kv, k_norm_weight, v_multiplier):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                return None
    try:
        return (kind, *static, *[None if tensor is None else
                                 (type(tensor), tensor.shape, tensor.stride(), tensor.dtype, tensor.get_device())
                                 for tensor in tensors])
    except Exception:  # not a torch tensor: validation names it
        return None


def launch_again(key: Optional[tuple], tensors: tuple) -> Optional[tuple]:
    """The call's ``(k_dest, v_dest)`` after launching it as its layout's first call did;
    None, having written nothing, where the layout, its alignment or its device was not
    launched directly before (the full path then runs, and :func:`launch_first` keeps it)."""
    try:
        layout = _LAYOUTS.get(key) if key is not None else None
    except TypeError:  # an unhashable attribute of an object validation refuses
        return None
    if layout is None:
        return None
    if layout.output_shape is not None:  # outputs to allocate: they overlap nothing
        kv = tensors[0]
        k_dest = tensors[_K_DEST] if tensors[_K_DEST] is not None else kv.new_empty(layout.output_shape)
        v_dest = tensors[_V_DEST] if tensors[_V_DEST] is not None else kv.new_empty(layout.output_shape)
        tensors = (*tensors[:_K_DEST], k_dest, v_dest, *tensors[_V_DEST + 1:])
    addresses = [None if tensor is None else tensor.data_ptr() for tensor in tensors]
    if layout.output_shape is None and _spans_meet(layout.spans, addresses[0], addresses[_K_DEST],
                                                   addresses[_V_DEST]):
        names = _OUTPUT_NAMES[key[0]]
        check_output_buffers(tensors[0], ((names[0], tensors[_K_DEST]), (names[1], tensors[_V_DEST])))
    device = torch.cuda.current_device()
    launch = layout.launches.get((device, *[address & 15 for address in addresses if address is not None]))
    if launch is None or not _launcher.relaunch(launch, layout.grid, device, addresses, layout.arguments):
        return None
    return tensors[_K_DEST], tensors[_V_DEST]


def _spans_meet(spans: tuple, kv: int, k_dest: int, v_dest: int) -> bool:
    kv_span, k_span, v_span = spans
    return ((kv < k_dest + k_span and k_dest < kv + kv_span) or (kv < v_dest + v_span and v_dest < kv + kv_span)
            or (k_dest < v_dest + v_span and v_dest < k_dest + k_span))


def launch_first(key: Optional[tuple], prepared, tensors: tuple) -> Optional[tuple]:
    """Launch a call that :func:`launch_again` did not, on what the full path prepared for
    it (``prepared``, a :class:`fusedkv_torch.ops.PreparedCall`), allocating the outputs
    not given, and keep its layout where it launched directly: ``(k_dest, v_dest)``. None,
    having done nothing, for a call :meth:`PreparedCall.launch` must launch (one without a
    plan or with a tile override, arrays to move to ``kv``'s device, nothing to write)."""
    kv = tensors[0]
    call = prepared.call
    if (key is None or prepared.plan is None or prepared.compiled is None or call.total_ctx == 0
            or call.n_layers == 0 or any(tensor is not None and tensor.device != kv.device for tensor in tensors)):
        return None
    if key[0] == "cache" and tensors[_K_DEST].shape[1] == 0:  # no slot to write
        return None
    given = tensors[_K_DEST] is not None, tensors[_V_DEST] is not None
    if given[0] != given[1]:
        return None  # one output given: rare, left to the full path
    if not given[0]:
        tensors = (*tensors[:_K_DEST], kv.new_empty(call.output_shape), kv.new_empty(call.output_shape),
                   *tensors[_V_DEST + 1:])
    arguments = _in_launch_order(tensors)
    launch = _launch(prepared.plan, *arguments, compiled=prepared.compiled)
    if launch is not None:
        _keep(key, prepared, tensors, arguments, launch, None if given[0] else call.output_shape)
    return tensors[_K_DEST], tensors[_V_DEST]


def _in_launch_order(tensors: tuple) -> tuple:
    """``tensors`` (the kernel's order) in :func:`~fusedkv_torch.kernel.launch_arguments`' order."""
    return (*tensors[:5], tensors[_K_DEST], tensors[_V_DEST], tensors[5], *tensors[_V_DEST + 1:])


def _keep(key: tuple, prepared, tensors: tuple, arguments: tuple, launch, output_shape) -> None:
    layout = _LAYOUTS.get(key)
    if layout is None:
        grid, constexprs, _, _ = prepared.plan
        _, plain_ints, ints = launch_arguments(*arguments)
        spans = tuple(_span(tensors[index]) for index in (0, _K_DEST, _V_DEST))
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(grid, (*plain_ints, *ints, *constexprs), spans, output_shape)
    addresses = [tensor.data_ptr() for tensor in tensors if tensor is not None]
    layout.launches[(torch.cuda.current_device(), *[address & 15 for address in addresses])] = launch


def _span(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (strides are never negative in torch)."""
    return (1 + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
