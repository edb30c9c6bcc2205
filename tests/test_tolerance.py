"""The comparison helper fails on a planted error and says where."""

import numpy as np
import pytest

from interop.arrays import numpy_dtype
from interop.tolerance import TOLERANCES, assert_bit_exact, assert_close, compare, ulp


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


@pytest.mark.parametrize("dtype, largest, step_below", [("float8_e4m3fn", 448.0, 32.0),
                                                        ("bfloat16", 2.0 ** 127 * 255 / 128, 2.0 ** 120)])
def test_largest_finite_value_has_the_step_below_as_ulp(dtype, largest, step_below):
    # The step above it is NaN (fp8) or Inf (bf16); without this an error there could not fail.
    expected = np.array([largest], numpy_dtype(dtype))
    assert ulp(expected, dtype).tolist() == [step_below]
    assert not compare(np.array([largest - 2 * step_below], numpy_dtype(dtype)), expected).ok
