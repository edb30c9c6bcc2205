"""Eager calls that repeat a layout, launched from what the layout's first call worked out.

A serving or training loop calls the op with the same shapes, strides, dtypes and devices
on every step, and at most new addresses. Validation (``interop.core.spec``), the launch
plan and the kernel's integer arguments depend on nothing else, so the first call of a
layout that launches directly keeps them, with the compiled kernel it launched; later calls
of that layout are recognized by torch's own tensor guards (the C++ check of type,
dispatch keys, dtype, device, requires_grad, sizes and strides that ``torch.compile``
guards its graphs with), check by the outputs' spans that they overlap neither ``kv`` nor
each other (the full check, remembered, where the spans meet), and hand the addresses to
the compiled kernel. A layout is finer than the validation memo's signature (it adds
strides), so a call it lets through is one validation accepted.

Everything else takes the full path every time: a tile override, ``check_positions``,
autograd, ``torch.compile``, ``torch.func``, a small array on another device than ``kv``,
tensors without memory, a float or bool where an int is expected, an alignment or device
not launched before, launches a hook or Triton's debug mode watches, and every call where
torch has no tensor guards.
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import torch
from torch._C import _functorch

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # a torch without them: every call takes the full path
    TensorGuards = None

from fusedkv_torch.kernel import _launch, _launcher, launch_arguments
from interop.core.spec import check_output_buffers

_MAX_KEYS = 1024
_MAX_LAYOUTS_A_KEY = 8

# A call's tensors in the kernel's order (launch_arguments): kv, k_norm_weight, eps,
# cos_sin_cache, positions, cache_loc, k_dest, v_dest, k_scale, v_scale, v_multiplier,
# layer_rope_table.
_TENSORS, _K_DEST, _V_DEST = 12, 6, 7
_GRAD_MODE = 6  # the key's grad mode (layout_key)
_OUTPUT_NAMES = {"call": ("k_out", "v_out"), "cache": ("k_cache", "v_cache")}


class _Layout:
    """What a layout's first direct launch worked out: the guard its given tensors pass,
    the grid, the kernel's integer and constexpr arguments, the byte spans of ``kv`` and
    the destinations from their first element, the shape of outputs to allocate (None
    where they are given), and the compiled kernels launched so far by
    ``(device, address bits)``."""

    __slots__ = ("guard", "grid", "arguments", "spans", "output_shape", "launches")

    def __init__(self, guard, grid, arguments, spans, output_shape):
        self.guard = guard
        self.grid = grid
        self.arguments = arguments
        self.spans = spans
        self.output_shape = output_shape
        self.launches: dict[tuple, object] = {}


class _Kept:
    """The layouts kept under one key, newest first, and what the key says of its calls'
    tensors (in the kernel's order): ``given``, the getter of those not None as given;
    ``launched``, of those not None as launched (with the outputs a call allocates);
    ``k_dest_at``, where ``k_dest`` is among those launched (``v_dest`` next); ``in_place``,
    the getter that puts the addresses of those launched, followed by None, back in their
    places, None for the others."""

    __slots__ = ("given", "launched", "k_dest_at", "in_place", "layouts")

    def __init__(self, given_at: tuple):
        """``given_at``: where the given tensors are among a call's."""
        launched = sorted({*given_at, _K_DEST, _V_DEST})
        # kv, cos_sin_cache and positions are never None here: each getter returns a tuple.
        self.given = operator.itemgetter(*given_at)
        self.launched = operator.itemgetter(*launched)
        self.k_dest_at = launched.index(_K_DEST)
        self.in_place = operator.itemgetter(*[launched.index(i) if i in launched else len(launched)
                                              for i in range(_TENSORS)])
        self.layouts: list[_Layout] = []


_LAYOUTS: dict[tuple, _Kept] = {}
_DATA_PTR = torch.Tensor.data_ptr
_LOW_BITS = (15).__and__  # an address's bits below 16 bytes, which Triton specializes on


def layout_key(kind: str, static: tuple, tensors: tuple) -> Optional[tuple]:
    """The key of a call of ``kind`` (``'call'`` or ``'cache'``) with ``static``
    ``(num_kv_heads, head_dim, rotary_dim, rope_style)`` and ``tensors`` in the kernel's
    order: ``kind``, ``static``, the length of ``kv``, grad mode and which tensors are None
    (the layouts under a key tell the rest apart by their guards, which include each
    tensor's ``requires_grad``); None for a call that takes the full path whatever its
    layout (``torch.compile``, a ``torch.func`` transform, sizes not of type int, a ``kv``
    without a length)."""
    num_kv_heads, head_dim, rotary_dim, rope_style = static
    if (TensorGuards is None or type(num_kv_heads) is not int or type(head_dim) is not int
            or type(rotary_dim) is not int or type(rope_style) is not str or torch.compiler.is_compiling()
            or _functorch.maybe_current_level() is not None):
        return None
    try:
        length = tensors[0].shape[0]
    except (AttributeError, IndexError, TypeError):  # not an array with a length: validation names it
        return None
    # One test a tensor, written out: a comprehension costs as much as the rest of the key.
    (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_dest, v_dest, k_scale, v_scale, v_multiplier,
     layer_rope_table) = tensors
    return (kind, *static, length, torch.is_grad_enabled(), k_norm_weight is None, eps is None,
            cos_sin_cache is None, positions is None, cache_loc is None, k_dest is None, v_dest is None,
            k_scale is None, v_scale is None, v_multiplier is None, layer_rope_table is None)


def launch_again(key: Optional[tuple], tensors: tuple) -> Optional[tuple]:
    """The call's ``(k_dest, v_dest)`` after launching it as its layout's first call did;
    None, having written nothing, where the layout, its alignment or its device was not
    launched directly before (the full path then runs, and :func:`launch_first` keeps it)."""
    kept = _LAYOUTS.get(key)
    layout = _matching(kept, tensors) if kept is not None else None
    if layout is None:
        return None
    if layout.output_shape is not None:  # outputs to allocate: they overlap nothing
        kv = tensors[0]
        tensors = (*tensors[:_K_DEST], kv.new_empty(layout.output_shape), kv.new_empty(layout.output_shape),
                   *tensors[_V_DEST + 1:])
    addresses = [*map(_DATA_PTR, kept.launched(tensors))]
    if layout.output_shape is None:  # given outputs: their spans must meet neither kv nor each other
        kv_at, k_at, v_at = addresses[0], addresses[kept.k_dest_at], addresses[kept.k_dest_at + 1]
        kv_span, k_span, v_span = layout.spans
        if ((kv_at < k_at + k_span and k_at < kv_at + kv_span) or (kv_at < v_at + v_span and v_at < kv_at + kv_span)
                or (k_at < v_at + v_span and v_at < k_at + k_span)):
            names = _OUTPUT_NAMES[key[0]]
            check_output_buffers(tensors[0], ((names[0], tensors[_K_DEST]), (names[1], tensors[_V_DEST])))
    device = torch.cuda.current_device()
    launch = layout.launches.get((device, _alignment(addresses)))
    if launch is None:
        return None
    addresses.append(None)
    if not _launcher.relaunch(launch, layout.grid, device, kept.in_place(addresses), layout.arguments):
        return None
    return tensors[_K_DEST], tensors[_V_DEST]


def _alignment(addresses: list) -> object:
    """What Triton may specialize ``addresses`` on: 0 where each is a multiple of 16 bytes
    (the common case, told by one reduction), else each one's bits below 16."""
    return functools.reduce(operator.or_, addresses) & 15 and tuple(map(_LOW_BITS, addresses))


def _matching(kept: _Kept, tensors: tuple) -> Optional[_Layout]:
    """The layout of ``kept`` whose guard the given tensors pass, or None."""
    given = kept.given(tensors)
    for layout in kept.layouts:
        if layout.guard.check(*given):
            return layout
    return None


def launch_first(key: tuple, prepared, tensors: tuple) -> Optional[tuple]:
    """Launch a call that :func:`launch_again` did not, on what the full path prepared for
    it (``prepared``, a :class:`fusedkv_torch.ops.PreparedCall`), allocating the outputs
    not given, and keep its layout where it launched directly: ``(k_dest, v_dest)``. None,
    having done nothing, for a call :meth:`PreparedCall.launch` must launch (one autograd
    records, one without a plan or with a tile override, arrays to move to ``kv``'s device,
    nothing to write)."""
    kv = tensors[0]
    call = prepared.call
    if key[_GRAD_MODE]:
        for tensor in (kv, tensors[1], tensors[10]):  # kv, k_norm_weight, v_multiplier: autograd records it
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                return None
    if (prepared.plan is None or prepared.compiled is None or call.total_ctx == 0
            or call.n_layers == 0 or any(tensor is not None and tensor.device != kv.device for tensor in tensors)):
        return None
    if key[0] == "cache" and tensors[_K_DEST].shape[1] == 0:  # no slot to write
        return None
    given = tensors
    outputs_given = tensors[_K_DEST] is not None, tensors[_V_DEST] is not None
    if outputs_given[0] != outputs_given[1]:
        return None  # one output given: rare, left to the full path
    if not outputs_given[0]:
        tensors = (*tensors[:_K_DEST], kv.new_empty(call.output_shape), kv.new_empty(call.output_shape),
                   *tensors[_V_DEST + 1:])
    arguments = _in_launch_order(tensors)
    launch = _launch(prepared.plan, *arguments, compiled=prepared.compiled)
    if launch is not None:
        _keep(key, prepared, given, tensors, arguments, launch, None if outputs_given[0] else call.output_shape)
    return tensors[_K_DEST], tensors[_V_DEST]


def _in_launch_order(tensors: tuple) -> tuple:
    """``tensors`` (the kernel's order) in :func:`~fusedkv_torch.kernel.launch_arguments`' order."""
    return (*tensors[:5], tensors[_K_DEST], tensors[_V_DEST], tensors[5], *tensors[_V_DEST + 1:])


def _keep(key: tuple, prepared, given: tuple, tensors: tuple, arguments: tuple, launch, output_shape) -> None:
    """Keep ``launch`` under the layout of ``given`` (the caller's tensors, the kernel's
    order), making the layout where none is kept: ``tensors`` are those launched."""
    kept = _LAYOUTS.get(key)
    layout = _matching(kept, given) if kept is not None else None
    if layout is None:
        present = [tensor for tensor in given if tensor is not None]
        try:
            guard = TensorGuards(*present, dynamic_dims_sizes=[list(tensor.shape) for tensor in present],
                                 dynamic_dims_strides=[list(tensor.stride()) for tensor in present])
        except Exception:  # tensors torch's guards do not take: the full path every time
            return
        grid, constexprs, _, _ = prepared.plan
        _, plain_ints, ints = launch_arguments(*arguments)
        spans = tuple(_span(tensors[index]) for index in (0, _K_DEST, _V_DEST))
        layout = _Layout(guard, grid, (*plain_ints, *ints, *constexprs), spans, output_shape)
        if kept is None:
            if len(_LAYOUTS) >= _MAX_KEYS:
                _LAYOUTS.clear()
            kept = _LAYOUTS[key] = _Kept(tuple(i for i, tensor in enumerate(given) if tensor is not None))
        kept.layouts.insert(0, layout)
        del kept.layouts[_MAX_LAYOUTS_A_KEY:]
    addresses = [*map(_DATA_PTR, kept.launched(tensors))]
    layout.launches[(torch.cuda.current_device(), _alignment(addresses))] = launch


def _span(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to past its last (strides are never negative in torch)."""
    return (1 + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
