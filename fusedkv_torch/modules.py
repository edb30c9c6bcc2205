"""Draft layers from the attention modules a PyTorch serving stack already holds.

:func:`module_layers` reads, by the attributes they expose (duck typing, no import of
the stack), one :class:`~interop.core.materializer.LayerKV` per attention module:

* the K/V projection: a fused ``qkv_proj`` (``.weight`` ``[q_size + 2*kv_size, hidden]``,
  optional ``.bias``) with the module's ``q_size`` and ``kv_size`` (vLLM, sglang), or
  separate ``k_proj`` and ``v_proj`` Linears (transformers), unquantized (a quantized
  module's weight is laid out for its stack's kernels: FP8 drafts load with ``from_pretrained``);
* the K-norm, where the module has one: ``k_norm.weight`` and its epsilon
  (``variance_epsilon`` or ``eps``);
* ``head_dim`` (or ``head_size``);

and the rotary table from the rotary embedding: one with a ``cos_sin_cache`` (rows of
``rotary_dim/2`` cos then sin values), ``rotary_dim`` (or ``head_size``) and
``is_neox_style`` (vLLM, sglang), taken as it is; or transformers' model rotary embedding
(``inv_freq``, ``attention_scaling`` and its ``config``), whose table is built from that
config by :meth:`~interop.core.materializer.RopeConfig.from_hf_config`. What cannot be read
is refused with a ``ValueError`` naming the attribute and the layer.
"""

from __future__ import annotations

from typing import Sequence

import torch

from interop.core.materializer import LayerKV, RopeConfig
from interop.core.spec import _type_name

_PROJECTIONS = "a fused qkv_proj (with q_size and kv_size) or k_proj and v_proj"


def module_layers(layers: Sequence, rotary_emb=None) -> tuple[tuple[LayerKV, ...], torch.Tensor | None]:
    """``(layers, cos_sin_cache)``: a LayerKV per attention module of ``layers``, and the
    rotary table to give the materializer (None: the layers' RoPE builds it).

    ``rotary_emb``: the rotary embedding; None takes layer 0's ``rotary_emb`` attribute.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("Invalid layers for fused KV materialization: got 0, expected at least 1.")
    if rotary_emb is None:
        rotary_emb = getattr(layers[0], "rotary_emb", None)
        if rotary_emb is None:
            raise ValueError(f"Invalid rotary_emb for fused KV materialization: got None and layers[0] "
                             f"({_type_name(layers[0])}) has no rotary_emb, expected the model's rotary embedding.")
    rope, cos_sin_cache = _rope(rotary_emb)
    return tuple(_layer(index, module, rope) for index, module in enumerate(layers)), cos_sin_cache


def _missing(index: int, module, attribute: str, expected: str) -> ValueError:
    return ValueError(f"Invalid layers[{index}] for fused KV materialization: got {_type_name(module)} without "
                      f"{attribute}, expected {expected}.")


def _attribute(index: int, module, names: tuple[str, ...], expected: str):
    """The first of the dotted attribute paths ``names`` the module has, else refused naming them."""
    for name in names:
        value = module
        for part in name.split("."):
            value = getattr(value, part, None)
        if value is not None:
            return value
    raise _missing(index, module, " or ".join(names), expected)


def _projection(index: int, module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(kv_proj_weight, kv_proj_bias)``: the K rows then the V rows."""
    fused = getattr(module, "qkv_proj", None)
    if fused is not None:
        q_size, kv_size = (int(_attribute(index, module, (name,), f"{_PROJECTIONS}: the rows of the fused "
                                          f"projection")) for name in ("q_size", "kv_size"))
        rows = slice(q_size, q_size + 2 * kv_size)
        weight = _unquantized(index, "qkv_proj.weight", _attribute(index, module, ("qkv_proj.weight",), _PROJECTIONS))
        bias = getattr(fused, "bias", None)
        return weight.detach()[rows], None if bias is None else bias.detach()[rows]
    projections = [_attribute(index, module, (name,), _PROJECTIONS) for name in ("k_proj", "v_proj")]
    weights = [_unquantized(index, f"{name}.weight", projection.weight).detach()
               for name, projection in zip(("k_proj", "v_proj"), projections)]
    biases = [getattr(projection, "bias", None) for projection in projections]
    return torch.cat(weights), None if biases[0] is None else torch.cat([bias.detach() for bias in biases])


def _unquantized(index: int, name: str, weight: torch.Tensor) -> torch.Tensor:
    """A projection weight of a float dtype: a quantized module's weight is laid out for its
    serving stack's own kernels (transposed, packed), which this reading does not know."""
    if not weight.dtype.is_floating_point or weight.element_size() == 1:
        raise ValueError(f"Invalid layers[{index}].{name} for fused KV materialization: got dtype "
                         f"{str(weight.dtype).removeprefix('torch.')}, expected an unquantized projection (bf16, "
                         "fp16 or fp32; a quantized draft loads from its checkpoint with from_pretrained).")
    return weight


def _layer(index: int, module, rope: RopeConfig) -> LayerKV:
    weight, bias = _projection(index, module)
    head_dim = int(_attribute(index, module, ("head_dim", "head_size"), "the attention's head size"))
    k_norm_weight = eps = None
    k_norm = getattr(module, "k_norm", None)
    if k_norm is not None:
        k_norm_weight = _attribute(index, module, ("k_norm.weight",), "the K-norm's weight").detach()
        eps = float(_attribute(index, module, ("k_norm.variance_epsilon", "k_norm.eps"), "the K-norm's epsilon"))
    return LayerKV(weight, k_norm_weight, eps, weight.shape[0] // (2 * head_dim), head_dim, rope, kv_proj_bias=bias)


def _rope(rotary_emb) -> tuple[RopeConfig, torch.Tensor | None]:
    """The layers' RoPE and the table to use: a serving stack's own ``cos_sin_cache`` (in fp32),
    or None for one built from a transformers rotary embedding's config."""
    cache = getattr(rotary_emb, "cos_sin_cache", None)
    if cache is not None:
        rotary_dim = getattr(rotary_emb, "rotary_dim", None) or getattr(rotary_emb, "head_size", None)
        neox = getattr(rotary_emb, "is_neox_style", None)
        if rotary_dim is None or neox is None:
            missing = "rotary_dim (or head_size)" if rotary_dim is None else "is_neox_style"
            raise ValueError(f"Invalid rotary_emb for fused KV materialization: got {_type_name(rotary_emb)} with a "
                             f"cos_sin_cache and without {missing}, expected both to read the table.")
        rope = RopeConfig(int(rotary_dim), int(cache.shape[0]), float(getattr(rotary_emb, "base", 10000.0)),
                          "neox" if neox else "gptj")
        return rope, cache.detach().to(torch.float32)
    config = getattr(rotary_emb, "config", None)
    if getattr(rotary_emb, "inv_freq", None) is None or config is None:
        raise ValueError(f"Invalid rotary_emb for fused KV materialization: got {_type_name(rotary_emb)} without "
                         "cos_sin_cache or inv_freq and config, expected a serving stack's rotary embedding "
                         "(cos_sin_cache, rotary_dim, is_neox_style) or a transformers one.")
    config = config.to_dict()
    return RopeConfig.from_hf_config(config, max_position=config["max_position_embeddings"]), None
