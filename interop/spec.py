"""The op's contract: its static configuration and the one validation of a call.

Every entry point (the NumPy reference, the Triton and Pallas wrappers, the
DLPack dispatcher) calls :func:`validate_call` before it launches or writes
anything, so a rejected call leaves every caller buffer untouched and raises the
same ``ValueError`` whatever the framework. The arrays only need ``.shape`` and
``.dtype`` (NumPy, torch, jax, and jax tracers under ``jit`` all qualify).
"""

from __future__ import annotations

import dataclasses

ROPE_STYLES = ("neox", "gptj")
KV_DTYPES = ("bfloat16", "float16", "float32")
POSITION_DTYPES = ("int32", "int64")
_FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")

# DLPack device types (dlpack.h): the framework-neutral way to name a device.
_DLPACK_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cpu", 10: "rocm"}


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
    kind = _DLPACK_DEVICE_NAMES.get(int(device_type), f"dlpack{int(device_type)}")
    return "cpu" if kind == "cpu" else f"{kind}:{int(device_id)}"


def _shape(array) -> tuple[int, ...]:
    return tuple(int(d) for d in array.shape)


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
    k_out=None,
    v_out=None,
) -> CallShape:
    """Check one call against DESIGN.md section 1; raise ``ValueError`` on the first problem.

    Order (users grep for these messages): kv rank, kv trailing dim, rotary/head dim
    pair, k_norm_weight shape, eps shape, then the checks the seeds do not cover
    (rope style, dtypes, cos/sin cache, positions), then k_out and v_out. Every
    check runs even when ``total_ctx == 0`` so a misconfigured model fails on its
    first, often empty, warm-up call.
    """
    kv_shape = _shape(kv)
    if len(kv_shape) != 3:
        raise ValueError(
            "Invalid stacked fused KV projection shape: "
            f"got {kv_shape}, expected 3D [total_ctx, n_layers, kv_size*2]."
        )
    total_ctx, n_layers, kv_dim = kv_shape
    config = FusedKVConfig(int(num_kv_heads), int(head_dim), int(rotary_dim), rope_style)
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
    if _shape(k_norm_weight) != (n_layers, config.head_dim):
        raise ValueError(
            "Invalid stacked k_norm_weight shape for fused KV materialization: "
            f"got {_shape(k_norm_weight)}, expected {(n_layers, config.head_dim)}."
        )
    if _shape(eps) != (n_layers,):
        raise ValueError(
            "Invalid stacked eps shape for fused KV materialization: "
            f"got {_shape(eps)}, expected {(n_layers,)}."
        )
    _check_supported(kv, k_norm_weight, eps, cos_sin_cache, positions, config, total_ctx)
    expected_out_shape = config.output_shape(n_layers, total_ctx)
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        if out is not None:
            _check_output(name, out, kv, expected_out_shape)
    return CallShape(config, total_ctx, n_layers, int(cos_sin_cache.shape[0]))


def _check_supported(kv, k_norm_weight, eps, cos_sin_cache, positions, config, total_ctx):
    if config.rope_style not in ROPE_STYLES:
        raise ValueError(
            f"Invalid rope_style for fused KV materialization: got {config.rope_style!r}, "
            f"expected one of {ROPE_STYLES}."
        )
    for name, array, allowed in (
        ("kv", kv, KV_DTYPES),
        ("k_norm_weight", k_norm_weight, _FLOAT_DTYPES),
        ("eps", eps, ("float32",)),
        ("cos_sin_cache", cos_sin_cache, ("float32",)),
        ("positions", positions, POSITION_DTYPES),
    ):
        if dtype_name(array.dtype) not in allowed:
            raise ValueError(
                f"Invalid {name} dtype for fused KV materialization: "
                f"got {dtype_name(array.dtype)}, expected one of {allowed}."
            )
    cache_shape = _shape(cos_sin_cache)
    if len(cache_shape) != 2 or cache_shape[1] != config.rotary_dim or cache_shape[0] == 0:
        raise ValueError(
            "Invalid cos_sin_cache shape for fused KV materialization: "
            f"got {cache_shape}, expected (max_pos, {config.rotary_dim}) with max_pos > 0."
        )
    if _shape(positions) != (total_ctx,):
        raise ValueError(
            "Invalid positions shape for fused KV materialization: "
            f"got {_shape(positions)}, expected {(total_ctx,)}."
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
) -> CallShape:
    """:func:`validate_call`, then the paged-cache arguments of the op written into a cache.

    ``k_cache``/``v_cache`` are ``[n_layers, num_slots, num_kv_heads, head_dim]`` of the
    dtype of ``kv`` or float8_e4m3fn; an fp8 cache needs fp32 ``[n_layers]`` scales.
    """
    call = validate_call(
        kv, k_norm_weight, eps, cos_sin_cache, positions,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_style=rope_style,
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
