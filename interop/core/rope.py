"""RoPE tables from a model's configuration: the static rope types of transformers.

A :class:`RopeParameters` holds a rope type and its parameters, read from a model's
``config.json`` with :meth:`RopeParameters.from_hf_config`; :func:`rope_cos_sin_table` turns
it into the op's ``cos_sin_cache``. Row ``p`` of the table is::

    cos(p * inv_freq) * attention_factor, then sin(p * inv_freq) * attention_factor

with ``inv_freq`` (``rotary_dim / 2`` inverse frequencies) and ``attention_factor`` as
transformers' rope initialisation computes them for the type, and ``rotary_dim =
int(head_dim * partial_rotary_factor)``. The math is float64, rounded once to fp32.

``dynamic`` (NTK) scaling is refused: its frequencies depend on the length of the
sequence at run time, so no table built ahead of time holds them. Importing this module
imports neither torch nor jax.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence

import numpy as np

from interop.core.spec import _type_name, size_argument

ROPE_TYPES = ("default", "linear", "yarn", "llama3", "longrope")

# Per rope type: the parameters it needs, then those it may take (None elsewhere).
_PARAMETERS = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor",
                "high_freq_factor"), ()),
    "longrope": (("factor", "original_max_position_embeddings", "short_factor", "long_factor"),
                 ("attention_factor",)),
}
# Model types whose configs once wrote longrope as "su" or "yarn" (transformers renames them).
_LONGROPE_SPELLINGS = {"phi3": ("su", "yarn"), "phi4_multimodal": ("su", "yarn")}
_TYPE_PARAMETERS = tuple(dict.fromkeys(
    name for required, optional in _PARAMETERS.values() for name in required + optional))


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """A rotary embedding: its type (one of ``ROPE_TYPES``), base and parameters.

    ``theta`` is the base, ``head_dim`` the attention head's size; ``rotary_dim =
    int(head_dim * partial_rotary_factor)`` leading dims of a head are rotated. The
    type-specific parameters are None unless the type takes them (``_PARAMETERS``);
    ``beta_fast``, ``beta_slow`` and ``truncate`` default to 32, 1 and True as in
    transformers, and an ``attention_factor`` left None is derived from ``factor``.
    Everything is checked here, at construction.
    """

    rope_type: str
    theta: float
    head_dim: int
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        _check_rope_type(self.rope_type)
        self._set("theta", _real("theta", self.theta, "a real number > 1", lambda x: x > 1))
        self._set("head_dim", size_argument("head_dim", self.head_dim))
        self._set("partial_rotary_factor", _real(
            "partial_rotary_factor", self.partial_rotary_factor, "a real number in (0, 1]",
            lambda x: 0 < x <= 1))
        rotary_dim = self.rotary_dim
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"Invalid partial_rotary_factor for fused KV materialization: got "
                f"{self.partial_rotary_factor} (rotary dim int({self.head_dim} * "
                f"{self.partial_rotary_factor}) = {rotary_dim}), expected a factor giving an "
                f"even rotary dim >= 2.")
        required, optional = _PARAMETERS[self.rope_type]
        for name in _TYPE_PARAMETERS:
            value = getattr(self, name)
            if value is None and name in required:
                raise ValueError(
                    f"Invalid {name} for fused KV materialization: got None, expected a value "
                    f"(rope_type {self.rope_type!r} needs it).")
            if value is not None and name not in required + optional:
                raise ValueError(
                    f"Invalid {name} for fused KV materialization: got {value!r}, expected None "
                    f"(rope_type {self.rope_type!r} does not use it).")
            if value is not None:
                self._set(name, _PARAMETER_CHECKS[name](self, name, value))

    def _set(self, name, value):
        object.__setattr__(self, name, value)

    @property
    def rotary_dim(self) -> int:
        """The number of leading dims of a head that are rotated (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_config(cls, config: Mapping, *, layer_type: str | None = None) -> RopeParameters:
        """The rotary embedding of a model's ``config.json`` (a dict), as transformers reads it.

        Reads both layouts: transformers 4.x (``rope_theta``, ``partial_rotary_factor`` and
        ``rope_scaling`` with ``type`` or ``rope_type``) and 5.x (``rope_parameters``);
        ``head_dim`` or ``hidden_size // num_attention_heads``. A missing
        ``original_max_position_embeddings`` is ``max_position_embeddings`` (a top-level one
        takes precedence, as in transformers), and a missing yarn or longrope ``factor`` is
        their ratio; Phi-3's ``su`` and ``yarn`` are its longrope. ``layer_type`` picks one entry of ``rope_parameters`` given per layer
        type (``layer_types``).
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"Invalid config for fused KV materialization: got "
                            f"{_type_name(config)}, expected a dict (a model's config.json).")
        parameters = _rope_parameters(config, layer_type)
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type in _LONGROPE_SPELLINGS.get(config.get("model_type"), ()):
            rope_type = "longrope"
        _check_rope_type(rope_type)
        theta = _given(parameters.get("rope_theta"), config.get("rope_theta"))
        if theta is None:
            raise ValueError(
                "Invalid config['rope_theta'] for fused KV materialization: got no rope_theta "
                "(in rope_parameters, rope_scaling or at the top level), expected the RoPE base "
                "(a model class's default base is not known here).")
        required, optional = _PARAMETERS[rope_type]
        given = {name: parameters[name] for name in required + optional
                 if parameters.get(name) is not None}
        if "original_max_position_embeddings" in required:
            _fill_context_lengths(config, rope_type, given)
        partial_rotary_factor = _given(parameters.get("partial_rotary_factor"),
                                       config.get("partial_rotary_factor"), 1.0)
        return cls(rope_type, theta, _config_head_dim(config), partial_rotary_factor, **given)


def rope_frequencies(rope: RopeParameters, max_position: int) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)``: float64[rotary_dim // 2] and a float.

    What transformers' rope initialisation returns for the type (``ROPE_INIT_FUNCTIONS``
    with ``seq_len=max_position``), in float64: longrope takes ``long_factor`` for a table
    longer than ``original_max_position_embeddings``, ``short_factor`` otherwise.
    """
    _check_rope(rope)
    max_position = size_argument("max_position", max_position)
    inv_freq = base_inverse_frequencies(rope.theta, rope.rotary_dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_frequencies(rope, inv_freq), 1.0
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, inv_freq), _yarn_attention_factor(rope)
    if rope.rope_type == "longrope":
        long = max_position > rope.original_max_position_embeddings
        ext_factors = np.asarray(rope.long_factor if long else rope.short_factor, np.float64)
        return inv_freq / ext_factors, _longrope_attention_factor(rope)
    return inv_freq, 1.0


def rope_cos_sin_table(rope: RopeParameters, max_position: int) -> np.ndarray:
    """fp32[max_position, rotary_dim]: the op's ``cos_sin_cache`` for ``rope``.

    Row ``p``: ``rotary_dim / 2`` values ``cos(p * inv_freq) * attention_factor``, then as
    many ``sin(p * inv_freq) * attention_factor`` (transformers scales cos and sin by the
    attention factor); ``inv_freq`` and the factor from :func:`rope_frequencies`.
    """
    inv_freq, attention_factor = rope_frequencies(rope, max_position)
    return cos_sin_rows(inv_freq, max_position, attention_factor)


def base_inverse_frequencies(theta: float, rotary_dim: int) -> np.ndarray:
    """float64[ceil(rotary_dim / 2)]: plain RoPE's ``theta ** (-2i / rotary_dim)``."""
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def cos_sin_rows(inv_freq: np.ndarray, max_position: int, attention_factor: float = 1.0) -> np.ndarray:
    """fp32[max_position, 2 * len(inv_freq)]: cos then sin of ``p * inv_freq``, scaled, cast once."""
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    rows = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    return (rows * attention_factor).astype(np.float32)


def _llama3_frequencies(rope: RopeParameters, inv_freq: np.ndarray) -> np.ndarray:
    """Long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    context = rope.original_max_position_embeddings
    low, high = rope.low_freq_factor, rope.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > context / low, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return np.where(medium, blended, scaled)


def _yarn_frequencies(rope: RopeParameters, inv_freq: np.ndarray) -> np.ndarray:
    """Interpolated (divided by ``factor``) below a dim range, kept above it, ramped between."""
    dim, theta = rope.rotary_dim, rope.theta
    context = rope.original_max_position_embeddings

    def correction_dim(rotations):  # the dim whose wavelength turns `rotations` times in the context
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(32.0 if rope.beta_fast is None else rope.beta_fast)
    high = correction_dim(1.0 if rope.beta_slow is None else rope.beta_slow)
    if rope.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against an empty ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


def _yarn_attention_factor(rope: RopeParameters) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale):
        return 1.0 if rope.factor <= 1 else 0.1 * scale * math.log(rope.factor) + 1.0

    # transformers takes the ratio only when both are given and non-zero.
    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale(1.0)


def _longrope_attention_factor(rope: RopeParameters) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def _check_rope(rope) -> None:
    if not isinstance(rope, RopeParameters):
        raise TypeError(f"Invalid rope for fused KV materialization: got {_type_name(rope)}, "
                        "expected an interop.core.rope.RopeParameters.")


def _check_rope_type(rope_type) -> None:
    if not isinstance(rope_type, str):
        raise TypeError(f"Invalid rope_type for fused KV materialization: got {rope_type!r} "
                        f"({_type_name(rope_type)}), expected one of {ROPE_TYPES}.")
    if rope_type == "dynamic":
        raise ValueError(
            f"Invalid rope_type for fused KV materialization: got 'dynamic', expected one of "
            f"{ROPE_TYPES} (dynamic NTK scaling depends on the sequence length at run time, so no "
            "table built ahead of time holds it).")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"Invalid rope_type for fused KV materialization: got {rope_type!r}, "
                         f"expected one of {ROPE_TYPES}.")


def _real(name: str, value, expected: str, in_range) -> float:
    """``value`` as a float; ``TypeError`` unless a real number, ``ValueError`` outside the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name} for fused KV materialization: "
                        f"got {value!r} ({_type_name(value)}), expected {expected}.")
    value = float(value)
    if not (math.isfinite(value) and in_range(value)):
        raise ValueError(f"Invalid {name} for fused KV materialization: got {value}, "
                         f"expected {expected}.")
    return value


def _positive(rope, name, value):
    return _real(name, value, "a positive real number", lambda x: x > 0)


def _finite(rope, name, value):
    return _real(name, value, "a finite real number", lambda x: True)


def _high_freq_factor(rope, name, value):
    low = rope.low_freq_factor
    return _real(name, value, f"a real number > low_freq_factor ({low})", lambda x: x > low)


def _truncate(rope, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name} for fused KV materialization: "
                        f"got {value!r} ({_type_name(value)}), expected a bool.")
    return value


def _factors(rope, name, value):
    """One positive factor per rotated pair, as a tuple (a frozen config hashes)."""
    count = rope.rotary_dim // 2
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"Invalid {name} for fused KV materialization: got {_type_name(value)}, "
                        f"expected a sequence of {count} positive real numbers.")
    if len(value) != count:
        raise ValueError(f"Invalid {name} for fused KV materialization: got {len(value)} values, "
                         f"expected {count} (rotary_dim // 2).")
    return tuple(_positive(rope, f"{name}[{i}]", x) for i, x in enumerate(value))


_PARAMETER_CHECKS = {
    "factor": _positive,
    "original_max_position_embeddings": lambda rope, name, value: size_argument(name, value),
    "attention_factor": _positive,
    "beta_fast": _positive,
    "beta_slow": _positive,
    "mscale": _finite,
    "mscale_all_dim": _finite,
    "truncate": _truncate,
    "low_freq_factor": _positive,
    "high_freq_factor": _high_freq_factor,
    "short_factor": _factors,
    "long_factor": _factors,
}


def _rope_parameters(config: Mapping, layer_type: str | None) -> Mapping:
    """The RoPE entry of a config: ``rope_scaling`` (4.x) before ``rope_parameters`` (5.x)."""
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping):
        raise TypeError(f"Invalid config['rope_parameters'] for fused KV materialization: got "
                        f"{_type_name(parameters)}, expected a dict.")
    per_type = [key for key in parameters if key in (config.get("layer_types") or ())]
    if not per_type:
        return parameters
    if layer_type not in per_type:
        raise ValueError(
            f"Invalid layer_type for fused KV materialization: got {layer_type!r}, expected one "
            f"of {tuple(per_type)} (the config gives rope_parameters per layer type).")
    if parameters[layer_type] is None:
        raise ValueError(
            f"Invalid layer_type for fused KV materialization: got {layer_type!r}, whose "
            "rope_parameters are None (no rotary embedding), expected a layer type with RoPE.")
    return parameters[layer_type]


def _given(*values):
    """The first value that is not None: a rope entry's own, then the config's, then a default."""
    return next((value for value in values if value is not None), None)


def _fill_context_lengths(config: Mapping, rope_type: str, given: dict) -> None:
    """``original_max_position_embeddings`` and a yarn/longrope ``factor`` where left out."""
    if config.get("original_max_position_embeddings") is not None:
        given["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    derives_factor = rope_type != "llama3" and "factor" not in given
    if "original_max_position_embeddings" in given and not derives_factor:
        return
    max_position_embeddings = config.get("max_position_embeddings")
    if max_position_embeddings is None:
        raise ValueError(
            "Invalid config['max_position_embeddings'] for fused KV materialization: got no "
            f"max_position_embeddings, expected it (rope_type {rope_type!r} without "
            "original_max_position_embeddings or factor derives them from it).")
    original = given.setdefault("original_max_position_embeddings", max_position_embeddings)
    if derives_factor:
        given["factor"] = max_position_embeddings / original


def _config_head_dim(config: Mapping) -> int:
    if config.get("head_dim") is not None:
        return config["head_dim"]
    for key in ("hidden_size", "num_attention_heads"):
        if config.get(key) is None:
            raise ValueError(
                f"Invalid config['{key}'] for fused KV materialization: got no {key} and no "
                "head_dim, expected head_dim or hidden_size and num_attention_heads.")
    hidden = size_argument("config['hidden_size']", config["hidden_size"])
    heads = size_argument("config['num_attention_heads']", config["num_attention_heads"])
    return hidden // heads
