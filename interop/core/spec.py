"""The op's contract: its static configuration and the one validation of a call.

Every entry point (the NumPy reference, the Triton and Pallas wrappers, the
DLPack dispatcher, the materializers) calls :func:`validate_call` before it
launches or writes anything, so a rejected call leaves every caller buffer
untouched and raises the same ``ValueError`` or ``TypeError`` whatever the
framework. The arrays only need ``.shape`` and ``.dtype`` (NumPy, torch, jax, and
jax tracers under ``jit`` all qualify). Two more checks are separate functions
because their callers run them at other times: :func:`check_arrays` (is each
argument an array the entry point takes: runs before anything reads its
attributes) and :func:`check_output_buffers` (do the outputs overlap: depends on
addresses, so it runs on every call). :func:`accept_call` runs :func:`check_arrays`
and :func:`validate_call` once per :func:`call_signature`, the key by which every
entry point remembers the calls it has checked.
Sizes are Python ints or other ``numbers.Integral`` such as NumPy's int64 (made
ints here); ``bool``, floats (even ``2.0``), strings and None are refused, never
truncated. Nothing here imports torch or jax.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
import types

import numpy as np

ROPE_STYLES = ("neox", "gptj")
KV_DTYPES = ("bfloat16", "float16", "float32")
POSITION_DTYPES = ("int32", "int64")
# The cos/sin table is read as fp32 in the kernels, so a table kept in the model's dtype serves too.
ROPE_TABLE_DTYPES = ("float32", "bfloat16", "float16")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")

# int64 indices narrowed to int32 saturate into this range: a position or slot past it is
# past every cos/sin table and cache, and stays out of range instead of wrapping into it.
SATURATED_INDEX_RANGE = (-1, 2**31 - 1)

# DLPack device types (dlpack.h): the framework-neutral way to name a device.
DLPACK_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "rocm"}


@dataclasses.dataclass(frozen=True)
class FusedKVConfig:
    """Static configuration of the op; hashable so jit can key compilations on it."""

    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_style: str = "neox"

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def output_shape(self, n_layers: int, total_ctx: int) -> tuple[int, int, int, int]:
        return (n_layers, total_ctx, self.num_kv_heads, self.head_dim)


@dataclasses.dataclass(frozen=True)
class CallShape:
    """What a validated call is about: sizes the launchers need."""

    config: FusedKVConfig
    total_ctx: int
    n_layers: int
    max_position: int

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return self.config.output_shape(self.n_layers, self.total_ctx)


def dtype_name(dtype) -> str:
    """``torch.bfloat16``, ``np.dtype('bfloat16')`` and ``jnp.bfloat16`` all -> ``'bfloat16'``."""
    name = getattr(dtype, "name", None)
    if isinstance(name, str) and not str(dtype).startswith("torch."):
        return name
    return str(dtype).removeprefix("torch.")


def device_name(array) -> str | None:
    """``'cpu'`` or ``'cuda:0'`` from the array's DLPack device; None where unknown (jit tracers)."""
    device = getattr(array, "device", None)
    if type(device).__module__ == "torch" and type(device).__name__ == "device":
        # torch.compile cannot trace __dlpack_device__ (it returns an enum), but reads torch.device.
        return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    dlpack_device = getattr(array, "__dlpack_device__", None)
    if dlpack_device is None:
        return None
    try:
        device_type, device_id = dlpack_device()
    except Exception:  # a tracer or a deleted buffer has no device to report
        return None
    kind = DLPACK_DEVICE_NAMES.get(int(device_type), f"dlpack{int(device_type)}")
    return "cpu" if kind == "cpu" else f"{kind}:{int(device_id)}"


def _shape(array) -> tuple[int, ...]:
    return tuple(int(d) for d in array.shape)


def _type_name(value) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    if framework_of(value) == "jax":
        return "jax.Array"
    return f"{kind.__module__.split('.')[0]}.{kind.__qualname__}"


def integer_argument(name: str, value, expected: str) -> int:
    """``value`` as an int; ``TypeError`` naming ``name`` unless it is an integer.

    ``numbers.Integral`` (Python and NumPy ints) qualifies, ``bool`` does not; nothing
    else is converted, so ``2.5`` can never become 2.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"Invalid {name} for fused KV materialization: "
            f"got {value!r} ({_type_name(value)}), expected {expected}."
        )
    return int(value)


def size_argument(name: str, value) -> int:
    """A size (heads, head_dim, a table's rows...) as a positive int, refused otherwise:
    ``TypeError`` for a value that is not an integer, ``ValueError`` for zero and below."""
    value = integer_argument(name, value, "a positive int")
    if value <= 0:
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got {value}, expected a positive int."
        )
    return value


def tile_argument(name: str, value) -> int:
    """A tile override (tokens per block, warps) as an int that is a power of two."""
    value = integer_argument(name, value, "a power of two (an int)")
    if value < 1 or value & (value - 1):
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got {value}, expected a power of two."
        )
    return value


# Which framework's array each type is, decided once per type: this runs on every call.
_FRAMEWORK_OF_TYPE: dict[type, str | None] = {}


def framework_of(array) -> str | None:
    """``'numpy'``, ``'torch'``, ``'jax'`` (arrays and tracers), the top-level module of
    another ``__dlpack__`` producer (``'cupy'``), or None for what is not an array."""
    try:
        return _FRAMEWORK_OF_TYPE[type(array)]
    except KeyError:
        return framework_of_type(type(array))


def framework_of_type(kind: type) -> str | None:
    """:func:`framework_of` for arrays of type ``kind``."""
    try:
        return _FRAMEWORK_OF_TYPE[kind]
    except KeyError:
        pass
    modules = [(cls.__module__ or "").split(".")[0] for cls in kind.__mro__]
    if issubclass(kind, np.ndarray):
        framework = "numpy"
    elif any(cls.__name__ == "Tensor" and cls.__module__ == "torch" for cls in kind.__mro__):
        framework = "torch"
    elif "jax" in modules or "jaxlib" in modules:
        framework = "jax"
    elif hasattr(kind, "__dlpack__"):
        framework = modules[0]
    else:
        framework = None
    _FRAMEWORK_OF_TYPE[kind] = framework
    return framework


# What each entry point takes: the frameworks (None: any __dlpack__ array) and how to say it.
_ACCEPTED_ARRAYS = {
    "torch": (("torch",), "a torch.Tensor (fusedkv_torch takes torch tensors; "
                          "interop.fused_kv_norm_rope takes arrays of any framework)"),
    "jax": (("jax", "numpy"), "a jax or NumPy array (fusedkv_jax takes jax and NumPy arrays; "
                              "interop.fused_kv_norm_rope takes arrays of any framework)"),
    "any": (None, "an array with __dlpack__ (NumPy, torch, jax, CuPy)"),
}


def check_arrays(named_arrays, accepted: str) -> None:
    """Refuse, before anything reads them, arguments that are not arrays the entry point takes.

    ``named_arrays``: ``(name, array)`` pairs, None for an optional argument left out.
    ``accepted``: ``'torch'`` (fusedkv_torch), ``'jax'`` (fusedkv_jax: jax or NumPy
    arrays) or ``'any'`` (interop: anything with ``__dlpack__``). A wrong kind of
    object raises ``TypeError``; a NumPy array with a negative stride or a byte order
    other than the machine's (which neither torch nor jax can take in) raises
    ``ValueError`` in every entry point alike.
    """
    frameworks, expected = _ACCEPTED_ARRAYS[accepted]
    for name, array in named_arrays:
        if array is None:
            continue
        framework = framework_of(array)
        if framework is None or (frameworks is not None and framework not in frameworks):
            raise TypeError(
                f"Invalid {name} for fused KV materialization: "
                f"got {_type_name(array)}, expected {expected}."
            )
        if framework == "numpy" and any(stride < 0 for stride in array.strides):
            raise ValueError(
                f"Invalid {name} for fused KV materialization: got strides {array.strides} with "
                f"a negative stride, expected non-negative strides (pass np.ascontiguousarray({name}))."
            )
        if framework == "numpy" and not array.dtype.isnative:
            raise ValueError(
                f"Invalid {name} for fused KV materialization: got a {_byte_order(array.dtype)} array "
                f"(dtype {array.dtype.str}), expected native byte order "
                f"(pass {name}.astype({name}.dtype.newbyteorder('=')))."
            )


def _byte_order(dtype) -> str:
    return "big-endian" if dtype.byteorder == ">" else "little-endian"


def validate_call(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    v_multiplier=None,
    k_out=None,
    v_out=None,
    check_buffers: bool = True,
    layer_rope_table=None,
) -> CallShape:
    """Check one call against CONTRACT.md (Validation); raise on the first problem.

    Order (users grep for these messages): the sizes (``num_kv_heads`` and
    ``head_dim`` positive ints, ``rotary_dim`` an int), then kv rank, kv trailing
    dim, rotary/head dim pair, k_norm_weight shape, eps shape (both None for a draft
    without a K-norm), v_multiplier, then the checks the
    seeds do not cover (rope style, dtypes, cos/sin cache and, for a 3-D cache of one
    table per RoPE, ``layer_rope_table``, positions), then k_out
    and v_out: shape, device/dtype, then (``check_buffers``) their memory, by
    :func:`check_output_buffers`. Every check runs even when ``total_ctx == 0`` so a
    misconfigured model fails on its first, often empty, warm-up call. A caller that
    skips ``check_buffers`` because it remembers validated metadata runs
    :func:`check_output_buffers` itself, on every call.
    """
    num_kv_heads = size_argument("num_kv_heads", num_kv_heads)
    head_dim = size_argument("head_dim", head_dim)
    rotary_dim = integer_argument("rotary_dim", rotary_dim, f"an even int in [2, {head_dim}]")
    kv_shape = _shape(kv)
    if len(kv_shape) != 3:
        raise ValueError(
            "Invalid stacked fused KV projection shape: "
            f"got {kv_shape}, expected 3D [total_ctx, n_layers, kv_size*2]."
        )
    total_ctx, n_layers, kv_dim = kv_shape
    config = FusedKVConfig(num_kv_heads, head_dim, rotary_dim, rope_style)
    if kv_dim != config.kv_size * 2:
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got {kv_shape}, expected trailing dim {config.kv_size * 2}."
        )
    if config.rotary_dim <= 0 or config.rotary_dim > config.head_dim or config.rotary_dim % 2:
        raise ValueError(
            "Invalid fused KV rotary/head dim pair: "
            f"rotary_dim={config.rotary_dim}, head_dim={config.head_dim}."
        )
    _check_norm(k_norm_weight, eps, n_layers, config.head_dim)
    _check_per_layer("v_multiplier", v_multiplier, n_layers, "a per-layer multiplier of V, or None")
    _check_supported(kv, k_norm_weight, eps, cos_sin_cache, positions, config, total_ctx, n_layers,
                     layer_rope_table)
    expected_out_shape = config.output_shape(n_layers, total_ctx)
    outputs = (("k_out", k_out), ("v_out", v_out))
    for name, out in outputs:
        if out is not None:
            _check_output(name, out, kv, expected_out_shape)
    if check_buffers:
        check_output_buffers(kv, outputs)
    return CallShape(config, total_ctx, n_layers, int(cos_sin_cache.shape[-2]))


def check_positions_in_range(low: int, high: int, max_position: int) -> None:
    """``check_positions``: refuse a call whose positions (``low`` the least, ``high`` the
    greatest, read from the device by the backend) fall outside the cos/sin table."""
    if low < 0 or high >= max_position:
        raise ValueError(
            "Invalid positions for fused KV materialization: got values outside "
            f"[0, {max_position}) (min {low}, max {high}), expected every position in "
            f"[0, {max_position})."
        )


def _check_norm(k_norm_weight, eps, n_layers, head_dim):
    """The K-norm's arguments: both arrays of the stacked shapes, or both None (no K-norm)."""
    if k_norm_weight is None:
        if eps is not None:
            raise ValueError(
                "Invalid eps for fused KV materialization: got an array without a k_norm_weight, "
                "expected None (eps is the K-norm's epsilon; k_norm_weight=None means no K-norm)."
            )
        return
    if _shape(k_norm_weight) != (n_layers, head_dim):
        raise ValueError(
            "Invalid stacked k_norm_weight shape for fused KV materialization: "
            f"got {_shape(k_norm_weight)}, expected {(n_layers, head_dim)}."
        )
    if eps is None:
        raise ValueError(
            "Invalid eps for fused KV materialization: got None with a k_norm_weight, "
            f"expected float32{(n_layers,)}."
        )
    if _shape(eps) != (n_layers,):
        raise ValueError(
            "Invalid stacked eps shape for fused KV materialization: "
            f"got {_shape(eps)}, expected {(n_layers,)}."
        )


def _check_per_layer(name, array, n_layers, what):
    """An optional fp32 ``[n_layers]`` array (``what`` says what it is for)."""
    if array is None:
        return
    if _shape(array) != (n_layers,) or dtype_name(array.dtype) != "float32":
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got {dtype_name(array.dtype)}{_shape(array)}, "
            f"expected float32{(n_layers,)} ({what})."
        )


def _check_supported(kv, k_norm_weight, eps, cos_sin_cache, positions, config, total_ctx, n_layers,
                     layer_rope_table):
    if config.rope_style not in ROPE_STYLES:
        raise ValueError(
            f"Invalid rope_style for fused KV materialization: got {config.rope_style!r}, "
            f"expected one of {ROPE_STYLES}."
        )
    for name, array, allowed in (
        ("kv", kv, KV_DTYPES),
        ("k_norm_weight", k_norm_weight, _FLOAT_DTYPES),
        ("eps", eps, ("float32",)),
        ("cos_sin_cache", cos_sin_cache, ROPE_TABLE_DTYPES),
        ("positions", positions, POSITION_DTYPES),
    ):
        if array is not None and dtype_name(array.dtype) not in allowed:
            raise ValueError(
                f"Invalid {name} dtype for fused KV materialization: "
                f"got {dtype_name(array.dtype)}, expected one of {allowed}."
            )
    cache_shape = _shape(cos_sin_cache)
    if len(cache_shape) == 3 and (cache_shape[2] != config.rotary_dim or 0 in cache_shape):
        raise ValueError(
            "Invalid cos_sin_cache shape for fused KV materialization: got "
            f"{cache_shape}, expected (n_tables, max_pos, {config.rotary_dim}) with n_tables > 0 and max_pos > 0."
        )
    if len(cache_shape) not in (2, 3) or cache_shape[-1] != config.rotary_dim or cache_shape[0] == 0:
        raise ValueError(
            "Invalid cos_sin_cache shape for fused KV materialization: "
            f"got {cache_shape}, expected (max_pos, {config.rotary_dim}) with max_pos > 0."
        )
    _check_layer_rope_table(layer_rope_table, cache_shape, n_layers)
    if _shape(positions) != (total_ctx,):
        raise ValueError(
            "Invalid positions shape for fused KV materialization: "
            f"got {_shape(positions)}, expected {(total_ctx,)}."
        )


def _check_layer_rope_table(layer_rope_table, cache_shape, n_layers):
    """Each layer's table index: given exactly when ``cos_sin_cache`` holds several tables."""
    if len(cache_shape) == 2:
        if layer_rope_table is not None:
            raise ValueError(
                "Invalid layer_rope_table for fused KV materialization: got an array with a 2-D "
                "cos_sin_cache, expected None (one table serves every layer; a 3-D cos_sin_cache "
                "[n_tables, max_pos, rotary_dim] takes a table index per layer)."
            )
        return
    if layer_rope_table is None:
        raise ValueError(
            "Invalid layer_rope_table for fused KV materialization: got None with a 3-D cos_sin_cache "
            f"of {cache_shape[0]} tables, expected int32{(n_layers,)} naming each layer's table."
        )
    if _shape(layer_rope_table) != (n_layers,) or dtype_name(layer_rope_table.dtype) != "int32":
        raise ValueError(
            "Invalid layer_rope_table for fused KV materialization: got "
            f"{dtype_name(layer_rope_table.dtype)}{_shape(layer_rope_table)}, expected int32{(n_layers,)} "
            "(each layer's table in cos_sin_cache)."
        )


def _check_output(name, out, kv, expected_shape):
    if _shape(out) != expected_shape:
        raise ValueError(
            f"Invalid {name} shape for fused KV materialization: "
            f"got {_shape(out)}, expected {expected_shape}."
        )
    got_device, want_device = device_name(out), device_name(kv)
    device_differs = got_device is not None and want_device is not None and got_device != want_device
    if device_differs or dtype_name(out.dtype) != dtype_name(kv.dtype):
        raise ValueError(
            f"Invalid {name} device/dtype for fused KV materialization: "
            f"got device={got_device}, dtype={dtype_name(out.dtype)}, "
            f"expected device={want_device}, dtype={dtype_name(kv.dtype)}."
        )


def check_output_buffers(kv, outputs) -> None:
    """Refuse outputs the kernel would write wrongly, from their memory layout on the host.

    ``outputs``: ``(name, array)`` pairs (``k_out``/``v_out`` or the two caches), None
    for one not given. Refused, in this order for each output: a read-only NumPy
    array; a zero stride on a dimension of size > 1 (an expanded view: several
    elements, one address); memory shared with ``kv`` or with an earlier output (the
    same array twice included). Only the elements matter: two interleaved views of
    one pool (K and V of a layer side by side) are disjoint and pass. jax arrays are
    never written in place, so for them only the same array twice is refused. An
    output without elements (no layers, tokens or slots) holds no memory and passes.

    Reads addresses, strides and sizes, no device work. It runs on every call, so the
    common case is a few attribute reads per array: buffers whose allocations (a torch
    tensor's storage) or spans do not meet are apart. Where they meet, whether the
    elements do is decided once per relative layout (their spans, then
    ``np.shares_memory``) and remembered.
    """
    seen = None
    for name, out in outputs:
        if out is None:
            continue
        if seen is None:  # kv is read only where an output is given: traced calls give none
            seen = [] if kv is None else [("kv", kv, *_extent(kv, framework_of(kv)))]
        framework = framework_of(out)
        # A contiguous torch tensor (the common case) is writable and has no zero stride.
        if framework != "torch" or not out.is_contiguous():
            if 0 in out.shape:  # no element: nothing to write, no memory to share
                continue
            _check_writable_layout(name, out, framework)
        low, high = _extent(out, framework)
        for other_name, other, other_low, other_high in seen:
            if out is other or (low < other_high and other_low < high):
                _check_apart(name, out, other_name, other)
        seen.append((name, out, low, high))


def _check_apart(name, out, other_name, other) -> None:
    """Refuse ``out`` where it is ``other`` or shares an element with it; called where their
    extents meet or they are one array (a jax array's extent is empty)."""
    if 0 in out.shape:  # no element: nothing to write, no memory to share
        return
    shared = out is other or _share_memory(out, other)
    if shared is None:
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got a buffer whose overlap with "
            f"{other_name} could not be ruled out, expected outputs that overlap neither "
            "each other nor kv."
        )
    if shared:
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got a buffer overlapping "
            f"{other_name}, expected outputs that overlap neither each other nor kv."
        )


def _check_writable_layout(name, out, framework) -> None:
    """Refuse a read-only NumPy array and a zero stride on a dimension of size > 1."""
    if framework == "numpy" and not out.flags.writeable:
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got a read-only array, "
            f"expected a writable one (pass a copy: np.array({name}))."
        )
    layout = _layout(out)
    if layout is not None and any(step == 0 and size > 1 for size, step in zip(layout[1], layout[2])):
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got strides {tuple(layout[2])} "
            "with a zero stride, expected no zero strides."
        )


def _extent(array, framework: str | None) -> tuple[int, int]:
    """Bytes ``[low, high)`` that hold all of ``array``'s elements, cheaply: a torch
    tensor's storage (its allocation, or the memory it was imported from), the span
    of the elements otherwise; an empty range, which meets none, for arrays never
    written in place (jax) or without memory yet (tracers)."""
    if framework == "torch":
        storage = array.untyped_storage()
        low = storage.data_ptr()
        return low, low + storage.nbytes()
    layout = _layout(array)
    return (0, 0) if layout is None else _span(layout)


def _layout(array) -> tuple | None:
    """``(address, shape, strides, unit, itemsize)`` of an array that can be written in
    place: strides as its framework counts them, in units of ``unit`` bytes (torch:
    elements; NumPy and the CUDA array interface: bytes). None for jax arrays
    (immutable) and tracers (no memory yet)."""
    framework = framework_of(array)
    if framework == "torch":
        itemsize = array.element_size()
        return array.data_ptr(), array.shape, array.stride(), itemsize, itemsize
    if framework == "numpy":
        return array.__array_interface__["data"][0], array.shape, array.strides, 1, array.itemsize
    if framework in (None, "jax"):
        return None
    interface = getattr(array, "__cuda_array_interface__", None)  # CuPy and other GPU producers
    if interface is None:
        return None
    shape, itemsize = tuple(interface["shape"]), int(interface["typestr"][2:])
    strides = interface.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], itemsize
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
    return interface["data"][0], shape, tuple(strides), 1, itemsize


def _span(layout) -> tuple[int, int]:
    """The bytes ``[low, high)`` from the first element to past the last (empty if none)."""
    address, shape, strides, unit, itemsize = layout
    if 0 in shape:
        return address, address
    low = high = 0
    for size, step in zip(shape, strides):
        if step < 0:
            low += step * (size - 1)
        else:
            high += step * (size - 1)
    return address + low * unit, address + high * unit + itemsize


# Whether two layouts at a given distance share an element, by (distance, layouts): the
# answer does not depend on where they lie, and deciding it costs microseconds.
_SHARED_BY_RELATIVE_LAYOUT: dict[tuple, bool | None] = {}
_MAX_REMEMBERED_LAYOUTS = 4096
_OVERLAP_WORK_LIMIT = 1 << 16  # np.shares_memory's bound; past it, overlap is not ruled out


def _share_memory(a_array, b_array) -> bool | None:
    """Whether two arrays share a byte: False when they cannot (their elements' spans do
    not meet, or one is never written in place), True when they do, None when deciding
    it exceeds the work limit."""
    a, b = _layout(a_array), _layout(b_array)
    if a is None or b is None:
        return False
    key = (b[0] - a[0], a[1:], b[1:])
    try:
        return _SHARED_BY_RELATIVE_LAYOUT[key]
    except KeyError:
        pass
    shared = False
    (a_low, a_high), (b_low, b_high) = _span(a), _span(b)
    if a_low < b_high and b_low < a_high:
        try:
            shared = bool(np.shares_memory(_described(a), _described(b), max_work=_OVERLAP_WORK_LIMIT))
        except np.exceptions.TooHardError:
            shared = None
    if len(_SHARED_BY_RELATIVE_LAYOUT) >= _MAX_REMEMBERED_LAYOUTS:
        _SHARED_BY_RELATIVE_LAYOUT.clear()
    _SHARED_BY_RELATIVE_LAYOUT[key] = shared
    return shared


def _described(layout) -> np.ndarray:
    """A read-only NumPy array of opaque elements at ``layout``'s addresses, for
    ``np.shares_memory``, which reads the layout only, never the memory (which may be
    a GPU's)."""
    address, shape, strides, unit, itemsize = layout
    interface = dict(version=3, shape=tuple(shape), typestr=f"|V{itemsize}", data=(address, True),
                     strides=tuple(step * unit for step in strides))
    return np.asarray(types.SimpleNamespace(__array_interface__=interface))


CACHE_ONLY_DTYPES = ("float8_e4m3fn",)


def validate_cache_call(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    cache_loc,
    k_cache,
    v_cache,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    k_scale=None,
    v_scale=None,
    v_multiplier=None,
    check_buffers: bool = True,
    layer_rope_table=None,
) -> CallShape:
    """:func:`validate_call`, then the paged-cache arguments of the op written into a cache.

    ``k_cache``/``v_cache`` are ``[n_layers, num_slots, num_kv_heads, head_dim]`` of the
    dtype of ``kv`` or float8_e4m3fn; an fp8 cache needs fp32 ``[n_layers]`` scales.
    Last (``check_buffers``), the caches' memory, as the outputs' in :func:`validate_call`.
    """
    call = validate_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
        v_multiplier=v_multiplier, layer_rope_table=layer_rope_table,
    )
    if dtype_name(cache_loc.dtype) not in POSITION_DTYPES:
        raise ValueError(
            "Invalid cache_loc dtype for fused KV materialization: "
            f"got {dtype_name(cache_loc.dtype)}, expected one of {POSITION_DTYPES}."
        )
    if _shape(cache_loc) != (call.total_ctx,):
        raise ValueError(
            "Invalid cache_loc shape for fused KV materialization: "
            f"got {_shape(cache_loc)}, expected {(call.total_ctx,)}."
        )
    config = call.config
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        shape = _shape(cache)
        if (len(shape) != 4 or shape[0] != call.n_layers
                or shape[2:] != (config.num_kv_heads, config.head_dim)):
            raise ValueError(
                f"Invalid {name} shape for fused KV materialization: got {shape}, expected "
                f"(n_layers, num_slots, num_kv_heads, head_dim) = "
                f"({call.n_layers}, num_slots, {config.num_kv_heads}, {config.head_dim})."
            )
    if _shape(v_cache) != _shape(k_cache):
        raise ValueError(
            "Invalid v_cache shape for fused KV materialization: "
            f"got {_shape(v_cache)}, expected the shape of k_cache {_shape(k_cache)}."
        )
    allowed = (dtype_name(kv.dtype),) + CACHE_ONLY_DTYPES
    for name, cache, scale_name, scale in (("k_cache", k_cache, "k_scale", k_scale),
                                           ("v_cache", v_cache, "v_scale", v_scale)):
        got_device, want_device = device_name(cache), device_name(kv)
        device_differs = got_device is not None and want_device is not None and got_device != want_device
        if device_differs or dtype_name(cache.dtype) not in allowed:
            raise ValueError(
                f"Invalid {name} device/dtype for fused KV materialization: "
                f"got device={got_device}, dtype={dtype_name(cache.dtype)}, "
                f"expected device={want_device}, dtype one of {allowed}."
            )
        _check_scale(scale_name, scale, dtype_name(cache.dtype) in CACHE_ONLY_DTYPES, call.n_layers)
    if check_buffers:
        check_output_buffers(kv, (("k_cache", k_cache), ("v_cache", v_cache)))
    return call


def _check_scale(name, scale, needed, n_layers):
    if not needed:
        if scale is not None:
            raise ValueError(
                f"Invalid {name} for fused KV materialization: got a scale, expected None "
                "for a cache that is not float8_e4m3fn."
            )
        return
    if scale is None or _shape(scale) != (n_layers,) or dtype_name(scale.dtype) != "float32":
        got = None if scale is None else f"{dtype_name(scale.dtype)}{_shape(scale)}"
        raise ValueError(
            f"Invalid {name} for fused KV materialization: got {got}, "
            f"expected float32{(n_layers,)} for a float8_e4m3fn cache."
        )


# Remembering accepted calls. check_arrays and validation read the static arguments, each
# array's type (and a NumPy array's strides), shape and dtype, and kv's and the outputs'
# device; in Python that costs as much host time as a decode-size launch.
# :func:`call_signature` is all of that as one hashable key, and every entry point that
# skips checking a call again keys on it, so a check added there reads nothing the key
# does not hold. What depends on addresses (check_output_buffers) is not remembered: its
# callers run it on every call.
_ACCEPTED_CALLS: dict[tuple, AcceptedCall] = {}
_MAX_ACCEPTED_CALLS = 4096

_CALL_ARRAYS = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "k_out", "v_out", "v_multiplier",
                "layer_rope_table")
_CACHE_CALL_ARRAYS = _CALL_ARRAYS[:5] + ("cache_loc", "k_cache", "v_cache", "k_scale", "v_scale", "v_multiplier",
                                         "layer_rope_table")


class AcceptedCall:
    """A call validation accepted: its sizes (``shape``), and what was prepared for calls
    of its signature (``prepared``: the torch backend keeps its launch plan and compiled
    kernels under ``'torch'``, ``interop`` its route under ``('interop', backend)``)."""

    __slots__ = ("shape", "prepared")

    def __init__(self, shape: CallShape):
        self.shape = shape
        self.prepared: dict = {}


def _signature_reader(kind: type):
    """What of an object of type ``kind`` a call's signature holds: for an array its shape,
    dtype and device, the device as cheaply as it decides :func:`device_name` (a torch
    tensor's ``torch.device``; a jax array's sharding, None for a tracer, which has no
    device either; a NumPy array's strides instead, as it is always on the host and
    :func:`check_arrays` reads them; else the name). Nothing for what is not an array,
    which :func:`check_arrays` refuses before anything else is read."""
    framework = framework_of_type(kind)
    if framework is None:
        return lambda value: None
    if framework == "torch":
        return operator.attrgetter("shape", "dtype", "device")
    if framework == "numpy":
        return operator.attrgetter("shape", "dtype", "strides")
    if framework == "jax":
        if any(base.__name__ == "Tracer" for base in kind.__mro__):
            # Asking a tracer for its sharding raises an error whose message walks the whole
            # program traced so far: a jit of many calls would trace in quadratic time.
            return lambda array: (array.shape, array.dtype, None)
        return lambda array: (array.shape, array.dtype, getattr(array, "sharding", None))
    return lambda array: (getattr(array, "shape", None), getattr(array, "dtype", None), device_name(array))


_SIGNATURE_READERS: dict[type, object] = {}


def call_signature(kind: str, takes: str | None, arrays, num_kv_heads, head_dim, rotary_dim, rope_style) -> tuple:
    """What checking a call reads of it, as a key: ``kind`` (``'call'`` or ``'cache'``),
    which arrays the entry point takes (``takes``, as for :func:`check_arrays`), the
    static arguments with their types (``2.0 == 2``, yet one is refused), and every
    argument's type, then an array's shape, dtype and device (None where an optional
    one is left out). Reads no attribute of an argument that is not an array.

    Hashing it raises ``TypeError`` for an unhashable argument, which validation refuses.
    """
    signature = [kind, takes, type(num_kv_heads), num_kv_heads, type(head_dim), head_dim, type(rotary_dim),
                 rotary_dim, type(rope_style), rope_style]
    for array in arrays:
        if array is None:
            signature.append(None)
            continue
        array_type = type(array)
        reader = _SIGNATURE_READERS.get(array_type)
        if reader is None:
            reader = _SIGNATURE_READERS[array_type] = _signature_reader(array_type)
        signature.append(array_type)
        signature.append(reader(array))
    return tuple(signature)


def _remembered(signature: tuple | None) -> AcceptedCall | None:
    try:
        return _ACCEPTED_CALLS.get(signature)
    except TypeError:  # an unhashable argument, which validation refuses
        return None


def _remember(signature: tuple | None, call: CallShape) -> AcceptedCall:
    accepted = AcceptedCall(call)
    if signature is not None:
        if len(_ACCEPTED_CALLS) >= _MAX_ACCEPTED_CALLS:
            _ACCEPTED_CALLS.clear()
        try:
            _ACCEPTED_CALLS[signature] = accepted
        except TypeError:  # unhashable, yet accepted: validated again on every call
            pass
    return accepted


def accept_call(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, *, num_kv_heads: int,
                head_dim: int, rotary_dim: int, rope_style: str = "neox", v_multiplier=None,
                takes: str | None = None, remember: bool = True, layer_rope_table=None) -> AcceptedCall:
    """:func:`check_arrays` (``takes``: which arrays the entry point takes; None where the
    caller checks them itself) and :func:`validate_call` without ``check_buffers``, once
    per :func:`call_signature`: a call whose signature passed before is not checked again;
    one that fails raises every time. Run :func:`check_output_buffers` after it, on every
    call. ``remember=False`` checks without remembering (traced calls: torch.compile)."""
    return _accept("call", _CALL_ARRAYS,
                   (kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, v_multiplier, layer_rope_table),
                   (num_kv_heads, head_dim, rotary_dim, rope_style), takes, remember, _validate_call)


def accept_cache_call(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale,
                      v_scale, *, num_kv_heads: int, head_dim: int, rotary_dim: int, rope_style: str = "neox",
                      v_multiplier=None, takes: str | None = None, remember: bool = True,
                      layer_rope_table=None) -> AcceptedCall:
    """:func:`accept_call` for :func:`validate_cache_call`."""
    return _accept("cache", _CACHE_CALL_ARRAYS,
                   (kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale, v_scale,
                    v_multiplier, layer_rope_table),
                   (num_kv_heads, head_dim, rotary_dim, rope_style), takes, remember, _validate_cache_call)


def _accept(kind: str, names, arrays: tuple, static: tuple, takes, remember: bool, validate) -> AcceptedCall:
    """The remembered call of this signature, or ``validate(*arrays, *static)`` (after
    ``check_arrays``) remembered. Nothing is built before the lookup: it is the whole of
    an eager call's validation."""
    signature = None
    if remember:  # traced calls never look the memo up: dynamo cannot trace its dict
        signature = call_signature(kind, takes, arrays, *static)
        accepted = _remembered(signature)
        if accepted is not None:
            return accepted
    if takes is not None:
        check_arrays(zip(names, arrays), takes)
    return _remember(signature, validate(*arrays, *static))


def _validate_call(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out, v_multiplier, layer_rope_table,
                   num_kv_heads, head_dim, rotary_dim, rope_style) -> CallShape:
    return validate_call(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out=k_out, v_out=v_out,
                         v_multiplier=v_multiplier, layer_rope_table=layer_rope_table,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
                         check_buffers=False)


def _validate_cache_call(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache, k_scale,
                         v_scale, v_multiplier, layer_rope_table, num_kv_heads, head_dim, rotary_dim,
                         rope_style) -> CallShape:
    return validate_cache_call(kv, k_norm_weight, eps, cos_sin_cache, positions, cache_loc, k_cache, v_cache,
                               k_scale=k_scale, v_scale=v_scale, v_multiplier=v_multiplier,
                               layer_rope_table=layer_rope_table,
                               num_kv_heads=num_kv_heads, head_dim=head_dim,
                               rotary_dim=rotary_dim, rope_style=rope_style, check_buffers=False)
