"""The comparison helper fails on a planted error and says where."""

import numpy as np
import pytest

from interop.core.arrays import numpy_dtype
from interop.core.reference import fused_kv_norm_rope_into_cache_reference
from interop.core.spec import FusedKVConfig
from interop.testing import (
    TOLERANCES,
    assert_bit_exact,
    assert_close,
    assert_fp8_close,
    code_steps,
    compare,
    random_inputs,
    ulp,
)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_planted_error_is_reported_with_its_index(dtype):
    rng = np.random.default_rng(0)
    expected = rng.standard_normal((3, 4, 5)).astype(numpy_dtype(dtype))
    got = expected.copy()
    got[2, 1, 3] = got[2, 1, 3].astype(np.float32) + 0.5
    with pytest.raises(AssertionError, match=r"k: 1 of 60 elements outside tolerance .*worst at index \(2, 1, 3\)"):
        assert_close(got, expected, name="k")


def test_one_ulp_passes_and_two_fail_in_bfloat16():
    expected = np.array([1.0, 3.0, -2.0], numpy_dtype("bfloat16"))
    step = ulp(expected.astype(np.float64), "bfloat16")
    assert step.tolist() == [2 ** -7, 2 ** -6, 2 ** -6]
    one_off = (expected.astype(np.float64) + step).astype(numpy_dtype("bfloat16"))
    assert compare(one_off, expected).ok
    two_off = (expected.astype(np.float64) + 2 * step).astype(numpy_dtype("bfloat16"))
    result = compare(two_off, expected)
    assert not result.ok and result.n_bad == 3 and result.max_ulps == pytest.approx(2.0)


def test_nan_must_meet_nan():
    expected = np.array([np.nan, 1.0], np.float32)
    assert compare(np.array([np.nan, 1.0], np.float32), expected).ok
    assert not compare(np.array([0.0, 1.0], np.float32), expected).ok
    assert not compare(np.array([np.nan, np.nan], np.float32), expected).ok


def test_bit_exact_names_the_first_difference():
    expected = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = expected.copy()
    got[1, 2] = np.nextafter(got[1, 2], np.float32(100))
    with pytest.raises(AssertionError, match=r"v: 1 of 12 elements differ bitwise; first at index \(1, 2\)"):
        assert_bit_exact(got, expected)
    assert_bit_exact(expected.copy(), expected)


def test_every_tolerance_states_its_reason():
    assert set(TOLERANCES) == {"float32", "float16", "bfloat16", "float8_e4m3fn"}
    assert all(len(t.reason) > 40 for t in TOLERANCES.values())


@pytest.mark.parametrize("dtype, exponent_bits, mantissa_bits, largest", [
    ("float32", 8, 23, float(np.finfo(np.float32).max)),
    ("float16", 5, 10, 65504.0),
    ("bfloat16", 8, 7, 2.0 ** 127 * 255 / 128),
    ("float8_e4m3fn", 4, 3, 448.0),
])
def test_ulp_is_the_format_spacing_at_zero_subnormals_normals_and_the_largest_value(
        dtype, exponent_bits, mantissa_bits, largest):
    bias = 2 ** (exponent_bits - 1) - 1
    smallest_subnormal = 2.0 ** (1 - bias - mantissa_bits)
    smallest_normal = 2.0 ** (1 - bias)
    values = [0.0, smallest_subnormal, 3 * smallest_subnormal, smallest_normal, 1.0, -1.5, largest,
              float("nan"), float("inf")]
    top_exponent = int(np.floor(np.log2(largest)))
    expected = [smallest_subnormal] * 4 + [2.0 ** -mantissa_bits] * 2 + [2.0 ** (top_exponent - mantissa_bits)] \
        + [smallest_subnormal] * 2  # NaN and Inf count as 0
    assert ulp(np.array(values), dtype).tolist() == expected


@pytest.mark.parametrize("dtype, largest, step_below", [("float8_e4m3fn", 448.0, 32.0),
                                                        ("bfloat16", 2.0 ** 127 * 255 / 128, 2.0 ** 120)])
def test_largest_finite_value_has_the_step_below_as_ulp(dtype, largest, step_below):
    # The step above it is NaN (fp8) or Inf (bf16); without this an error there could not fail.
    expected = np.array([largest], numpy_dtype(dtype))
    assert ulp(expected, dtype).tolist() == [step_below]
    assert not compare(np.array([largest - 2 * step_below], numpy_dtype(dtype)), expected).ok


# float8_e4m3fn: codes must match, but for a few one step off.

FP8 = numpy_dtype("float8_e4m3fn")


def fp8_codes(count, seed=0):
    """``count`` fp8 values spread over the range a cache holds: every binade, both signs."""
    rng = np.random.default_rng(seed)
    return (rng.choice([-1.0, 1.0], count) * 2.0 ** rng.uniform(-8, 8.7, count)).astype(np.float32).astype(FP8)


def one_step_away_from_zero(values):
    return (values.view(np.uint8) + np.uint8(1)).view(FP8)


def test_codes_are_counted_not_measured():
    # 8 is one code above 7.5 and two above 7: "one ulp of 8" would admit both.
    expected = np.array([8.0, 8.0, -0.0, 448.0], np.float32).astype(FP8)
    assert code_steps(np.array([7.5, 7.0, 0.0, -448.0], np.float32).astype(FP8), expected).tolist() == [1, 2, 0, 252]
    assert code_steps(np.array([np.nan, np.nan], np.float32).astype(FP8),
                      np.array([np.nan, 448.0], np.float32).astype(FP8)).tolist() == [0, np.inf]


@pytest.mark.parametrize("count", [7, 10_000, 50_000])
def test_fp8_allows_one_in_ten_thousand_codes_one_step_off_and_at_least_one(count):
    expected = fp8_codes(count)
    allowed = max(1, count // 10_000)
    got = expected.copy()
    got[:allowed] = one_step_away_from_zero(expected[:allowed])
    result = assert_close(got, expected)
    assert (result.n_off, result.off_allowed) == (allowed, allowed)
    got[allowed] = one_step_away_from_zero(expected[allowed])
    message = (rf"k: {allowed + 1} of {count} elements outside tolerance \(float8_e4m3fn: exact but at most "
               rf"{allowed} off by up to 1, {allowed + 1} were\)")
    with pytest.raises(AssertionError, match=message):
        assert_close(got, expected)


def test_fp8_code_two_steps_off_fails_alone():
    expected = fp8_codes(50_000)
    got = expected.copy()
    got[123] = one_step_away_from_zero(one_step_away_from_zero(expected[123]))
    result = compare(got, expected)
    assert not result.ok and result.n_bad == 1 and result.worst_index == (123,) and result.max_ulps == 2


def quantized_reference(scale_error):
    """The fp32 reference's fp8 cache for realistic inputs (every slot written), with
    its scales off by the relative ``scale_error``, and the true scales."""
    config = FusedKVConfig(4, 128, 64, "neox")
    inputs = random_inputs(config, n_layers=3, total_ctx=40, max_position=4096, seed=7)
    scales = np.random.default_rng(7).uniform(0.01, 0.05, (2, 3)).astype(np.float32)
    poison = np.zeros((3, 40, 4, 128), FP8)
    k_cache, v_cache = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), np.arange(40), poison, poison, num_kv_heads=4, head_dim=128, rotary_dim=64,
        k_scale=scales[0] * np.float32(1 + scale_error), v_scale=scales[1] * np.float32(1 + scale_error))
    return inputs, scales, k_cache, v_cache


def test_fp8_cache_quantized_with_a_scale_five_percent_off_fails():
    _, _, k_honest, v_honest = quantized_reference(0.0)
    _, _, k_off, v_off = quantized_reference(0.05)
    for got, expected in ((k_off, k_honest), (v_off, v_honest)):
        result = compare(got, expected)
        assert not result.ok and result.n_bad > expected.size // 4, result.report()


def test_fp8_cache_from_float64_math_passes_against_the_fp32_reference():
    # The same quotients computed in float64 and rounded once: only reordered-precision
    # differences, the kind the kernels have, so the codes must pass.
    inputs, scales, k_cache, v_cache = quantized_reference(0.0)
    k = float64_k(inputs.kv, inputs.k_norm_weight, inputs.eps, inputs.cos_sin_cache, inputs.positions,
                  heads=4, dim=128, rotary_dim=64)
    v = inputs.kv[:, :, 512:].astype(np.float64).reshape(40, 3, 4, 128).transpose(1, 0, 2, 3)
    for got_fp64, expected, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        got = np.clip(got_fp64 / scale.astype(np.float64)[:, None, None, None], -448, 448).astype(FP8)
        result = assert_close(got, expected)
        assert result.n_elements == 61_440 and result.max_ulps <= 1


def float64_k(kv, weight, eps, cache, positions, *, heads, dim, rotary_dim):
    """neox K in float64, vectorized; independent of interop.core.reference."""
    total_ctx, n_layers, _ = kv.shape
    half = rotary_dim // 2
    k = kv[:, :, :heads * dim].astype(np.float64).reshape(total_ctx, n_layers, heads, dim)
    k = k / np.sqrt(np.mean(k * k, axis=-1, keepdims=True) + eps.astype(np.float64)[None, :, None, None])
    k = k * weight.astype(np.float64)[None, :, None, :]
    cos = cache[positions, :half].astype(np.float64)[:, None, None, :]
    sin = cache[positions, half:rotary_dim].astype(np.float64)[:, None, None, :]
    out = k.copy()
    out[..., :half] = k[..., :half] * cos - k[..., half:rotary_dim] * sin
    out[..., half:rotary_dim] = k[..., half:rotary_dim] * cos + k[..., :half] * sin
    return out.transpose(1, 0, 2, 3)


def test_fp8_interpreter_flag_forgives_only_its_dropped_carry_and_subnormal_truncation():
    expected = np.array([-8.0, 0.5, 2.0 ** -7 * 1.5, -2.0 ** -8, 3.0, 1.0], np.float32).astype(FP8)
    interpreted = np.array([-4.0, 0.25, 2.0 ** -7 * 1.25, -2.0 ** -9, 3.0, 1.0], np.float32).astype(FP8)
    assert compare(interpreted, expected, triton_interpreter=True).ok
    with pytest.raises(AssertionError, match="4 of 6 elements outside tolerance"):
        assert_fp8_close(interpreted, expected, triton_interpreter=False)
    # Half of a value that is not a power of two is an error, interpreter or not; one code
    # away from zero below 2**-6, or toward zero above it, counts against the one allowed.
    for got, want, n_bad, n_off in ((1.5, 3.0, 1, 0), (2.0 ** -7 * 1.75, 2.0 ** -7 * 1.5, 0, 1),
                                    (2.75, 3.0, 0, 1)):
        result = compare(np.array([got], np.float32).astype(FP8), np.array([want], np.float32).astype(FP8),
                         triton_interpreter=True)
        assert (result.n_bad, result.n_off) == (n_bad, n_off)
