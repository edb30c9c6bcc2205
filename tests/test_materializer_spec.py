"""The materializer's layer validation: every mismatch named by its layer, word for word."""

import dataclasses
import re

import numpy as np
import pytest

from interop.core.arrays import numpy_dtype
from interop.core.materializer import (
    RopeConfig,
    stacked_rope_tables,
    validate_layers,
    validate_materialize,
    validate_reserve,
)
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, random_case

OP = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
ROPE = RopeConfig(rotary_dim=32, max_position=64)


def _layers(n_layers=3, **changes_to_layer_2):
    layers = list(random_case(OP, n_layers=n_layers, hidden=64, total_ctx=0, max_position=64).layers)
    if changes_to_layer_2:
        layers[2] = dataclasses.replace(layers[2], **changes_to_layer_2)
    return layers


def _expect(message, layers, cos_sin_cache=None):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_layers(layers, cos_sin_cache)


def test_consistent_layers_give_the_stacked_configuration():
    config = validate_layers(_layers())
    assert (config.op, config.n_layers, config.hidden) == (OP, 3, 64)
    assert (config.weight_dtype, config.max_position, config.kv_width) == ("bfloat16", 64, 3 * 128)
    assert config.kv_shape(5) == (5, 3, 128)


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=4), "num_kv_heads got 4, expected 2 as in layer 0."),
    (dict(head_dim=16), "head_dim got 16, expected 32 as in layer 0."),
    (dict(rope=RopeConfig(32, 128)),
     "rope configuration got RopeConfig(rotary_dim=32, max_position=128, base=10000.0, "
     "style='neox'), expected RopeConfig(rotary_dim=32, max_position=64, base=10000.0, "
     "style='neox') as in layer 0."),
    (dict(rope=RopeConfig(32, 64, style="gptj")),
     "rope configuration got RopeConfig(rotary_dim=32, max_position=64, base=10000.0, "
     "style='gptj'), expected RopeConfig(rotary_dim=32, max_position=64, base=10000.0, "
     "style='neox') as in layer 0."),
    (dict(kv_proj_weight=np.zeros((128, 48), numpy_dtype("bfloat16"))),
     "kv_proj_weight shape got (128, 48), expected (128, 64) = (2*num_kv_heads*head_dim, "
     "hidden) as in layer 0."),
    (dict(kv_proj_weight=np.zeros((64, 64), numpy_dtype("bfloat16"))),
     "kv_proj_weight shape got (64, 64), expected (128, 64) = (2*num_kv_heads*head_dim, "
     "hidden) as in layer 0."),
    (dict(kv_proj_weight=np.zeros((128, 64), np.float16)),
     "kv_proj_weight dtype got float16, expected bfloat16 as in layer 0."),
    (dict(k_norm_weight=np.ones(16, np.float32)),
     "k_norm_weight shape got (16,), expected (32,) as in layer 0."),
    (dict(eps=float("nan")), "eps got nan, expected a finite float >= 0."),
    (dict(eps=-1e-6), "eps got -1e-06, expected a finite float >= 0."),
])
def test_a_layer_that_differs_from_layer_0_is_named(change, message):
    _expect(f"Invalid fused KV materializer layer 2: {message}", _layers(**change))


def test_layer_0_is_checked_against_its_own_configuration():
    layers = _layers()
    layers[0] = dataclasses.replace(layers[0], kv_proj_weight=np.zeros((128, 64, 1), np.float32))
    _expect("Invalid fused KV materializer layer 0: kv_proj_weight shape got (128, 64, 1), "
            "expected (128, hidden) = (2*num_kv_heads*head_dim, hidden).", layers)


def test_the_first_differing_layer_is_named():
    layers = _layers(n_layers=4)
    for index in (1, 3):
        layers[index] = dataclasses.replace(layers[index], num_kv_heads=1)
    _expect("Invalid fused KV materializer layer 1: num_kv_heads got 1, expected 2 as in layer 0.",
            layers)


def test_no_layers_is_an_error():
    _expect("Invalid layers for fused KV materialization: got 0, expected at least 1.", [])


def test_a_layer_that_is_not_a_layer_kv_is_refused_before_any_of_its_fields_is_read():
    layers = _layers()
    layers[2] = dataclasses.asdict(layers[2])
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid layers[2] for fused KV materialization: got dict, expected an "
            "interop.core.materializer.LayerKV.") + "$"):
        validate_layers(layers)


def test_layer_weights_that_are_not_arrays_are_refused_naming_the_layer_and_field():
    layers = _layers(k_norm_weight=[1.0] * 32)
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid layers[2].k_norm_weight for fused KV materialization: got list, expected an "
            "array with __dlpack__ (NumPy, torch, jax, CuPy).") + "$"):
        validate_layers(layers)


def test_a_reserved_token_bound_is_taken_as_an_int_from_zero():
    assert validate_reserve(0) == 0
    bound = validate_reserve(np.int64(4096))
    assert bound == 4096 and type(bound) is int


def test_the_ops_own_checks_run_on_the_stacked_configuration():
    rope = RopeConfig(rotary_dim=48, max_position=64)
    layers = [dataclasses.replace(layer, rope=rope) for layer in _layers()]
    _expect("Invalid fused KV rotary/head dim pair: rotary_dim=48, head_dim=32.", layers)
    float64_weights = [dataclasses.replace(layer, kv_proj_weight=np.zeros((128, 64)))
                       for layer in _layers()]
    _expect("Invalid kv dtype for fused KV materialization: got float64, expected one of "
            "('bfloat16', 'float16', 'float32').", float64_weights)


def test_a_given_cos_sin_cache_must_be_of_a_table_dtype_and_cover_the_rope_positions():
    _expect("Invalid cos_sin_cache dtype for fused KV materialization: got float64, expected one "
            "of ('float32', 'bfloat16', 'float16').", _layers(), np.zeros((64, 32), np.float64))
    _expect("Invalid cos_sin_cache shape for fused KV materialization: got (64, 16), expected "
            "(max_pos, 32) with max_pos > 0.", _layers(), np.zeros((64, 16), np.float32))
    _expect("Invalid cos_sin_cache for fused KV materialization: got 32 rows, expected "
            "rope.max_position=64.", _layers(), np.zeros((32, 32), np.float32))


def test_materialize_checks_hidden_states_and_the_position_bound_on_the_host():
    config = validate_layers(_layers())
    assert validate_materialize(np.zeros((5, 64), np.float32), config, 64) == 5
    with pytest.raises(ValueError, match=re.escape(
            "Invalid ctx_hidden shape for fused KV materialization: got (5, 48), expected "
            "(total_ctx, 64).")):
        validate_materialize(np.zeros((5, 48), np.float32), config, None)
    with pytest.raises(ValueError, match=re.escape(
            "Invalid max_position for fused KV materialization: got 65, expected at most 64, "
            "the rows of cos_sin_cache.")):
        validate_materialize(np.zeros((5, 64), np.float32), config, 65)


@pytest.mark.parametrize("make, error, message", [
    (lambda layer: dataclasses.replace(layer, head_dim=16.0), TypeError,
     "Invalid head_dim for fused KV materialization: got 16.0 (float), expected a positive int."),
    (lambda layer: dataclasses.replace(layer, num_kv_heads=0), ValueError,
     "Invalid num_kv_heads for fused KV materialization: got 0, expected a positive int."),
    (lambda layer: RopeConfig(rotary_dim=32.0, max_position=64), TypeError,
     "Invalid rotary_dim for fused KV materialization: got 32.0 (float), expected an even int in "
     "[2, head_dim]."),
    (lambda layer: RopeConfig(rotary_dim=32, max_position=0), ValueError,
     "Invalid max_position for fused KV materialization: got 0, expected a positive int."),
    (lambda layer: RopeConfig(rotary_dim=32, max_position="64"), TypeError,
     "Invalid max_position for fused KV materialization: got '64' (str), expected a positive int."),
], ids=["head_dim-float", "heads-0", "rotary-float", "max_position-0", "max_position-str"])
def test_layer_and_rope_sizes_that_are_not_positive_ints_are_refused_at_construction(make, error, message):
    layer = _layers(n_layers=1)[0]
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        make(layer)


def test_numpy_integer_sizes_are_taken_as_ints():
    layers = [dataclasses.replace(layer, num_kv_heads=np.int64(2), head_dim=np.int32(32),
                                  rope=RopeConfig(np.int64(32), np.int64(64))) for layer in _layers()]
    assert validate_layers(layers).op == OP
    assert type(layers[0].head_dim) is int and type(layers[0].rope.max_position) is int


def test_materialize_checks_the_types_of_hidden_states_and_of_the_position_bound():
    config = validate_layers(_layers())
    with pytest.raises(TypeError, match=re.escape(
            "Invalid max_position for fused KV materialization: got 3.5 (float), expected an int in "
            "[0, 64].")):
        validate_materialize(np.zeros((5, 64), np.float32), config, 3.5)
    with pytest.raises(TypeError, match=re.escape(
            "Invalid ctx_hidden for fused KV materialization: got list, expected an array with "
            "__dlpack__ (NumPy, torch, jax, CuPy).")):
        validate_materialize([[0.0] * 64], config, None)


def test_layers_of_another_rope_base_get_a_table_of_their_own_and_an_index():
    sliding = RopeConfig(32, 64, base=500000.0)
    layers = _layers(n_layers=4, rope=sliding)
    layers[3] = dataclasses.replace(layers[3], rope=sliding)
    config = validate_layers(layers)
    assert (config.op, config.max_position) == (OP, 64)
    tables, layer_rope_table = stacked_rope_tables(layers)
    assert layer_rope_table.dtype == np.int32 and layer_rope_table.tolist() == [0, 0, 1, 1]
    assert_bit_exact(tables[0], layers[0].rope.cos_sin_cache(), name="table 0")
    assert_bit_exact(tables[1], sliding.cos_sin_cache(), name="table 1")
    assert stacked_rope_tables(_layers())[1] is None


def test_a_given_3d_table_takes_the_layers_table_indices():
    tables = np.zeros((2, 64, 32), np.float32)
    config = validate_layers(_layers(), tables, layer_rope_table=np.array([0, 1, 1], np.int32))
    assert config.max_position == 64
    _expect("Invalid layer_rope_table for fused KV materialization: got None with a 3-D cos_sin_cache of 2 "
            "tables, expected int32(3,) naming each layer's table.", _layers(), tables)
