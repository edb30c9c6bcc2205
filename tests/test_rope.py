"""RoPE tables from a model config (``interop.core.rope``) against transformers' own rope
initialisation and rotary embedding modules, and the builder's refusals."""

import copy
import importlib
import json

import numpy as np
import pytest

from interop.core.reference import rope_cos_sin_cache
from interop.core.rope import ROPE_TYPES, RopeParameters, rope_cos_sin_table, rope_frequencies

HIDDEN = dict(hidden_size=128, num_attention_heads=4, max_position_embeddings=40000)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8192)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)
_RNG = np.random.default_rng(26)
LONGROPE = dict(type="longrope",
                short_factor=[float(x) for x in np.round(1 + _RNG.random(16), 3)],
                long_factor=[float(x) for x in np.round(1 + 8 * _RNG.random(16), 3)])

# name: (transformers model family, its config class prefix, config kwargs in the
# transformers 4.x layout, table rows). Llama and Qwen3 set head_dim; Phi and Phi3 derive
# it as hidden_size // num_attention_heads; Phi's rotary embedding honours
# partial_rotary_factor for every type, Llama's only for the scaled ones.
CASES = {
    "default": ("llama", "Llama", dict(head_dim=32, rope_theta=10000.0), 40000),
    "default-theta-1e6": ("qwen3", "Qwen3", dict(head_dim=32, rope_theta=1e6), 40000),
    "linear": ("llama", "Llama", dict(head_dim=32, rope_theta=10000.0,
                                      rope_scaling=dict(type="linear", factor=4.0)), 40000),
    "llama3": ("llama", "Llama", dict(head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3), 40000),
    "yarn": ("qwen3", "Qwen3", dict(head_dim=32, rope_theta=1e6, rope_scaling=YARN), 40000),
    "yarn-mscale-betas-untruncated": ("llama", "Llama", dict(head_dim=32, rope_theta=10000.0, rope_scaling=dict(
        YARN, factor=40.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=0.707,
        beta_fast=16, beta_slow=2, truncate=False)), 40000),
    "yarn-attention-factor": ("llama", "Llama", dict(head_dim=32, rope_theta=10000.0, rope_scaling=dict(
        YARN, attention_factor=0.9)), 40000),
    "yarn-factor-from-context-lengths": ("llama", "Llama", dict(head_dim=32, rope_theta=10000.0, rope_scaling=dict(
        YARN, factor=None, original_max_position_embeddings=1000)), 40000),
    "partial-default": ("phi", "Phi", dict(rope_theta=10000.0, partial_rotary_factor=0.5), 40000),
    "partial-yarn": ("phi", "Phi", dict(rope_theta=10000.0, partial_rotary_factor=0.5,
                                        rope_scaling=YARN), 40000),
    "partial-llama3": ("phi", "Phi", dict(rope_theta=500000.0, partial_rotary_factor=0.75,
                                          rope_scaling=LLAMA3), 40000),
    "longrope-long": ("phi3", "Phi3", dict(rope_theta=10000.0, original_max_position_embeddings=4096,
                                           rope_scaling=LONGROPE), 40000),
    "longrope-spelt-yarn": ("phi3", "Phi3", dict(rope_theta=10000.0, original_max_position_embeddings=4096,
                                                rope_scaling=dict(LONGROPE, type="yarn")), 40000),
    "yarn-top-level-original-context": ("llama", "Llama", dict(
        head_dim=32, rope_theta=10000.0, original_max_position_embeddings=2048,
        rope_scaling=dict(YARN, original_max_position_embeddings=8192)), 40000),
    "longrope-short": ("phi3", "Phi3", dict(rope_theta=10000.0, original_max_position_embeddings=4096,
                                            rope_scaling=LONGROPE), 4096),
}
POSITIONS = np.array([0, 1, 2, 3, 17, 1000, 4095, 4096, 4097, 20000, 32767, 39999])


def _transformers_rope(case):
    """transformers' config and rotary embedding module for a case, and its saved config.json."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    family, prefix, kwargs, _ = CASES[case]
    # A copy: transformers' configs write their defaults into the rope_scaling dict they get.
    config = getattr(transformers, f"{prefix}Config")(**HIDDEN, **copy.deepcopy(kwargs))
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_embedding = getattr(module, f"{prefix}RotaryEmbedding")(config)
    return config, rotary_embedding, json.loads(config.to_json_string())  # what save_pretrained writes


@pytest.mark.parametrize("case", CASES)
def test_table_equals_transformers_rotary_embedding_cos_sin(case):
    import torch

    _, rotary_embedding, config_json = _transformers_rope(case)
    max_position = CASES[case][3]
    rope = RopeParameters.from_hf_config(config_json)
    positions = POSITIONS[POSITIONS < max_position]
    cos, sin = rotary_embedding(torch.zeros(1), torch.from_numpy(positions)[None])
    inv_freq, attention_factor = rope_frequencies(rope, max_position)
    table = rope_cos_sin_table(rope, max_position)
    half = rope.rotary_dim // 2
    assert table.shape == (max_position, rope.rotary_dim) and table.dtype == np.float32

    # transformers' fp32 powers and products: within a few fp32 half-ulps of our float64.
    their_inv_freq = rotary_embedding.inv_freq.double().numpy()
    np.testing.assert_allclose(their_inv_freq, inv_freq, rtol=8 * 2.0**-24, atol=0)
    assert rotary_embedding.attention_scaling == pytest.approx(attention_factor, rel=2.0**-52)
    # transformers' angle, p times its fp32 inv_freq rounded to fp32, is off by p * |inv_freq
    # difference| + half an ulp of the angle; cos/sin, scaling and our rounding add a few of 1.
    angles = positions[:, None] * np.tile(inv_freq, 2)[None, :]
    angle_error = positions[:, None] * np.tile(np.abs(their_inv_freq - inv_freq), 2)[None, :]
    tolerance = attention_factor * (angle_error + 2.0**-24 * angles + 8 * 2.0**-24)
    # Laid out as the op applies it: dims i and i + rotary_dim/2 share cos[i] and sin[i].
    rows = table[positions]
    for ours, theirs in ((rows[:, :half], cos[0]), (rows[:, half:], sin[0])):
        difference = np.abs(np.tile(ours, 2).astype(np.float64) - theirs.double().numpy())
        assert (difference <= tolerance).all(), f"{case}: worst {difference.max():.3g} over tolerance"
    if rope.rope_type == "default" and rope.rotary_dim == rope.head_dim:
        np.testing.assert_array_equal(rope_cos_sin_cache(max_position, rope.rotary_dim, rope.theta), table)


@pytest.mark.parametrize("case", CASES)
def test_transformers_4x_config_reads_as_its_5x_form(case):
    config, _, config_json = _transformers_rope(case)
    legacy = dict(HIDDEN, **CASES[case][2], model_type=config.model_type)  # rope_* at the top
    assert "rope_parameters" not in legacy and "rope_parameters" in config_json
    assert RopeParameters.from_hf_config(legacy) == RopeParameters.from_hf_config(config_json)


def test_longrope_table_takes_long_factors_beyond_the_original_context():
    _transformers_rope("longrope-long")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for case in ("longrope-long", "longrope-short"):
        config, _, config_json = _transformers_rope(case)
        max_position = CASES[case][3]
        expected, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=max_position)
        inv_freq, _ = rope_frequencies(RopeParameters.from_hf_config(config_json), max_position)
        np.testing.assert_allclose(expected.double().numpy(), inv_freq, rtol=8 * 2.0**-24, atol=0)


DYNAMIC_REASON = "dynamic NTK scaling depends on the sequence length at run time"


def test_dynamic_rope_type_is_refused_saying_it_depends_on_the_sequence_length():
    with pytest.raises(ValueError, match=f"got 'dynamic', expected one of .*{DYNAMIC_REASON}"):
        RopeParameters("dynamic", 10000.0, 64, factor=2.0)
    for scaling in ({"type": "dynamic", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}):
        config = {"rope_theta": 10000.0, "head_dim": 64, "rope_scaling": scaling}
        with pytest.raises(ValueError, match=DYNAMIC_REASON):
            RopeParameters.from_hf_config(config)


def test_unknown_rope_type_is_refused_naming_it_and_the_supported_ones():
    with pytest.raises(ValueError) as raised:
        RopeParameters.from_hf_config({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4},
                                   "head_dim": 64})
    assert str(raised.value) == ("Invalid rope_type for fused KV materialization: got 'proportional', "
                                 f"expected one of {ROPE_TYPES}.")
    with pytest.raises(TypeError, match="Invalid rope_type for fused KV materialization: got 3 "):
        RopeParameters(3, 10000.0, 64)


REFUSED = [
    (dict(rope_type="default", theta=1.0, head_dim=64), ValueError,
     "Invalid theta for fused KV materialization: got 1.0, expected a real number > 1."),
    (dict(rope_type="default", theta="1e4", head_dim=64), TypeError,
     "Invalid theta for fused KV materialization: got '1e4' (str), expected a real number > 1."),
    (dict(rope_type="default", theta=1e4, head_dim=0), ValueError,
     "Invalid head_dim for fused KV materialization: got 0, expected a positive int."),
    (dict(rope_type="default", theta=1e4, head_dim=64, partial_rotary_factor=0.3), ValueError,
     "Invalid partial_rotary_factor for fused KV materialization: got 0.3 (rotary dim "
     "int(64 * 0.3) = 19), expected a factor giving an even rotary dim >= 2."),
    (dict(rope_type="default", theta=1e4, head_dim=64, partial_rotary_factor=1.5), ValueError,
     "Invalid partial_rotary_factor for fused KV materialization: got 1.5, expected a real "
     "number in (0, 1]."),
    (dict(rope_type="default", theta=1e4, head_dim=64, factor=2.0), ValueError,
     "Invalid factor for fused KV materialization: got 2.0, expected None (rope_type 'default' "
     "does not use it)."),
    (dict(rope_type="yarn", theta=1e4, head_dim=64, original_max_position_embeddings=4096), ValueError,
     "Invalid factor for fused KV materialization: got None, expected a value (rope_type 'yarn' needs it)."),
    (dict(rope_type="linear", theta=1e4, head_dim=64, factor=0.0), ValueError,
     "Invalid factor for fused KV materialization: got 0.0, expected a positive real number."),
    (dict(rope_type="yarn", theta=1e4, head_dim=64, factor=4.0, original_max_position_embeddings=4096,
          truncate="no"), TypeError,
     "Invalid truncate for fused KV materialization: got 'no' (str), expected a bool."),
    (dict(LLAMA3, theta=5e5, head_dim=64, high_freq_factor=1.0), ValueError,
     "Invalid high_freq_factor for fused KV materialization: got 1.0, expected a real number > "
     "low_freq_factor (1.0)."),
    (dict(rope_type="longrope", theta=1e4, head_dim=64, factor=8.0, original_max_position_embeddings=4096,
          short_factor=[1.0] * 31, long_factor=[2.0] * 32), ValueError,
     "Invalid short_factor for fused KV materialization: got 31 values, expected 32 (rotary_dim // 2)."),
    (dict(rope_type="longrope", theta=1e4, head_dim=64, factor=8.0, original_max_position_embeddings=4096,
          short_factor=[1.0] * 32, long_factor=[2.0] * 31 + [-1.0]), ValueError,
     "Invalid long_factor[31] for fused KV materialization: got -1.0, expected a positive real number."),
]


@pytest.mark.parametrize("kwargs, error, message", REFUSED, ids=[m.split(" for")[0] for _, _, m in REFUSED])
def test_rope_config_refuses_bad_parameters_naming_them(kwargs, error, message):
    with pytest.raises(error) as raised:
        RopeParameters(**kwargs)
    assert str(raised.value) == message


def test_table_refuses_a_bad_row_count_or_a_non_rope_config():
    rope = RopeParameters("default", 10000.0, 16)
    with pytest.raises(ValueError, match=r"^Invalid max_position for fused KV materialization: got 0, "
                                         r"expected a positive int\.$"):
        rope_cos_sin_table(rope, 0)
    with pytest.raises(TypeError, match=r"^Invalid rope for fused KV materialization: got dict, "
                                        r"expected an interop\.core\.rope\.RopeParameters\.$"):
        rope_cos_sin_table({"rope_theta": 1e4}, 16)


CONFIG_REFUSED = [
    ({"head_dim": 64, "rope_parameters": {"rope_type": "default"}},
     "Invalid config['rope_theta'] for fused KV materialization: got no rope_theta"),
    ({"rope_theta": 1e4, "hidden_size": 128},
     "Invalid config['num_attention_heads'] for fused KV materialization: got no num_attention_heads "
     "and no head_dim"),
    ({"rope_theta": 1e4, "head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "Invalid config['max_position_embeddings'] for fused KV materialization: got no "
     "max_position_embeddings, expected it (rope_type 'yarn' without original_max_position_embeddings"),
    ({"head_dim": 64, "layer_types": ["full_attention", "sliding_attention"],
      "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}},
     "Invalid layer_type for fused KV materialization: got None, expected one of ('full_attention', "
     "'sliding_attention') (the config gives rope_parameters per layer type)."),
]


@pytest.mark.parametrize("config, message", CONFIG_REFUSED, ids=[m.split(" for")[0] for _, m in CONFIG_REFUSED])
def test_from_hf_config_refuses_a_config_without_what_the_table_needs(config, message):
    with pytest.raises(ValueError) as raised:
        RopeParameters.from_hf_config(config)
    assert str(raised.value).startswith(message)


def test_from_hf_config_picks_the_layer_types_entry():
    config = {"head_dim": 64, "layer_types": ["full_attention", "sliding_attention"],
              "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                  "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}
    for layer_type, theta in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        assert RopeParameters.from_hf_config(config, layer_type=layer_type) == RopeParameters("default", theta, 64)


def test_importing_interop_rope_imports_no_framework():
    import subprocess
    import sys

    probe = ("import sys, interop.core.rope; "
             "print(sorted(m for m in ('torch', 'jax', 'triton', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_from_hf_config_reads_null_entries_as_absent():
    config = {"head_dim": 64, "rope_theta": 1e4, "partial_rotary_factor": None,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                               "attention_factor": None, "beta_fast": None, "rope_theta": None}}
    assert RopeParameters.from_hf_config(config) == RopeParameters(
        "yarn", 1e4, 64, factor=4.0, original_max_position_embeddings=4096)


def test_a_layers_rope_from_a_config_builds_the_scaled_table_and_refuses_disagreeing_parameters():
    from interop.core.materializer import RopeConfig

    config = {"hidden_size": 512, "num_attention_heads": 4, "head_dim": 128, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    parameters = RopeParameters.from_hf_config(config)
    layer_rope = RopeConfig.from_hf_config(config, max_position=64)
    assert layer_rope.parameters == parameters
    assert (layer_rope.cos_sin_cache() == rope_cos_sin_table(parameters, 64)).all()
    # llama3 scales the low frequencies: the table is not the plain one of the same base.
    assert not (layer_rope.cos_sin_cache() == RopeConfig(128, 64, base=500000.0).cos_sin_cache()).all()
    with pytest.raises(ValueError, match=r"^Invalid rope parameters for fused KV materialization: got "):
        RopeConfig(64, 64, base=500000.0, parameters=parameters)
