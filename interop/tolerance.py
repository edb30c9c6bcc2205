"""The one tolerance table and the one comparison that reports the worst element.

An element passes when ``|got - expected| <= ulps * ulp(expected) + atol`` with the
ulp taken in the output dtype. NaN must meet NaN (out-of-range positions), and a
NaN anywhere else fails. V is never compared here: it must match bit for bit
(:func:`assert_bit_exact`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.arrays import as_numpy, numpy_dtype
from interop.spec import dtype_name


@dataclasses.dataclass(frozen=True)
class Tolerance:
    ulps: float
    atol: float
    reason: str


# The kernels do the reference's fp32 math in another order (tree reductions, fused
# multiply-adds, the hardware rsqrt), which moves the fp32 value of a K element by a
# few fp32 ulps of its operands, whose magnitude is about that of the normalized K
# (|kn| < 10 for any sane weights). ``atol`` covers that movement where RoPE cancels
# two such operands into a tiny result whose own ulp is far smaller than the error.
TOLERANCES = {
    "float32": Tolerance(
        ulps=16, atol=2e-6,
        reason="no final rounding hides the reordered fp32 math: rsqrt.approx is within "
        "2 ulp, the mean over head_dim and the rotation add a few more",
    ),
    "float16": Tolerance(
        ulps=1, atol=2e-6,
        reason="fp32 values a few fp32 ulps apart round to neighbouring fp16 values when "
        "they straddle a rounding boundary",
    ),
    "bfloat16": Tolerance(
        ulps=1, atol=2e-6,
        reason="as fp16; also Triton's interpreter rounds fp32->bf16 by truncation, at "
        "most 1 ulp from round-to-nearest",
    ),
    "float8_e4m3fn": Tolerance(
        ulps=1, atol=2e-6,
        reason="a cache entry value/scale rounded once from fp32: reordered fp32 math (and "
        "the GPU's approximate fp32 division) can put the fp32 value across a rounding boundary",
    ),
}


# The framework rounds the GEMM's kv to the weights' dtype before the op; the reference
# keeps it fp32. For bfloat16 that moves each kv element by up to half an ulp, 2**-8 of
# itself, which the RMSNorm carries into normalized K unchanged in relative terms (its
# mean over head_dim averages the rounding out). RoPE combines two such elements, each
# |kn| < 8 for weights near 1, so a result that cancels to near zero is off by up to
# 2 * 8 * 2**-8 = 2**-4 absolute, while one that does not stays within 2 ulp. Measured
# at real sizes (2.6M elements): at most 0.028.
END_TO_END_TOLERANCE = Tolerance(
    ulps=2, atol=2.0 ** -4,
    reason="the GEMM's kv is rounded to bfloat16 before the op in the framework, not in the "
    "fp32 reference; RoPE adds two such errors of up to |kn| * 2**-8 each",
)


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` above each |value| (as fp64); NaN and Inf count as 0."""
    finite = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    typed = np.abs(finite).astype(numpy_dtype(dtype))
    # ml_dtypes has no nextafter: step the bit pattern of the non-negative value by one.
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[typed.dtype.itemsize]
    above = (typed.view(width) + width(1)).view(typed.dtype).astype(np.float64)
    below = (typed.view(width) - width(1)).view(typed.dtype).astype(np.float64)
    step = above - typed.astype(np.float64)
    # Above the largest finite value lies Inf (NaN for float8_e4m3fn): use the step below.
    return np.where(np.isfinite(step), step, typed.astype(np.float64) - below)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How far ``got`` is from ``expected``; ``worst_*`` describe the worst element."""

    name: str
    dtype: str
    tolerance: Tolerance
    n_elements: int
    n_bad: int
    max_ulps: float
    worst_index: tuple[int, ...] | None
    worst_got: float
    worst_expected: float

    @property
    def ok(self) -> bool:
        return self.n_bad == 0

    def report(self) -> str:
        head = (f"{self.name}: {self.n_bad} of {self.n_elements} elements outside tolerance "
                f"({self.dtype}: {self.tolerance.ulps:g} ulp + {self.tolerance.atol:g}); "
                f"max error {self.max_ulps:.3g} ulp")
        if self.worst_index is None:
            return head
        return (f"{head}; worst at index {self.worst_index}: got {self.worst_got!r}, "
                f"expected {self.worst_expected!r}")


def compare(got, expected, *, name: str = "k", tolerance: Tolerance | None = None) -> Comparison:
    """Compare element-wise under the table's tolerance for ``expected``'s dtype."""
    got, expected = as_numpy(got), as_numpy(expected)
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from expected {expected.shape}")
    dtype = dtype_name(expected.dtype)
    tolerance = tolerance or TOLERANCES[dtype]
    got64, expected64 = got.astype(np.float64), expected.astype(np.float64)
    step = ulp(expected64, dtype)
    error = np.abs(got64 - expected64)
    agree = (np.isnan(got64) & np.isnan(expected64)) | (got64 == expected64)
    error = np.where(agree, 0.0, np.where(np.isnan(error), np.inf, error))
    bad = error > tolerance.ulps * step + tolerance.atol
    # Near zero the dtype's own ulp is far below atol; counting in it would report
    # billions of "ulps" for an error the tolerance accepts, so atol floors the unit.
    error_ulps = error / np.maximum(step, tolerance.atol)
    n_bad = int(bad.sum())
    worst_index = None
    worst_got = worst_expected = float("nan")
    if error.size:
        # The worst failing element when any fails, else the largest error in ulps.
        flat = int(np.argmax(np.where(bad, error_ulps, -1.0) if n_bad else error_ulps))
        worst_index = tuple(int(i) for i in np.unravel_index(flat, error.shape))
        worst_got, worst_expected = float(got64[worst_index]), float(expected64[worst_index])
    max_ulps = float(error_ulps.max()) if error.size else 0.0
    return Comparison(name, dtype, tolerance, int(error.size), n_bad, max_ulps,
                      worst_index, worst_got, worst_expected)


def assert_close(got, expected, *, name: str = "k", tolerance: Tolerance | None = None) -> Comparison:
    """Raise ``AssertionError`` naming the worst element unless every element is in tolerance."""
    result = compare(got, expected, name=name, tolerance=tolerance)
    if not result.ok:
        raise AssertionError(result.report())
    return result


def assert_fp8_close(got, expected, *, triton_interpreter: bool, name: str = "k") -> Comparison:
    """:func:`assert_close` for a float8_e4m3fn cache written by a Triton kernel.

    Triton's interpreter (``TRITON_INTERPRET=1``) drops the carry when rounding fp32 to
    fp8 moves a value into the next binade, in half of the binades (-7.99 becomes -4
    instead of -8); the GPU's conversion rounds like the reference. With
    ``triton_interpreter`` only that error is forgiven: an element that is exactly half
    the expected value, where the expected value is a power of two.
    """
    got, expected = as_numpy(got), as_numpy(expected)
    if triton_interpreter:
        got32, expected32 = got.astype(np.float32), expected.astype(np.float32)
        mantissa, _ = np.frexp(expected32)
        dropped_carry = (got32 * 2 == expected32) & (np.abs(mantissa) == 0.5)
        got = np.where(dropped_carry, expected, got)
    return assert_close(got, expected, name=name)


def bit_mismatches(got, expected) -> tuple[int, tuple[int, ...] | None]:
    """Number of elements whose bytes differ, and the first such index."""
    got, expected = as_numpy(got), as_numpy(expected)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(
            f"shape/dtype {got.shape}/{got.dtype} differs from expected {expected.shape}/{expected.dtype}"
        )
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[expected.dtype.itemsize]
    differs = np.ascontiguousarray(got).view(width) != np.ascontiguousarray(expected).view(width)
    if not differs.any():
        return 0, None
    first = tuple(int(i) for i in np.argwhere(differs)[0])
    return int(differs.sum()), first


def assert_bit_exact(got, expected, *, name: str = "v") -> None:
    """Raise ``AssertionError`` naming the first differing element unless the bytes are equal."""
    count, first = bit_mismatches(got, expected)
    if count:
        got_np, expected_np = as_numpy(got), as_numpy(expected)
        raise AssertionError(
            f"{name}: {count} of {expected_np.size} elements differ bitwise; first at index "
            f"{first}: got {float(got_np[first])!r}, expected {float(expected_np[first])!r}"
        )
