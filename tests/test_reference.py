"""The NumPy reference against an independent float64 computation written here."""

import zlib

import numpy as np
import pytest

from interop.core.arrays import numpy_dtype
from interop.core.reference import (
    fused_kv_norm_rope_into_cache_reference,
    fused_kv_norm_rope_reference,
    rope_cos_sin_cache,
)
from interop.core.spec import FusedKVConfig
from interop.testing import Tolerance, assert_bit_exact, assert_close, random_inputs


def float64_truth(kv, weight, eps, cache, positions, heads, dim, rotary_dim, style):
    """Per token, layer and head, with RoPE as a complex rotation; no shared code."""
    total_ctx, n_layers, _ = kv.shape
    half = rotary_dim // 2
    k_out = np.empty((n_layers, total_ctx, heads, dim))
    for t in range(total_ctx):
        for layer in range(n_layers):
            for h in range(heads):
                x = kv[t, layer, h * dim:(h + 1) * dim].astype(np.float64)
                x = x / np.sqrt(np.sum(x ** 2) / dim + float(eps[layer])) * weight[layer].astype(np.float64)
                if not 0 <= positions[t] < cache.shape[0]:
                    k_out[layer, t, h] = np.nan
                    continue
                angle = cache[positions[t], :half].astype(np.float64) + 1j * cache[positions[t], half:rotary_dim]
                pairs = (x[:half], x[half:rotary_dim]) if style == "neox" else (x[0:rotary_dim:2], x[1:rotary_dim:2])
                z = (pairs[0] + 1j * pairs[1]) * angle
                y = x.copy()
                if style == "neox":
                    y[:half], y[half:rotary_dim] = z.real, z.imag
                else:
                    y[0:rotary_dim:2], y[1:rotary_dim:2] = z.real, z.imag
                k_out[layer, t, h] = y
    return k_out


CASES = [
    # (heads, head_dim, rotary_dim, style, layers, tokens)
    (2, 128, 128, "neox", 3, 5),
    (2, 128, 128, "gptj", 3, 5),
    (2, 128, 64, "neox", 2, 4),
    (2, 128, 64, "gptj", 2, 4),
    (1, 192, 64, "neox", 2, 3),
    (3, 96, 96, "neox", 2, 3),
    (3, 96, 32, "gptj", 2, 3),
    (2, 64, 64, "neox", 1, 1),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads, dim, rotary_dim, style, layers, tokens", CASES)
def test_reference_matches_float64_truth(dtype, heads, dim, rotary_dim, style, layers, tokens):
    config = FusedKVConfig(heads, dim, rotary_dim, style)
    inputs = random_inputs(config, n_layers=layers, total_ctx=tokens, dtype=dtype,
                           max_position=4096, seed=zlib.crc32(f"{dtype}{dim}{rotary_dim}{style}".encode()))
    k, v = fused_kv_norm_rope_reference(*inputs.arrays(), num_kv_heads=heads, head_dim=dim,
                                        rotary_dim=rotary_dim, rope_style=style)
    truth = float64_truth(*inputs.arrays(), heads, dim, rotary_dim, style)
    assert k.dtype == numpy_dtype(dtype) and k.shape == (layers, tokens, heads, dim)
    assert_close(k, truth.astype(numpy_dtype(dtype)), name="k")
    expected_v = inputs.kv[:, :, heads * dim:].reshape(tokens, layers, heads, dim).transpose(1, 0, 2, 3)
    assert_bit_exact(v, expected_v, name="v")


def test_positions_outside_the_cache_give_nan_k_and_still_copy_v():
    config = FusedKVConfig(2, 16, 16)
    inputs = random_inputs(config, n_layers=2, total_ctx=4, max_position=8, seed=3)
    positions = np.array([0, 8, -1, 7], np.int64)
    k, v = fused_kv_norm_rope_reference(inputs.kv, inputs.k_norm_weight, inputs.eps,
                                        inputs.cos_sin_cache, positions,
                                        num_kv_heads=2, head_dim=16, rotary_dim=16)
    assert np.isnan(k[:, [1, 2]].astype(np.float32)).all()
    assert not np.isnan(k[:, [0, 3]].astype(np.float32)).any()
    assert_bit_exact(v, inputs.kv[:, :, 32:].reshape(4, 2, 2, 16).transpose(1, 0, 2, 3))


def test_empty_context_gives_empty_outputs():
    config = FusedKVConfig(4, 32, 32)
    inputs = random_inputs(config, n_layers=3, total_ctx=0, seed=0)
    k, v = fused_kv_norm_rope_reference(*inputs.arrays(), num_kv_heads=4, head_dim=32, rotary_dim=32)
    assert k.shape == v.shape == (3, 0, 4, 32)
    assert k.dtype == v.dtype == inputs.kv.dtype


def test_position_zero_is_plain_rmsnorm():
    # cos(0) = 1 and sin(0) = 0: a cheap independent check of the norm alone.
    config = FusedKVConfig(1, 8, 8)
    inputs = random_inputs(config, n_layers=1, total_ctx=1, dtype="float32", seed=5)
    k, _ = fused_kv_norm_rope_reference(inputs.kv, inputs.k_norm_weight, inputs.eps,
                                        rope_cos_sin_cache(4, 8), np.zeros(1, np.int32),
                                        num_kv_heads=1, head_dim=8, rotary_dim=8)
    x = inputs.kv[0, 0, :8].astype(np.float64)
    expected = x / np.sqrt(np.mean(x * x) + inputs.eps[0]) * inputs.k_norm_weight[0]
    np.testing.assert_allclose(k[0, 0, 0], expected, rtol=1e-6)


@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_cache_reference_writes_each_token_to_its_slot_and_skips_padding(cache_dtype):
    config = FusedKVConfig(2, 32, 32)
    inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, seed=11)
    cache_loc = np.array([5, -1, 0, 7], np.int64)
    poison = np.full((3, 8, 2, 32), -3.0, np.float32).astype(numpy_dtype(cache_dtype))
    scales = {}
    if cache_dtype == "float8_e4m3fn":
        scales = dict(k_scale=np.array([0.5, 1.0, 0.01], np.float32),
                      v_scale=np.array([2.0, 0.25, 1.0], np.float32))
    k_cache, v_cache = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), cache_loc, poison, poison.copy(),
        num_kv_heads=2, head_dim=32, rotary_dim=32, **scales)
    k, v = fused_kv_norm_rope_reference(*inputs.arrays(), num_kv_heads=2, head_dim=32, rotary_dim=32)
    truth = float64_truth(*inputs.arrays(), 2, 32, 32, "neox")
    for token, slot in ((0, 5), (2, 0), (3, 7)):
        if cache_dtype == "bfloat16":
            assert_bit_exact(k_cache[:, slot], k[:, token])
            assert_bit_exact(v_cache[:, slot], v[:, token])
        else:
            for cache, values, scale in ((k_cache, truth, scales["k_scale"]),
                                         (v_cache, v.astype(np.float64), scales["v_scale"])):
                expected = np.clip(values[:, token] / scale[:, None, None], -448, 448)
                assert_close(cache[:, slot].astype(np.float32),
                             expected.astype(numpy_dtype("float8_e4m3fn")).astype(np.float32),
                             tolerance=Tolerance(ulps=0, atol=0.0625 * np.abs(expected).max(), reason="fp8"))
    untouched = [1, 2, 3, 4, 6]
    assert_bit_exact(k_cache[:, untouched], poison[:, untouched])
    assert_bit_exact(v_cache[:, untouched], poison[:, untouched])


# Edge values (the reference's docstring and README, "Edge values").

# NaN with a payload, negative NaN, signaling NaN, +Inf, -Inf: bit patterns per kv dtype.
SPECIAL_BITS = {
    "float32": (np.uint32, [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000]),
    "bfloat16": (np.uint16, [0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80]),
    "float16": (np.uint16, [0x7E01, 0xFE00, 0x7C01, 0x7C00, 0xFC00]),
}
STATIC = dict(num_kv_heads=2, head_dim=16, rotary_dim=8)


def edge_inputs(dtype, style="neox", total_ctx=4):
    config = FusedKVConfig(2, 16, 8, style)
    return random_inputs(config, n_layers=1, total_ctx=total_ctx, dtype=dtype, max_position=64, seed=50)


def reference(inputs, style="neox"):
    return fused_kv_norm_rope_reference(*inputs.arrays(), **STATIC, rope_style=style)


def truth(inputs, style="neox", dtype=np.float32):
    """The float64 truth rounded to ``dtype``; its edge heads are whatever float64 makes of them."""
    with np.errstate(all="ignore"):
        return float64_truth(*inputs.arrays(), 2, 16, 8, style).astype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_nan_and_inf_in_v_pass_through_bit_for_bit(dtype):
    inputs = edge_inputs(dtype, total_ctx=2)
    width, bits = SPECIAL_BITS[dtype]
    specials = np.array(bits, width).view(numpy_dtype(dtype))
    inputs.kv[0, 0, 32:37] = specials
    k, v = reference(inputs)
    assert_bit_exact(v[0, 0, 0, :5], specials)
    assert_bit_exact(v, inputs.kv[:, :, 32:].reshape(2, 1, 2, 16).transpose(1, 0, 2, 3))
    assert not np.isnan(k.astype(np.float32)).any()


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_nan_inf_or_overflowing_squares_in_a_k_head_give_that_head_all_nan(style):
    inputs = edge_inputs("float32", style, total_ctx=5)
    inputs.kv[0, 0, 3] = np.nan
    inputs.kv[1, 0, 16 + 12] = np.inf  # head 1, in the unrotated tail
    inputs.kv[2, 0, 5] = -np.inf
    inputs.kv[3, 0, 16 + 7] = 1e20  # finite, but its square overflows fp32
    k, _ = reference(inputs, style)
    poisoned_heads = {(0, 0), (1, 1), (2, 0), (3, 1)}
    clean = truth(inputs, style)
    for token in range(5):
        for head in range(2):
            if (token, head) in poisoned_heads:
                assert np.isnan(k[0, token, head].astype(np.float32)).all()
            else:
                assert_close(k[0, token, head], clean[0, token, head])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eps_zero_with_zero_or_denormal_k_gives_zeros(dtype):
    inputs = edge_inputs(dtype)
    inputs.eps[:] = 0.0
    inputs.kv[0, 0, :16] = 0.0
    inputs.kv[2, 0, 16:32] = 2.0 ** -130 * np.sign(np.arange(16) - 7.5)  # denormal; squares underflow
    k, _ = reference(inputs)
    k32 = k.astype(np.float32)
    assert (k32[0, 0, 0] == 0).all() and (k32[0, 2, 1] == 0).all()
    assert_close(k[0, [1, 3]], truth(inputs, dtype=k.dtype)[0, [1, 3]])


def test_fp16_output_beyond_its_range_is_inf():
    inputs = edge_inputs("float16")
    inputs.k_norm_weight[:] = 1e6
    k, _ = reference(inputs)
    assert np.isinf(k.astype(np.float32)).any()
    assert_close(k, truth(inputs, dtype=np.float16))


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_huge_weights_in_the_unrotated_tail_give_inf_not_nan(style):
    inputs = edge_inputs("float32", style)
    inputs.k_norm_weight[:, 8:] = 3e38
    k, _ = reference(inputs, style)
    assert np.isinf(k[..., 8:]).any() and not np.isnan(k).any()
    assert_close(k, truth(inputs, style))


def test_fp8_cache_saturates_inf_and_big_values_and_keeps_nan():
    inputs = edge_inputs("bfloat16", total_ctx=2)
    inputs.kv[0, 0, 32:37] = [np.inf, -np.inf, 1e4, -1e4, np.nan]
    inputs.kv[1, 0, 3] = np.inf  # K head 0 of token 1: all NaN
    fp8 = numpy_dtype("float8_e4m3fn")
    poison = np.zeros((1, 3, 2, 16), fp8)
    scale = np.array([0.03], np.float32)
    k_cache, v_cache = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), np.array([2, 0]), poison, poison, **STATIC, k_scale=scale, v_scale=scale)
    v = v_cache[0, 2, 0, :5].astype(np.float32)
    assert v[:4].tolist() == [448, -448, 448, -448] and np.isnan(v[4])
    k = k_cache.astype(np.float32)
    assert np.isnan(k[0, 0, 0]).all() and not np.isnan(k[0, 0, 1]).any() and not np.isnan(k[0, 2]).any()


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_per_layer_tables_rotate_each_layer_by_its_own_table(style):
    config = FusedKVConfig(2, 16, 8, style)
    inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=32, seed=7)
    tables = np.stack([rope_cos_sin_cache(32, 8, base) for base in (10000.0, 500.0)]).astype(numpy_dtype("bfloat16"))
    layer_rope_table = np.array([1, 0, 1], np.int32)
    static = dict(num_kv_heads=2, head_dim=16, rotary_dim=8, rope_style=style)
    k, v = fused_kv_norm_rope_reference(*inputs.arrays()[:3], tables, inputs.positions, **static,
                                        layer_rope_table=layer_rope_table)
    for layer, table in enumerate(layer_rope_table):
        one_layer = (inputs.kv[:, layer:layer + 1], inputs.k_norm_weight[layer:layer + 1], inputs.eps[layer:layer + 1])
        k_layer, v_layer = fused_kv_norm_rope_reference(*one_layer, tables[table], inputs.positions, **static)
        assert_bit_exact(k[layer:layer + 1], k_layer, name="k")
        assert_bit_exact(v[layer:layer + 1], v_layer)


def test_a_table_index_outside_the_tables_gives_that_layer_all_nan_k():
    config = FusedKVConfig(2, 16, 16)
    inputs = random_inputs(config, n_layers=4, total_ctx=3, max_position=32, seed=8)
    tables = np.stack([inputs.cos_sin_cache, inputs.cos_sin_cache])
    k, v = fused_kv_norm_rope_reference(*inputs.arrays()[:3], tables, inputs.positions, num_kv_heads=2,
                                        head_dim=16, rotary_dim=16, layer_rope_table=np.array([0, 2, -1, 1], np.int32))
    k_plain, v_plain = fused_kv_norm_rope_reference(*inputs.arrays(), num_kv_heads=2, head_dim=16, rotary_dim=16)
    assert np.isnan(k[1:3].astype(np.float32)).all()
    assert_bit_exact(k[[0, 3]], k_plain[[0, 3]], name="k")
    assert_bit_exact(v, v_plain)
