"""The materializer's contract: per-layer weights checked to fit one GEMM and one launch.

Each draft layer brings its own K/V projection, k_norm weight, eps, attention shape and
rotary configuration. The fused path runs every layer through one stacked GEMM and one
launch of the op, so all of that must agree across layers: :func:`validate_layers`
checks it once, at construction, naming the first layer that differs, and returns the
static :class:`MaterializerConfig` that both frameworks' materializers build from.
:func:`head_parallel_layers` cuts the layers into one rank's share of the KV heads, for
tensor-parallel ranks (torch.distributed) and head-parallel devices (jax.shard_map).

Also here, for tests and benchmarks: random layers, the materializer's NumPy reference
(the GEMM in fp32, then the op's one reference) and the tolerance of that end-to-end
comparison. Importing this module imports neither torch nor jax.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import numpy as np

from interop.core.arrays import as_numpy, numpy_dtype
from interop.core.reference import (
    fused_kv_norm_rope_reference,
    rope_cos_sin_cache,
)
from interop.core.rope import RopeParameters, rope_cos_sin_table
from interop.core.spec import (
    _FLOAT_DTYPES,
    KV_DTYPES,
    FusedKVConfig,
    _type_name,
    check_arrays,
    device_name,
    dtype_name,
    integer_argument,
    size_argument,
    validate_call,
)

FP8_WEIGHT_DTYPE = "float8_e4m3fn"
# The GEMM's output for FP8 weights: the one output dtype of torch._scaled_mm's rowwise scaling.
FP8_KV_DTYPE = "bfloat16"
WEIGHT_DTYPES = KV_DTYPES + (FP8_WEIGHT_DTYPE,)
# The largest finite float8_e4m3fn: a token's largest |value| quantizes to it.
FP8_E4M3_MAX = 448.0
# Floor of a token's largest |activation|, so that an all-zero token quantizes to zeros, not NaN,
# and 448 over it stays finite in fp32.
MIN_ACTIVATION_AMAX = 2.0 ** -100


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """A layer's rotary embedding: the table rows ``p < max_position`` of base ``base``, or,
    with ``parameters``, of a scaled RoPE type (:class:`interop.core.rope.RopeParameters`).

    ``rotary_dim`` must be an int (its range against ``head_dim`` is the op's check) and
    ``max_position`` a positive int; ``parameters``, where given, must agree with
    ``rotary_dim`` and ``base``. Anything else is refused here, at construction.
    """

    rotary_dim: int
    max_position: int
    base: float = 10000.0
    style: str = "neox"
    parameters: RopeParameters | None = None

    def __post_init__(self):
        object.__setattr__(self, "rotary_dim", integer_argument("rotary_dim", self.rotary_dim,
                                                                "an even int in [2, head_dim]"))
        object.__setattr__(self, "max_position", size_argument("max_position", self.max_position))
        parameters = self.parameters
        if parameters is not None and (not isinstance(parameters, RopeParameters)
                                       or (parameters.rotary_dim, parameters.theta) != (self.rotary_dim, self.base)):
            raise ValueError(
                f"Invalid rope parameters for fused KV materialization: got {parameters!r}, expected "
                f"RopeParameters of rotary_dim={self.rotary_dim} and theta={self.base} (or None)."
            )

    def __repr__(self) -> str:  # a plain table's repr without its unused parameters: messages quote it
        parameters = "" if self.parameters is None else f", parameters={self.parameters!r}"
        return (f"RopeConfig(rotary_dim={self.rotary_dim}, max_position={self.max_position}, base={self.base}, "
                f"style={self.style!r}{parameters})")

    @classmethod
    def from_hf_config(cls, config, *, max_position: int, style: str = "neox",
                       layer_type: str | None = None) -> RopeConfig:
        """A layer's rope from a model's ``config.json`` dict (:meth:`RopeParameters.from_hf_config`)."""
        parameters = RopeParameters.from_hf_config(config, layer_type=layer_type)
        return cls(parameters.rotary_dim, max_position, parameters.theta, style, parameters)

    def cos_sin_cache(self) -> np.ndarray:
        """fp32[max_position, rotary_dim]: the reference's table, or the scaled type's."""
        if self.parameters is not None:
            return rope_cos_sin_table(self.parameters, self.max_position)
        return rope_cos_sin_cache(self.max_position, self.rotary_dim, self.base)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerKV:
    """One draft layer's share of the fused path; arrays of the materializer's framework.

    kv_proj_weight: float[2*kv_size, hidden], the K rows then the V rows (a Linear's weight).
    k_norm_weight: float[head_dim], or None for a draft without a K-norm (then ``eps`` is None).
    num_kv_heads, head_dim: positive ints, refused here, at construction, otherwise.
    v_multiplier: a float scaling the layer's V (a config's ``attention_value_scale``), or
      None to copy V bit for bit.
    kv_proj_bias: float[2*kv_size] of the weight's dtype, the K biases then the V biases
      (Qwen2-family projections), added by the GEMM; or None for a projection without one.
      With FP8 weights it is of the GEMM's output dtype, bfloat16.
    weight_scale: for, and only for, a float8_e4m3fn ``kv_proj_weight``: float scales
      dequantizing it (``W = kv_proj_weight * weight_scale``), one per tensor (shape ``()``
      or ``(1,)``) or one per output row (``(2*kv_size,)`` or ``(2*kv_size, 1)``), as FP8
      checkpoints store them.
    """

    kv_proj_weight: Any
    k_norm_weight: Any
    eps: float | None
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    v_multiplier: float | None = None
    kv_proj_bias: Any = None
    weight_scale: Any = None

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim"):
            object.__setattr__(self, name, size_argument(name, getattr(self, name)))


@dataclasses.dataclass(frozen=True)
class MaterializerConfig:
    """What a materializer is, statically; hashable so jit can key compilations on it."""

    op: FusedKVConfig
    n_layers: int
    hidden: int
    weight_dtype: str
    max_position: int
    normed: bool = True
    v_multiplied: bool = False
    biased: bool = False

    @property
    def fp8_weights(self) -> bool:
        """Whether the stacked weights are float8_e4m3fn, with a scale per output row."""
        return self.weight_dtype == FP8_WEIGHT_DTYPE

    @property
    def kv_dtype(self) -> str:
        """The dtype of the GEMM's output, the op's ``kv`` and the results: the weights',
        bfloat16 for FP8 weights."""
        return FP8_KV_DTYPE if self.fp8_weights else self.weight_dtype

    @property
    def fp8_gemm_shapes(self) -> bool:
        """Whether an FP8 tensor-core GEMM takes these sizes: hidden and the stacked rows
        multiples of 16 (``torch._scaled_mm``'s requirement, used by both frameworks alike)."""
        return self.fp8_weights and self.hidden % 16 == 0 and self.kv_width % 16 == 0

    @property
    def kv_width(self) -> int:
        """Columns of the stacked GEMM's output: every layer's K then V, layer after layer."""
        return self.n_layers * 2 * self.op.kv_size

    def kv_shape(self, total_ctx: int) -> tuple[int, int, int]:
        return (total_ctx, self.n_layers, 2 * self.op.kv_size)

    def op_kwargs(self) -> dict:
        """The op's static keyword arguments."""
        op = self.op
        return dict(num_kv_heads=op.num_kv_heads, head_dim=op.head_dim,
                    rotary_dim=op.rotary_dim, rope_style=op.rope_style)


@dataclasses.dataclass(frozen=True)
class _ShapeOf:
    """Shape and dtype of an array not made yet, for the op's own validation."""

    shape: tuple[int, ...]
    dtype: str


def _layer_error(index: int, what: str, got, expected) -> ValueError:
    return ValueError(
        f"Invalid fused KV materializer layer {index}: {what} got {got}, expected {expected}."
    )


def _check_layer_arrays(layers: tuple, cos_sin_cache, layer_rope_table, accepted: str) -> None:
    """Refuse a layer that is not a :class:`LayerKV`, and weights (or a table) that are not
    arrays of the materializer's framework (``accepted``, as :func:`interop.core.spec.check_arrays`)
    or that have no data (torch's meta device), naming the layer and the field."""
    for index, layer in enumerate(layers):
        if not isinstance(layer, LayerKV):
            raise TypeError(
                f"Invalid layers[{index}] for fused KV materialization: got {_type_name(layer)}, "
                "expected an interop.core.materializer.LayerKV."
            )
        for field in ("kv_proj_weight", "kv_proj_bias", "k_norm_weight", "weight_scale"):
            name, array = f"layers[{index}].{field}", getattr(layer, field)
            check_arrays(((name, array),), accepted)
            if (device_name(array) or "").startswith("meta"):
                raise ValueError(
                    f"Invalid {name} for fused KV materialization: got a tensor on the meta device "
                    "(a shape without data), expected one holding the layer's weights."
                )
    check_arrays((("cos_sin_cache", cos_sin_cache), ("layer_rope_table", layer_rope_table)), accepted)


def _same_table_shape(rope: RopeConfig) -> tuple:
    """What layers of different RoPE must share to be served by tables of one stacked array."""
    return rope.rotary_dim, rope.max_position, rope.style


def layer_ropes(layers) -> tuple[tuple[RopeConfig, ...], np.ndarray | None]:
    """The layers' distinct RoPEs in order of first use, and int32 ``[n_layers]``: each
    layer's among them, None where every layer has one RoPE (one table, no index)."""
    ropes = tuple(dict.fromkeys(layer.rope for layer in layers))
    if len(ropes) == 1:
        return ropes, None
    return ropes, np.array([ropes.index(layer.rope) for layer in layers], np.int32)


def validate_layers(layers: Sequence[LayerKV], cos_sin_cache=None, *, layer_rope_table=None,
                    accepted: str = "any") -> MaterializerConfig:
    """Check that every layer fits one stacked GEMM and one launch of the op.

    First each layer must be a :class:`LayerKV` whose arrays (and ``cos_sin_cache``) are
    of the materializer's framework (``accepted``: ``'torch'``, ``'jax'`` or ``'any'``, as
    :func:`interop.core.spec.check_arrays`) and hold data. Then layer 0 sets the configuration;
    each layer in turn is checked for its heads, head_dim, rope configuration (its rotary_dim,
    max_position and style: layers of another RoPE base or scaling get a table of their
    own, :func:`layer_ropes`), projection
    weight shape and dtype, k_norm weight shape and eps, V multiplier and projection bias
    (its shape and dtype), and the first difference raises ``ValueError`` naming the layer.
    Then the op's own validation (:func:`interop.core.spec.validate_call`) runs on the
    stacked shapes: the rotary/head dim pair, the rope style, the kv dtype (the
    weights' dtype, that of the GEMM's output) and the cos/sin table, which is either
    ``cos_sin_cache`` (fp32/bf16/fp16[rope.max_position, rotary_dim], or ``[n_tables, ...]``
    with ``layer_rope_table``) or built from the layers' ropes (one table per distinct rope).
    """
    layers = tuple(layers)
    if not layers:
        raise ValueError("Invalid layers for fused KV materialization: got 0, expected at least 1.")
    _check_layer_arrays(layers, cos_sin_cache, layer_rope_table, accepted)
    first = layers[0]
    first_shape = tuple(int(d) for d in first.kv_proj_weight.shape)
    hidden = first_shape[1] if len(first_shape) == 2 else "hidden"
    weight_rows = 2 * first.num_kv_heads * first.head_dim
    weight_shape = f"({weight_rows}, {hidden}) = (2*num_kv_heads*head_dim, hidden)"
    weight_dtype = _weight_dtype(first)
    for index, layer in enumerate(layers):
        as_in_first = " as in layer 0" if index else ""
        for what, got, expected, shown in (
            ("num_kv_heads", layer.num_kv_heads, first.num_kv_heads, first.num_kv_heads),
            ("head_dim", layer.head_dim, first.head_dim, first.head_dim),
            # Another base or scaling is another table; another shape of table is refused.
            ("rope configuration", layer.rope if _same_table_shape(layer.rope) != _same_table_shape(first.rope)
             else first.rope, first.rope, first.rope),
            ("kv_proj_weight shape", tuple(int(d) for d in layer.kv_proj_weight.shape),
             (weight_rows, hidden), weight_shape),
            ("kv_proj_weight dtype", dtype_name(layer.kv_proj_weight.dtype), weight_dtype,
             weight_dtype),
            ("K-norm", _has("a k_norm_weight", layer.k_norm_weight), _has("a k_norm_weight", first.k_norm_weight),
             _has("a k_norm_weight", first.k_norm_weight)),
            ("v_multiplier", _has("a v_multiplier", layer.v_multiplier), _has("a v_multiplier", first.v_multiplier),
             _has("a v_multiplier", first.v_multiplier)),
            ("kv_proj_bias", _has("a kv_proj_bias", layer.kv_proj_bias), _has("a kv_proj_bias", first.kv_proj_bias),
             _has("a kv_proj_bias", first.kv_proj_bias)),
        ):
            if got != expected:
                raise _layer_error(index, what, got, f"{shown}{as_in_first}")
        _check_layer_values(index, layer, as_in_first)
        _check_layer_scale(index, layer, weight_rows, weight_dtype)
        _check_layer_bias(index, layer, weight_rows, weight_dtype)

    rope = first.rope
    n_layers = len(layers)
    op = FusedKVConfig(first.num_kv_heads, first.head_dim, rope.rotary_dim, rope.style)
    table, layer_rope_table = _tables(layers, cos_sin_cache, layer_rope_table)
    normed, v_multiplied = first.k_norm_weight is not None, first.v_multiplier is not None
    per_layer = _ShapeOf((n_layers,), "float32")
    kv_dtype = FP8_KV_DTYPE if weight_dtype == FP8_WEIGHT_DTYPE else weight_dtype
    validate_call(
        _ShapeOf((0, n_layers, 2 * op.kv_size), kv_dtype),
        _ShapeOf((n_layers, op.head_dim), "float32") if normed else None,
        per_layer if normed else None,
        table,
        _ShapeOf((0,), "int32"),
        num_kv_heads=op.num_kv_heads, head_dim=op.head_dim, rotary_dim=op.rotary_dim,
        rope_style=op.rope_style, v_multiplier=per_layer if v_multiplied else None,
        layer_rope_table=layer_rope_table,
    )
    if int(table.shape[-2]) != rope.max_position:
        raise ValueError(
            "Invalid cos_sin_cache for fused KV materialization: "
            f"got {int(table.shape[-2])} rows, expected rope.max_position={rope.max_position}."
        )
    return MaterializerConfig(op, n_layers, int(first_shape[1]), weight_dtype, rope.max_position, normed,
                              v_multiplied, first.kv_proj_bias is not None)


def _weight_dtype(first: LayerKV) -> str:
    """Layer 0's weight dtype (each other layer must match it), refused here if it is a quantized
    format the GEMM does not take; another float dtype is the op's kv dtype check's."""
    name = dtype_name(first.kv_proj_weight.dtype)
    if name not in WEIGHT_DTYPES and name not in _FLOAT_DTYPES:
        raise ValueError(
            f"Invalid layers[0].kv_proj_weight dtype for fused KV materialization: got {name}, expected one of "
            f"{WEIGHT_DTYPES} ({name} weights are not supported: quantized weights must be {FP8_WEIGHT_DTYPE} "
            "with a weight_scale)."
        )
    return name


def _tables(layers, cos_sin_cache, layer_rope_table):
    """``(cos_sin_cache, layer_rope_table)`` as given, or the shapes of those built from the
    layers' ropes (:func:`stacked_rope_tables`), for the op's validation."""
    if cos_sin_cache is not None:
        return cos_sin_cache, layer_rope_table
    if layer_rope_table is not None:
        raise ValueError(
            "Invalid layer_rope_table for fused KV materialization: got an array without a cos_sin_cache, "
            "expected None (the tables are built from the layers' ropes, one per distinct rope)."
        )
    rope = layers[0].rope
    ropes, built_index = layer_ropes(layers)
    rows = (rope.max_position, rope.rotary_dim)
    if built_index is None:
        return _ShapeOf(rows, "float32"), layer_rope_table
    return _ShapeOf((len(ropes), *rows), "float32"), _ShapeOf(built_index.shape, "int32")


def _has(what: str, value) -> str:
    return "none" if value is None else what


def _finite_float(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_layer_values(index: int, layer: LayerKV, as_in_first: str) -> None:
    """A layer's K-norm weight shape and eps (None exactly when it has no K-norm), and its
    V multiplier (a finite float where given)."""
    if layer.k_norm_weight is None:
        if layer.eps is not None:
            raise _layer_error(index, "eps", repr(layer.eps), "None for a layer without a k_norm_weight")
    else:
        shape = tuple(int(d) for d in layer.k_norm_weight.shape)
        if shape != (layer.head_dim,):
            raise _layer_error(index, "k_norm_weight shape", shape, f"{(layer.head_dim,)}{as_in_first}")
        if not (_finite_float(layer.eps) and layer.eps >= 0):
            raise _layer_error(index, "eps", repr(layer.eps), "a finite float >= 0")
    if layer.v_multiplier is not None and not _finite_float(layer.v_multiplier):
        raise _layer_error(index, "v_multiplier", repr(layer.v_multiplier), "a finite float, or None")


def _check_layer_scale(index: int, layer: LayerKV, weight_rows: int, weight_dtype: str) -> None:
    """A layer's ``weight_scale``: given exactly for FP8 weights, a float per tensor or per row."""
    scale = layer.weight_scale
    if weight_dtype != FP8_WEIGHT_DTYPE:
        if scale is not None:
            raise _layer_error(index, "weight_scale", "an array", f"none for {weight_dtype} weights")
        return
    if scale is None:
        raise _layer_error(index, "weight_scale", "none", f"a weight_scale for {FP8_WEIGHT_DTYPE} weights")
    shape = tuple(int(d) for d in scale.shape)
    if shape not in ((), (1,), (weight_rows,), (weight_rows, 1)):
        raise _layer_error(index, "weight_scale shape", shape,
                           f"() or (1,) (per tensor), or {(weight_rows,)} or {(weight_rows, 1)} (per output row)")
    if dtype_name(scale.dtype) not in _FLOAT_DTYPES:
        raise _layer_error(index, "weight_scale dtype", dtype_name(scale.dtype), f"one of {_FLOAT_DTYPES}")


def _check_layer_bias(index: int, layer: LayerKV, weight_rows: int, weight_dtype: str) -> None:
    """A layer's projection bias: one value per row of the weight, in the GEMM's output dtype
    (the weight's, bfloat16 for FP8 weights: the GEMM adds it in its epilogue, which takes one dtype)."""
    bias = layer.kv_proj_bias
    if bias is None:
        return
    shape = tuple(int(d) for d in bias.shape)
    if shape != (weight_rows,):
        raise _layer_error(index, "kv_proj_bias shape", shape, f"{(weight_rows,)} = (2*num_kv_heads*head_dim,)")
    if weight_dtype == FP8_WEIGHT_DTYPE and dtype_name(bias.dtype) != FP8_KV_DTYPE:
        raise _layer_error(index, "kv_proj_bias dtype", dtype_name(bias.dtype),
                           f"{FP8_KV_DTYPE}, the GEMM's output dtype for {FP8_WEIGHT_DTYPE} weights")
    if weight_dtype != FP8_WEIGHT_DTYPE and dtype_name(bias.dtype) != weight_dtype:
        raise _layer_error(index, "kv_proj_bias dtype", dtype_name(bias.dtype),
                           f"{weight_dtype}, the kv_proj_weight dtype")


def validate_materialize(ctx_hidden, config: MaterializerConfig, max_position: int | None, *,
                         accepted: str = "any", arrays=()) -> int:
    """Check one materialize call's hidden states and position bound; return total_ctx.

    ``ctx_hidden`` and the ``(name, array)`` pairs of ``arrays`` must be arrays of the
    materializer's framework (``accepted``, as :func:`interop.core.spec.check_arrays`).
    ``max_position``, when given, is the caller's bound on its positions, checked
    against the table on the host instead of reading the positions back (a sync).
    """
    check_arrays((("ctx_hidden", ctx_hidden), *arrays), accepted)
    shape = tuple(int(d) for d in ctx_hidden.shape)
    if max_position is not None:
        max_position = integer_argument("max_position", max_position, f"an int in [0, {config.max_position}]")
    if len(shape) != 2 or shape[1] != config.hidden:
        raise ValueError(
            "Invalid ctx_hidden shape for fused KV materialization: "
            f"got {shape}, expected (total_ctx, {config.hidden})."
        )
    # Cast to the weights' dtype by the GEMM: an integer, bool or complex (or, with jax's
    # x64 off, a float64 narrowed first) would change values silently.
    if dtype_name(ctx_hidden.dtype) not in KV_DTYPES:
        raise ValueError(
            "Invalid ctx_hidden dtype for fused KV materialization: "
            f"got {dtype_name(ctx_hidden.dtype)}, expected one of {KV_DTYPES}."
        )
    if max_position is not None and not 0 <= max_position <= config.max_position:
        raise ValueError(
            "Invalid max_position for fused KV materialization: "
            f"got {max_position}, expected at most {config.max_position}, the rows of cos_sin_cache."
        )
    return shape[0]


def validate_reserve(max_tokens) -> int:
    """A workspace's bound on a call's tokens as an int >= 0 (0: the empty-context calls,
    which need no workspace), refused otherwise as sizes are."""
    max_tokens = integer_argument("max_tokens", max_tokens, "a non-negative int")
    if max_tokens < 0:
        raise ValueError(
            f"Invalid max_tokens for fused KV materialization: got {max_tokens}, expected a non-negative int."
        )
    return max_tokens


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def head_parallel_layers(layers: Sequence[LayerKV], rank: int, world_size: int) -> tuple[LayerKV, ...]:
    """Rank ``rank``'s share of every layer when ``world_size`` ranks split the KV heads.

    With ``H = num_kv_heads`` and ``H/R`` heads per rank (``R = world_size``), rank ``r``
    holds heads ``[r*H/R, (r+1)*H/R)``: of each ``kv_proj_weight``
    ``[2*H*head_dim, hidden]`` the K rows of those heads, then their V rows, as
    ``[2*(H/R)*head_dim, hidden]`` (the column-parallel slice of the projection, laid out
    as a one-rank layer expects), and the same rows of a ``kv_proj_bias``, with
    ``num_kv_heads = H/R``; ``k_norm_weight``, ``eps``
    and ``rope`` are the layer's own (every head shares them). A materializer built from
    the share yields ``[n_layers, total_ctx, H/R, head_dim]``: heads ``[r*H/R, (r+1)*H/R)``
    of the one-rank result.

    Arrays of any framework that indexes by a NumPy integer array (NumPy, torch, jax)
    keep their framework and device; the rows are copied. The layers are validated as by
    :func:`validate_layers` first.
    """
    layers = tuple(layers)
    config = validate_layers(layers)
    heads = config.op.num_kv_heads
    if not _is_int(world_size) or world_size <= 0 or heads % world_size:
        raise ValueError(
            "Invalid world_size for head-parallel fused KV materialization: "
            f"got {world_size!r}, expected a positive int dividing num_kv_heads={heads}."
        )
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(
            "Invalid rank for head-parallel fused KV materialization: "
            f"got {rank!r}, expected an int in [0, {world_size})."
        )
    share = heads // world_size * config.op.head_dim
    first = rank * share
    rows = np.concatenate([np.arange(first, first + share),
                           config.op.kv_size + np.arange(first, first + share)])
    return tuple(dataclasses.replace(layer, kv_proj_weight=layer.kv_proj_weight[rows],
                                     kv_proj_bias=None if layer.kv_proj_bias is None else layer.kv_proj_bias[rows],
                                     weight_scale=_rows_of_scale(layer.weight_scale, rows),
                                     num_kv_heads=heads // world_size)
                 for layer in layers)


def _rows_of_scale(scale, rows: np.ndarray):
    """The rows ``rows`` of a per-row ``weight_scale``; a per-tensor one (or None) as it is."""
    if scale is None or int(np.prod(scale.shape)) == 1:
        return scale
    return scale[rows]


def stacked_op_arrays(layers, cos_sin_cache=None):
    """The op's per-layer arguments in NumPy: fp32 ``k_norm_weight[n_layers, head_dim]``,
    fp32 ``eps[n_layers]`` (both None without a K-norm) and the cos/sin table
    (``cos_sin_cache`` or the one built: :func:`stacked_rope_tables`)."""
    table = stacked_rope_tables(layers)[0] if cos_sin_cache is None else as_numpy(cos_sin_cache)
    if layers[0].k_norm_weight is None:
        return None, None, table
    return (np.stack([as_numpy(layer.k_norm_weight).astype(np.float32) for layer in layers]),
            np.array([layer.eps for layer in layers], np.float32), table)


def stacked_rope_tables(layers) -> tuple[np.ndarray, np.ndarray | None]:
    """fp32 ``cos_sin_cache`` and ``layer_rope_table`` of the layers' ropes (:func:`layer_ropes`):
    the one table ``[max_position, rotary_dim]`` and None, or ``[n_tables, max_position,
    rotary_dim]`` and each layer's table."""
    ropes, layer_rope_table = layer_ropes(layers)
    if layer_rope_table is None:
        return ropes[0].cos_sin_cache(), None
    return np.stack([rope.cos_sin_cache() for rope in ropes]), layer_rope_table


def stacked_v_multiplier(layers) -> np.ndarray | None:
    """fp32 ``v_multiplier[n_layers]`` of the layers, None where they copy V."""
    if layers[0].v_multiplier is None:
        return None
    return np.array([layer.v_multiplier for layer in layers], np.float32)


def weight_scale_rows(layer: LayerKV) -> np.ndarray:
    """fp32[2*kv_size]: the layer's ``weight_scale`` (an FP8 layer's) as one scale per output row."""
    scale = as_numpy(layer.weight_scale).astype(np.float32).reshape(-1)
    return np.broadcast_to(scale, (int(layer.kv_proj_weight.shape[0]),))


def dequantized_weight(layer: LayerKV) -> np.ndarray:
    """fp32[2*kv_size, hidden]: the layer's projection weight, FP8 codes times their scales."""
    weight = as_numpy(layer.kv_proj_weight).astype(np.float32)
    return weight if layer.weight_scale is None else weight * weight_scale_rows(layer)[:, None]


def quantize_per_token(hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scale)``: float8_e4m3fn[T, hidden] and fp32[T, 1], ``hidden ~ codes * scale``.

    The FP8 tensor-core GEMM's dynamic activation quantization, in fp32: each token's
    ``inverse = 448 / amax`` (``amax`` its largest ``|value|``, at least ``2**-100``), its codes
    ``hidden * inverse`` rounded once to the nearest code, its ``scale = 1 / inverse``. A
    multiplication, not a division by the scale: XLA turns a division by a broadcast value
    into a multiplication by its reciprocal, which moves exact ties between two codes.
    """
    hidden = np.asarray(hidden, np.float32)
    amax = np.maximum(np.abs(hidden).max(axis=1, keepdims=True), np.float32(MIN_ACTIVATION_AMAX))
    inverse = (np.float32(FP8_E4M3_MAX) / amax).astype(np.float32)
    return (hidden * inverse).astype(numpy_dtype(FP8_WEIGHT_DTYPE)), (np.float32(1) / inverse).astype(np.float32)


def projection_reference(layers, ctx_hidden, *, fp8_activations: bool = False) -> np.ndarray:
    """The stacked K/V projection in NumPy: ``kv[t, l] = ctx_hidden[t] @ W_l^T (+ kv_proj_bias[l])``
    in fp32, fp32[total_ctx, n_layers, 2*kv_size], after rounding ``ctx_hidden`` to the GEMM's
    dtype (the weights', bfloat16 for FP8 weights) as the materializers do.

    ``W_l`` is the layer's weight, dequantized for FP8 weights (dequantize-then-GEMM). With
    ``fp8_activations`` (FP8 weights only), ``ctx_hidden`` is quantized per token as the
    FP8 tensor-core GEMM does (:func:`quantize_per_token`) and the products summed in fp64:
    that GEMM's result but for its accumulation order.
    """
    weight_dtype = dtype_name(as_numpy(layers[0].kv_proj_weight).dtype)
    fp8 = weight_dtype == FP8_WEIGHT_DTYPE
    hidden = as_numpy(ctx_hidden).astype(numpy_dtype(FP8_KV_DTYPE if fp8 else weight_dtype)).astype(np.float32)
    if fp8_activations and not fp8:
        raise ValueError(f"Invalid fp8_activations for fused KV materialization: got True for {weight_dtype} "
                         f"weights, expected False (it applies to {FP8_WEIGHT_DTYPE} weights).")

    def project(layer):
        if fp8_activations:
            codes, scale = quantize_per_token(hidden)
            products = codes.astype(np.float64) @ as_numpy(layer.kv_proj_weight).astype(np.float64).T
            kv = (products * scale * weight_scale_rows(layer)).astype(np.float32)
        else:
            kv = hidden @ dequantized_weight(layer).T
        return kv if layer.kv_proj_bias is None else kv + as_numpy(layer.kv_proj_bias).astype(np.float32)

    return np.stack([project(layer) for layer in layers], axis=1)


def materializer_reference(layers, ctx_hidden, positions, cos_sin_cache=None, layer_rope_table=None, *,
                           fp8_activations: bool = False):
    """The materializer in NumPy: kv = ctx_hidden @ W_l^T (+ b_l) in fp32 for every layer, then the op.

    ``ctx_hidden`` is first rounded to the GEMM's dtype, as the materializers do; kv
    is not (compare with :data:`interop.testing.END_TO_END_TOLERANCE`). FP8 weights are
    dequantized (``fp8_activations``: see :func:`projection_reference`). Returns ``(k, v)``,
    each kv-dtype[n_layers, total_ctx, num_kv_heads, head_dim] (the weights' dtype, bfloat16
    for FP8 weights).
    """
    config = validate_layers(layers, cos_sin_cache, layer_rope_table=layer_rope_table)
    dtype = numpy_dtype(config.kv_dtype)
    if cos_sin_cache is None:
        layer_rope_table = stacked_rope_tables(layers)[1]
    k, v = fused_kv_norm_rope_reference(
        projection_reference(layers, ctx_hidden, fp8_activations=fp8_activations),
        *stacked_op_arrays(layers, cos_sin_cache), as_numpy(positions),
        **config.op_kwargs(), v_multiplier=stacked_v_multiplier(layers),
        layer_rope_table=None if layer_rope_table is None else as_numpy(layer_rope_table))
    return k.astype(dtype), v.astype(dtype)
