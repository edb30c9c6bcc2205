"""Draft layers from a checkpoint on disk: ``config.json`` and ``*.safetensors``, read lazily.

:func:`read_checkpoint_layers` turns a local checkpoint directory into one
:class:`~interop.core.materializer.LayerKV` per draft layer, holding NumPy arrays, which
both frameworks' ``FusedKVMaterializer.from_pretrained`` move to their devices. Two
layouts are read:

* a DFlash draft (its config has ``dflash_config``): tensors ``layers.{i}.self_attn.…``;
* a decoder of the Llama, Qwen2 or Qwen3 family: tensors ``model.layers.{i}.self_attn.…``.

Of each layer only ``k_proj.weight`` and ``v_proj.weight`` (stacked, K rows then V rows),
their biases where the checkpoint has them (Qwen2) and ``k_norm.weight`` where it has
one (Qwen3, DFlash; Llama and Qwen2 have none) are read, each from the file that holds
it (``model.safetensors.index.json`` names it for a sharded checkpoint). The rotary
table comes from the config (:meth:`RopeConfig.from_hf_config`), per layer type where
the config has ``layer_types`` (transformers 5's ``rope_parameters`` keyed by layer type,
a MiMo-style ``swa_rope_theta`` for the sliding-window layers): the materializers give
each distinct RoPE a table of its own and every layer its index, in one launch. A config's
``attention_value_scale`` becomes the layers' ``v_multiplier``. FP8 checkpoints (a
``quantization_config`` of ``quant_method`` ``'fp8'``, ``'fbgemm_fp8'`` or
``'compressed-tensors'`` with float8 weights, :func:`check_quantization`) give float8_e4m3fn
weights with their ``weight_scale`` (or ``weight_scale_inv``), per tensor or per output row.
What cannot be served as asked is refused before anything is read: other quantization
formats, block-wise scales and static activation scales (``input_scale``), a missing tensor
or one whose shape disagrees with the config.
Nothing is downloaded; importing this module imports neither torch nor jax (nor
safetensors, which is imported when a checkpoint is read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from interop.core.arrays import numpy_dtype
from interop.core.materializer import FP8_KV_DTYPE, FP8_WEIGHT_DTYPE, LayerKV, RopeConfig, validate_layers
from interop.core.spec import KV_DTYPES, _type_name, dtype_name, integer_argument, size_argument

DECODER_FAMILIES = ("llama", "qwen2", "qwen3")
# safetensors' names of the dtypes a projection may have (those of KV_DTYPES).
_TENSOR_DTYPES = ("BF16", "F16", "F32")
_FP8_TENSOR_DTYPE = "F8_E4M3"
# The quantization_config methods whose weights are float8_e4m3fn with a scale per tensor or row.
FP8_QUANT_METHODS = ("fp8", "fbgemm_fp8", "compressed-tensors")
# compressed-tensors formats that store float8 weights as they are (not packed).
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")
# The names FP8 checkpoints give a weight's dequantizing scale (HF's fine-grained FP8: _inv).
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def read_checkpoint_layers(path, *, layers: Sequence[int] | None = None, dtype=None,
                           max_position: int | None = None) -> tuple[LayerKV, ...]:
    """The draft layers of the checkpoint in directory ``path``, as NumPy ``LayerKV``.

    Args:
      path: a local directory holding ``config.json`` and ``*.safetensors``.
      layers: the indices of the layers to serve as draft layers, in that order; None: all
        ``num_hidden_layers`` of them.
      dtype: the arrays' dtype (``'bfloat16'``, ``'float16'``, ``'float32'`` or a framework's
        dtype of those names); None keeps the checkpoint's.
      max_position: rows of the rotary table; None: the config's ``max_position_embeddings``.

    Raises ``ValueError`` (``TypeError`` for an argument of the wrong kind) naming the
    argument, or the config key or tensor and the file it was read from.
    """
    dtype = _dtype_argument(dtype)
    if max_position is not None:
        max_position = size_argument("max_position", max_position)
    directory = _checkpoint_directory(path)
    config_file = directory / "config.json"
    with _located(config_file):
        config = _read_config(config_file)
        prefix = _layer_prefix(config)
        count = _config_size(config, "num_hidden_layers")
    indices = _layer_indices(count, layers)
    with _located(config_file):
        ropes = _draft_ropes(config, indices, max_position)
        value_scales = _value_scales(config, indices)
        shape = _AttentionShape.from_config(config, ropes[0].parameters.head_dim)
    with _Tensors(directory) as tensors:
        read = [_read_layer(tensors, f"{prefix}.{index}.self_attn", shape) for index in indices]
    draft = tuple(_layer(weight, weight_scale, bias, k_norm, shape, rope, scale, dtype)
                  for (weight, weight_scale, bias, k_norm), scale, rope in zip(read, value_scales, ropes))
    validate_layers(draft)
    return draft


def _layer(weight, weight_scale, bias, k_norm, shape: _AttentionShape, rope: RopeConfig, value_scale,
           dtype: str | None) -> LayerKV:
    """One draft layer; FP8 weights are kept with their scales (and a bias made the GEMM's
    bfloat16) unless ``dtype`` asks for another, to which they are dequantized."""
    if weight_scale is not None and dtype is not None:
        weight, weight_scale = weight.astype(np.float32) * weight_scale[:, None], None
    elif weight_scale is not None:
        dtype = FP8_KV_DTYPE
    return LayerKV(weight if weight_scale is not None else _cast(weight, dtype), _cast(k_norm, dtype),
                   None if k_norm is None else shape.eps, shape.num_kv_heads, shape.head_dim, rope, value_scale,
                   _cast(bias, dtype), weight_scale)


def _cast(array: np.ndarray | None, dtype: str | None) -> np.ndarray | None:
    return array if array is None or dtype is None else array.astype(numpy_dtype(dtype))


@dataclasses.dataclass(frozen=True)
class _AttentionShape:
    """What the config says a layer's K/V tensors are."""

    num_kv_heads: int
    head_dim: int
    hidden: int
    eps: float | None

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config: Mapping, head_dim: int) -> _AttentionShape:
        heads = config.get("num_key_value_heads")
        if heads is None:  # transformers' default: one KV head per attention head
            heads = _config_size(config, "num_attention_heads")
        eps = config.get("rms_norm_eps")
        if eps is not None and not (_finite_real(eps) and eps >= 0):
            raise ValueError(f"Invalid config['rms_norm_eps'] for fused KV materialization: got {eps!r}, "
                             "expected a finite real number >= 0.")
        return cls(size_argument("config['num_key_value_heads']", heads), head_dim,
                   _config_size(config, "hidden_size"), None if eps is None else float(eps))


def _dtype_argument(dtype) -> str | None:
    if dtype is None:
        return None
    if isinstance(dtype, type):  # a scalar type (np.float32, jnp.bfloat16) names its dtype
        with contextlib.suppress(TypeError):
            dtype = np.dtype(dtype)
    name = dtype_name(dtype)
    if name not in KV_DTYPES:
        raise ValueError(f"Invalid dtype for fused KV materialization: got {name}, expected one of {KV_DTYPES} "
                         "(or None: the checkpoint's).")
    return name


def _checkpoint_directory(path) -> pathlib.Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Invalid path for fused KV materialization: got {_type_name(path)}, expected a "
                        "str or os.PathLike naming a checkpoint directory.")
    directory = pathlib.Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"Invalid path for fused KV materialization: got {str(directory)!r}, which holds no "
                         "config.json, expected a local checkpoint directory with config.json and *.safetensors.")
    return directory


@contextlib.contextmanager
def _located(where: pathlib.Path):
    """A refusal of the core's checks, with the file its value was read from in its name."""
    try:
        yield
    except (ValueError, TypeError) as error:
        message = str(error).replace(" for fused KV materialization", f" in {where} for fused KV materialization", 1)
        raise type(error)(message) from error


def _read_config(config_file: pathlib.Path) -> Mapping:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Invalid config for fused KV materialization: got a file that does not read as "
                         f"JSON ({error}), expected a model's configuration.") from error
    if not isinstance(config, Mapping):
        raise ValueError(f"Invalid config for fused KV materialization: got {_type_name(config)}, "
                         "expected a JSON object.")
    quantization = config.get("quantization_config")
    if quantization is not None:
        check_quantization(quantization)
    return config


def check_quantization(quantization) -> None:
    """Refuse a ``quantization_config`` whose weights are not float8_e4m3fn with a scale per
    tensor or per output row and dynamic (per-token) activations, naming what it holds."""
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else quantization
    if method not in FP8_QUANT_METHODS:
        _refuse_quantization(f"quant_method {method!r}", f"unquantized weights, or FP8 weights of a quant_method "
                             f"in {FP8_QUANT_METHODS} (other quantization formats are not supported)")
    if method == "fp8":
        if quantization.get("weight_block_size") is not None:
            _refuse_quantization(f"weight_block_size {quantization['weight_block_size']!r} (block-wise FP8 scales)",
                                 "None: FP8 weights with a scale per tensor or per output row")
        _require_dynamic(f"activation_scheme {quantization.get('activation_scheme', 'dynamic')!r}",
                         quantization.get("activation_scheme", "dynamic") == "dynamic")
    if method == "compressed-tensors":
        _check_compressed_tensors(quantization)


def _check_compressed_tensors(quantization: Mapping) -> None:
    """compressed-tensors: float8 weights (``type`` float, 8 bits) of strategy tensor or channel,
    stored as they are, with dynamic activations or none, in every config group."""
    form = quantization.get("format")
    if form not in _FLOAT_FORMATS:
        _refuse_quantization(f"compressed-tensors format {form!r}",
                             f"one of {_FLOAT_FORMATS}, float8 weights stored as they are")
    groups = quantization.get("config_groups") or {}
    for name, group in groups.items():
        weights = group.get("weights") or {}
        scheme = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if scheme[:2] != ("float", 8) or scheme[2] not in ("tensor", "channel"):
            _refuse_quantization(f"config_groups[{name!r}] weights of type {scheme[0]!r}, {scheme[1]!r} bits, "
                                 f"strategy {scheme[2]!r}",
                                 "float weights of 8 bits, strategy 'tensor' or 'channel'")
        activations = group.get("input_activations")
        _require_dynamic(f"config_groups[{name!r}] input_activations with dynamic "
                         f"{None if activations is None else activations.get('dynamic')!r}",
                         activations is None or activations.get("dynamic") is True)


def _require_dynamic(what: str, dynamic: bool) -> None:
    if not dynamic:
        _refuse_quantization(f"{what} (static activation scales, input_scale)",
                             "dynamic activations: FP8 weights run with each token's activations quantized "
                             "when it is computed")


def _refuse_quantization(got: str, expected: str):
    raise ValueError(f"Invalid config['quantization_config'] for fused KV materialization: got {got}, "
                     f"expected {expected}.")


def _layer_prefix(config: Mapping) -> str:
    """Where a layer's tensors are: a DFlash draft's own layers, or a decoder's."""
    if "dflash_config" in config:
        return "layers"
    family = config.get("model_type")
    if family not in DECODER_FAMILIES:
        raise ValueError(f"Invalid config['model_type'] for fused KV materialization: got {family!r}, expected one "
                         f"of {DECODER_FAMILIES} or a DFlash draft's config (with dflash_config).")
    return "model.layers"


def _layer_indices(count: int, layers) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(count))
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"Invalid layers for fused KV materialization: got {_type_name(layers)}, expected a "
                        "sequence of layer indices, or None for all.")
    if not layers:
        raise ValueError("Invalid layers for fused KV materialization: got [], expected at least one layer index.")
    indices = tuple(integer_argument(f"layers[{i}]", index, f"an int in [0, {count})")
                    for i, index in enumerate(layers))
    for i, index in enumerate(indices):
        if not 0 <= index < count:
            raise ValueError(f"Invalid layers[{i}] for fused KV materialization: got {index}, expected an int in "
                             f"[0, {count}) (config['num_hidden_layers'] is {count}).")
    return indices


def _draft_ropes(config: Mapping, indices: tuple[int, ...], max_position: int | None) -> tuple[RopeConfig, ...]:
    """Each draft layer's RoPE, from the parameters of its layer type where the config gives them."""
    if max_position is None:
        max_position = _config_size(config, "max_position_embeddings")
    layer_types = config.get("layer_types")
    if layer_types is not None and len(layer_types) != config["num_hidden_layers"]:
        raise ValueError(f"Invalid config['layer_types'] for fused KV materialization: got {len(layer_types)} "
                         f"entries, expected one per layer ({config['num_hidden_layers']}).")
    ropes = []
    for index in indices:
        layer_type = None if layer_types is None else layer_types[index]
        rope = RopeConfig.from_hf_config(config, max_position=max_position, layer_type=layer_type)
        swa_theta = config.get("swa_rope_theta")
        if swa_theta is not None and layer_types is None:
            raise ValueError("Invalid config['swa_rope_theta'] for fused KV materialization: got a RoPE base for "
                             "sliding-window layers and no layer_types, expected layer_types naming those layers.")
        if swa_theta is not None and layer_type == "sliding_attention":
            parameters = dataclasses.replace(rope.parameters, theta=swa_theta)
            rope = RopeConfig(rope.rotary_dim, max_position, parameters.theta, rope.style, parameters)
        ropes.append(rope)
    return tuple(ropes)


def _value_scales(config: Mapping, indices: tuple[int, ...]) -> list[float | None]:
    """Each draft layer's ``v_multiplier``: the config's ``attention_value_scale`` (one for all
    layers or one per layer), or None."""
    scale = config.get("attention_value_scale")
    if scale is None:
        return [None] * len(indices)
    per_layer = isinstance(scale, Sequence) and not isinstance(scale, str)
    scales = list(scale) if per_layer else [scale] * config["num_hidden_layers"]
    if len(scales) != config["num_hidden_layers"] or not all(map(_finite_real, scales)):
        raise ValueError(f"Invalid config['attention_value_scale'] for fused KV materialization: got {scale!r}, "
                         "expected a finite real number, or one per layer.")
    return [float(scales[index]) for index in indices]


def _config_size(config: Mapping, key: str) -> int:
    if config.get(key) is None:
        raise ValueError(f"Invalid config['{key}'] for fused KV materialization: got no {key}, expected a "
                         "positive int.")
    return size_argument(f"config['{key}']", config[key])


def _finite_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _read_layer(tensors: _Tensors, prefix: str, shape: _AttentionShape):
    """``(kv_proj_weight, weight_scale or None, kv_proj_bias or None, k_norm_weight or None)`` of
    one layer; ``weight_scale`` (fp32, one per row) where the projections are FP8."""
    rows = f"({shape.kv_size}, {shape.hidden}) = (num_key_value_heads*head_dim, hidden_size)"
    k, v = (tensors.read(f"{prefix}.{name}_proj.weight", (shape.kv_size, shape.hidden), rows) for name in "kv")
    weight_scale = _read_weight_scales(tensors, prefix, shape.kv_size)
    bias = None
    if tensors.has(f"{prefix}.k_proj.bias") or tensors.has(f"{prefix}.v_proj.bias"):
        biases = (tensors.read(f"{prefix}.{name}_proj.bias", (shape.kv_size,),
                               f"({shape.kv_size},) = (num_key_value_heads*head_dim,)") for name in "kv")
        bias = np.concatenate(list(biases))
    k_norm = None
    if tensors.has(f"{prefix}.k_norm.weight"):
        k_norm = tensors.read(f"{prefix}.k_norm.weight", (shape.head_dim,), f"({shape.head_dim},) = (head_dim,)")
        if shape.eps is None:
            raise ValueError(f"Invalid config['rms_norm_eps'] in {tensors.directory / 'config.json'} for fused KV "
                             f"materialization: got no rms_norm_eps, expected the K-norm's epsilon (the checkpoint "
                             f"has {prefix}.k_norm.weight).")
    return np.concatenate([k, v]), weight_scale, bias, k_norm


def _read_weight_scales(tensors: _Tensors, prefix: str, rows: int) -> np.ndarray | None:
    """fp32[2*rows]: the scales of FP8 K and V projections, one per row (a per-tensor scale
    repeated); None for unquantized ones. Both are FP8 or neither: they are one GEMM's weight."""
    k_dtype, v_dtype = (tensors.stored_dtype(f"{prefix}.{name}_proj.weight") for name in "kv")
    if _FP8_TENSOR_DTYPE not in (k_dtype, v_dtype):
        return None
    if k_dtype != v_dtype:
        raise ValueError(f"Invalid tensor '{prefix}.v_proj.weight' in {tensors.where[f'{prefix}.v_proj.weight']} for "
                         f"fused KV materialization: got dtype {v_dtype}, expected {k_dtype} as "
                         f"'{prefix}.k_proj.weight' (K and V are one GEMM's weight).")
    scales = []
    for name in "kv":
        weight = f"{prefix}.{name}_proj.weight"
        static = f"{prefix}.{name}_proj.input_scale"
        if tensors.has(static):
            raise ValueError(f"Invalid tensor '{static}' in {tensors.where[static]} for fused KV materialization: "
                             "got a static activation scale, expected none (FP8 weights run with each token's "
                             "activations quantized when it is computed).")
        keys = [f"{prefix}.{name}_proj.{suffix}" for suffix in _SCALE_SUFFIXES]
        key = next((key for key in keys if tensors.has(key)), None)
        if key is None:
            raise ValueError(f"Invalid tensor '{keys[0]}' in {tensors.missing_in} for fused KV materialization: got "
                             f"no such tensor (nor '{keys[1]}'), expected the scale of the float8_e4m3fn "
                             f"'{weight}'.")
        scale = tensors.read_scale(key, rows)
        scales.append(np.broadcast_to(scale.reshape(-1), (rows,)))
    return np.concatenate(scales).astype(np.float32)


class _Tensors:
    """A checkpoint's tensors by name, each read from its file when asked for (a context manager
    that keeps the files it opened open until it exits)."""

    def __init__(self, directory: pathlib.Path):
        try:
            import safetensors
        except ImportError as error:
            raise ImportError("Reading a checkpoint needs the safetensors package (pip install safetensors).") \
                from error
        self._safe_open = safetensors.safe_open
        self.directory = directory
        self._files = contextlib.ExitStack()
        self._open: dict[pathlib.Path, object] = {}
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            with _located(index):
                weight_map = _read_weight_map(index)
            self.where = {key: directory / name for key, name in weight_map.items()}
            self.missing_in = index
            return
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise ValueError(f"Invalid path for fused KV materialization: got {str(directory)!r}, which holds no "
                             "*.safetensors, expected a local checkpoint directory with config.json and "
                             "*.safetensors.")
        self.where = {}
        for path in paths:
            for key in self._file(path).keys():
                self.where.setdefault(key, path)
        self.missing_in = paths[0] if len(paths) == 1 else directory / "*.safetensors"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._files.close()

    def _file(self, path: pathlib.Path):
        if path not in self._open:
            self._open[path] = self._files.enter_context(self._safe_open(str(path), framework="numpy"))
        return self._open[path]

    def has(self, key: str) -> bool:
        return key in self.where

    def read(self, key: str, shape: tuple[int, ...], expected: str) -> np.ndarray:
        """The tensor ``key``, refused unless it exists, is of a float dtype a projection takes and of
        ``shape`` (``expected`` says where that comes from), all checked before it is read. A
        projection weight (``*_proj.weight``) may be F8_E4M3, its scale read apart."""
        if key not in self.where:
            raise ValueError(f"Invalid tensor '{key}' in {self.missing_in} for fused KV materialization: got no "
                             f"such tensor, expected one of shape {expected}.")
        dtypes = _TENSOR_DTYPES + (_FP8_TENSOR_DTYPE,) if key.endswith("_proj.weight") else _TENSOR_DTYPES
        path, stored, got = self._header(key, dtypes)
        if got != shape:
            raise ValueError(f"Invalid tensor '{key}' in {path} for fused KV materialization: got shape {got}, "
                             f"expected {expected} from config.json.")
        if stored == _FP8_TENSOR_DTYPE:
            return _raw_tensor(path, key).view(numpy_dtype(FP8_WEIGHT_DTYPE)).reshape(shape)
        return self._file(path).get_tensor(key)

    def read_scale(self, key: str, rows: int) -> np.ndarray:
        """fp32: the scale ``key`` of an FP8 weight of ``rows`` rows, per tensor or per row."""
        path, _, got = self._header(key, _TENSOR_DTYPES)
        if got not in ((), (1,), (rows,), (rows, 1)):
            raise ValueError(f"Invalid tensor '{key}' in {path} for fused KV materialization: got shape {got}, "
                             f"expected () or (1,) (per tensor), or {(rows,)} or {(rows, 1)} (per output row).")
        return self._file(path).get_tensor(key).astype(np.float32)

    def stored_dtype(self, key: str) -> str:
        """safetensors' name of the dtype of tensor ``key`` (read already)."""
        return self._file(self.where[key]).get_slice(key).get_dtype()

    def _header(self, key: str, dtypes: tuple[str, ...]) -> tuple[pathlib.Path, str, tuple[int, ...]]:
        """``(file, dtype, shape)`` of the tensor ``key``, refused unless of one of ``dtypes``."""
        path = self.where[key]
        tensor = self._file(path).get_slice(key)
        stored = tensor.get_dtype()
        if stored not in dtypes:
            raise ValueError(f"Invalid tensor '{key}' in {path} for fused KV materialization: got dtype {stored}, "
                             f"expected one of {dtypes}.")
        return path, stored, tuple(int(d) for d in tensor.get_shape())


def _raw_tensor(path: pathlib.Path, key: str) -> np.ndarray:
    """uint8: the bytes of tensor ``key`` of a safetensors file (its NumPy reader has no fp8)."""
    with open(path, "rb") as file:
        header_size = int.from_bytes(file.read(8), "little")
        begin, end = json.loads(file.read(header_size))[key]["data_offsets"]
        file.seek(8 + header_size + begin)
        return np.frombuffer(bytearray(file.read(end - begin)), np.uint8)


def _read_weight_map(index: pathlib.Path) -> Mapping:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"Invalid index for fused KV materialization: got a file that does "
                         f"not read as a JSON object ({error}), expected a weight_map.") from error
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"Invalid index for fused KV materialization: got weight_map "
                         f"{_type_name(weight_map)}, expected a dict from tensor names to files.")
    return weight_map
