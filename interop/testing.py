"""What tests, benchmarks and ``fusedkv check`` hold the kernels to: random inputs and
the one tolerance table.

:func:`random_inputs` draws a call's arguments (one generator for all). Comparisons:
an element passes when ``|got - expected| <= ulps * ulp(expected) + atol`` with the
ulp taken in the output dtype. A float8_e4m3fn cache is held to more: its codes are
counted, not measured (see its entry). NaN must meet NaN (out-of-range positions), and
a NaN anywhere else fails. V is never compared here: it must match bit for bit
(:func:`assert_bit_exact`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from interop.core.arrays import as_numpy, numpy_dtype
from interop.core.materializer import (LayerKV, RopeConfig, materializer_reference, stacked_op_arrays,
                                      stacked_rope_tables, stacked_v_multiplier, validate_layers)
from interop.core.reference import (fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference,
                                    rope_cos_sin_cache)
from interop.core.spec import FusedKVConfig, dtype_name


@dataclasses.dataclass(frozen=True)
class OpInputs:
    """Host (NumPy) arguments of one call, in the op's argument order."""

    kv: np.ndarray
    k_norm_weight: np.ndarray
    eps: np.ndarray
    cos_sin_cache: np.ndarray
    positions: np.ndarray

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.kv, self.k_norm_weight, self.eps, self.cos_sin_cache, self.positions)


def random_inputs(
    config: FusedKVConfig,
    *,
    n_layers: int,
    total_ctx: int,
    dtype: str = "bfloat16",
    max_position: int = 32768,
    position_dtype: str = "int32",
    weight_dtype: str = "float32",
    table_dtype: str = "float32",
    seed: int = 0,
) -> OpInputs:
    """Fresh random inputs: gaussian kv, weights near 1, eps in [1e-6, 1e-5), random positions,
    the standard RoPE table rounded to ``table_dtype``."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((total_ctx, n_layers, 2 * config.kv_size), dtype=np.float32)
    k_norm_weight = 1.0 + 0.25 * rng.standard_normal((n_layers, config.head_dim), dtype=np.float32)
    eps = rng.uniform(1e-6, 1e-5, size=n_layers).astype(np.float32)
    positions = rng.integers(0, max_position, size=total_ctx)
    return OpInputs(
        kv=(2.0 * kv).astype(numpy_dtype(dtype)),
        k_norm_weight=k_norm_weight.astype(numpy_dtype(weight_dtype)),
        eps=eps,
        cos_sin_cache=rope_cos_sin_cache(max_position, config.rotary_dim).astype(numpy_dtype(table_dtype)),
        positions=positions.astype(numpy_dtype(position_dtype)),
    )


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``ulps`` (for a one-byte dtype: code steps) plus ``atol`` per element.

    ``off_fraction``: when set, at most this fraction of the elements (and at least
    one) may differ from the expected at all; the rest must be exact.
    """

    ulps: float
    atol: float
    reason: str
    off_fraction: float | None = None


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
    # A code step of e4m3 is 2**-3 of its binade (6-12% of the value), so a tolerance of
    # one step admits a cache quantized with a scale 5% off. The kernels round the same
    # fp32 quotient once, so their codes are exact but where the reordered fp32 math
    # moved the quotient across a rounding boundary. If it moves by at most m fp32 ulps
    # (2**-23 of the binade each), a quotient spread over the binade, whose boundaries
    # lie 2**-3 of the binade apart, crosses one with probability at most m * 2**-20:
    # 1.5e-5 for the m = 16 of the float32 entry; neither kernel puts a code further
    # than one step off. 1 in 10,000 leaves room above that bound, while a scale off by 5%
    # moves 40-80% of the codes (and one off by 0.1% still about 1%).
    # Triton's interpreter converts fp32 to fp8 wrongly in known ways (README, the CPU
    # section): NaN to +-384, ties away from zero, dropped carries, values below 2**-6.
    # The table does not widen for them; compare(triton_interpreter=True) forgives the
    # carries and the values below 2**-6 code by code, and tests that meet NaN or ties
    # there say so themselves (tests/cases.py).
    "float8_e4m3fn": Tolerance(
        ulps=1, atol=0.0, off_fraction=1e-4,
        reason="a cache entry value/scale rounded once from fp32: codes match exactly, but at "
        "most 1 in 10,000 (at least one) may be one step off where reordered fp32 math put "
        "the quotient across a rounding boundary",
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


# FP8 weights on FP8 tensor cores against dequantize-then-GEMM (the reference, and the path
# without such cores): the tensor cores take FP8 activations, so each token's hidden states
# are rounded to e4m3, up to 2**-4 of each value. Summed over hidden with random signs that
# is an error of about 2**-5 of kv's rms on every kv element (measured at hidden 4096: rms
# 0.027 of an rms of one, at most 0.19 over 650k elements of K and V), which the RMSNorm
# carries into K unchanged in relative terms. For values of order one (the random cases,
# normalized K) 2**-1 holds the measured worst with room; a missing or misplaced scale is
# off by far more.
FP8_GEMM_TOLERANCE = Tolerance(
    ulps=2, atol=2.0 ** -1,
    reason="the FP8 tensor-core GEMM quantizes each token's activations to e4m3 (up to 2**-4 "
    "of each), about 2**-5 of kv's rms on every element after the sum over hidden",
)


def fp8_layers(layers, *, per_row: bool = True) -> tuple[LayerKV, ...]:
    """The layers with their projection weights quantized to float8_e4m3fn: each row's (or
    each layer's) largest |weight| to 448, fp32 ``weight_scale`` of shape ``(rows, 1)``
    (or ``(1,)``), as FP8 checkpoints store them; the bias, if any, in bfloat16."""
    def quantized(layer):
        weight = as_numpy(layer.kv_proj_weight).astype(np.float32)
        amax = np.abs(weight).max(axis=1, keepdims=True) if per_row else np.abs(weight).max().reshape(1)
        scale = (np.maximum(amax, np.float32(2.0 ** -100)) / np.float32(448)).astype(np.float32)
        codes = (weight / (scale if per_row else scale[0])).astype(numpy_dtype("float8_e4m3fn"))
        bias = None if layer.kv_proj_bias is None else as_numpy(layer.kv_proj_bias).astype(numpy_dtype("bfloat16"))
        return dataclasses.replace(layer, kv_proj_weight=codes, weight_scale=scale, kv_proj_bias=bias)

    return tuple(quantized(layer) for layer in layers)


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """The spacing of ``dtype`` above each |value| (as fp64); NaN and Inf count as 0."""
    finite = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    typed = np.abs(finite).astype(numpy_dtype(dtype))
    with np.errstate(over="ignore", invalid="ignore"):
        step = np.spacing(typed).astype(np.float64)
        # Above the largest finite value lies Inf (NaN for float8_e4m3fn): use the step
        # below, the spacing of its binade, twice the spacing of half the value.
        step_below = 2 * np.spacing(typed / typed.dtype.type(2)).astype(np.float64)
    return np.where(np.isfinite(step), step, step_below)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How far ``got`` is from ``expected``; ``worst_*`` describe the worst element.

    ``n_off`` elements differ from the expected but are within ``ulps``; under an
    ``off_fraction`` at most ``off_allowed`` may, and when more do they all count as bad.
    """

    name: str
    dtype: str
    tolerance: Tolerance
    n_elements: int
    n_bad: int
    max_ulps: float
    worst_index: tuple[int, ...] | None
    worst_got: float
    worst_expected: float
    n_off: int = 0
    off_allowed: int | None = None

    @property
    def ok(self) -> bool:
        return self.n_bad == 0

    def report(self) -> str:
        if self.off_allowed is None:
            rule = f"{self.tolerance.ulps:g} ulp + {self.tolerance.atol:g}"
        else:
            rule = (f"exact but at most {self.off_allowed} off by up to {self.tolerance.ulps:g}, "
                    f"{self.n_off} were")
        unit = "steps" if numpy_dtype(self.dtype).itemsize == 1 else "ulp"
        head = (f"{self.name}: {self.n_bad} of {self.n_elements} elements outside tolerance "
                f"({self.dtype}: {rule}); max error {self.max_ulps:.3g} {unit}")
        if self.worst_index is None:
            return head
        return (f"{head}; worst at index {self.worst_index}: got {self.worst_got!r}, "
                f"expected {self.worst_expected!r}")


def code_steps(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """How many codes of their one-byte float dtype lie between ``got`` and ``expected``
    (as fp64): 0 where equal (+0 and -0 alike, NaN and NaN), Inf where only one is NaN."""
    def ordered(values):
        bits = values.view(np.uint8).astype(np.int64)
        magnitude = bits & 0x7F
        return np.where(bits & 0x80, -magnitude, magnitude)

    got_nan, expected_nan = np.isnan(got.astype(np.float32)), np.isnan(expected.astype(np.float32))
    steps = np.abs(ordered(got) - ordered(expected)).astype(np.float64)
    return np.where(got_nan | expected_nan, np.where(got_nan & expected_nan, 0.0, np.inf), steps)


FP8_E4M3_SMALLEST_NORMAL = 2.0 ** -6


def _triton_interpreters_fp8_errors(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Where ``got`` may be what Triton's interpreter (``TRITON_INTERPRET=1``, Triton 3.9)
    writes for ``expected`` when it rounds fp32 to float8_e4m3fn; its conversion differs
    from the GPU's and the reference's in three ways, two of them forgiven here:

    - a carry into the next binade is dropped in half of the binades (-7.99 becomes -4
      instead of -8): ``got`` is half of an ``expected`` that is a power of two;
    - below the smallest normal (2**-6) it truncates: ``got`` is one code nearer zero
      than an ``expected`` of at most 2**-6 in magnitude;
    - exact ties are rounded away from zero instead of to even. Not forgiven (a code
      cannot tell a tie from an error): ties are common where the scale is round (a
      power of two, or a short decimal such as 0.05 against bf16 values) and rare (about
      2**-20 of the values) for a scale with a random mantissa, which is what tests
      running there use.
    """
    got32, expected32 = got.astype(np.float32), expected.astype(np.float32)
    mantissa, _ = np.frexp(expected32)
    dropped_carry = (got32 * 2 == expected32) & (np.abs(mantissa) == 0.5)
    truncated = ((np.abs(expected32) <= FP8_E4M3_SMALLEST_NORMAL) & (np.abs(got32) < np.abs(expected32))
                 & (got32 * expected32 >= 0) & (code_steps(got, expected) == 1))
    return dropped_carry | truncated


def compare(got, expected, *, name: str = "k", tolerance: Tolerance | None = None,
            triton_interpreter: bool = False) -> Comparison:
    """Compare element-wise under the table's tolerance for ``expected``'s dtype.

    ``triton_interpreter``: ``got`` is a float8_e4m3fn cache written by Triton's
    interpreter, whose known conversion errors (:func:`_triton_interpreters_fp8_errors`)
    are then forgiven; the GPU's conversion rounds like the reference.
    """
    got, expected = as_numpy(got), as_numpy(expected)
    if got.shape != expected.shape:
        raise AssertionError(f"{name}: shape {got.shape} differs from expected {expected.shape}")
    dtype = dtype_name(expected.dtype)
    tolerance = tolerance or TOLERANCES[dtype]
    got64, expected64 = got.astype(np.float64), expected.astype(np.float64)
    if expected.dtype.itemsize == 1:
        # A one-byte float is compared code by code, where "one ulp" cannot mean two codes
        # (below a power of two the codes are twice as dense as above it).
        if got.dtype != expected.dtype:
            raise AssertionError(f"{name}: dtype {dtype_name(got.dtype)} differs from expected {dtype}")
        error_ulps = code_steps(got, expected)
        if triton_interpreter:
            error_ulps = np.where(_triton_interpreters_fp8_errors(got, expected), 0.0, error_ulps)
        error = error_ulps
        bad = error_ulps > tolerance.ulps
    else:
        step = ulp(expected64, dtype)
        with np.errstate(invalid="ignore"):  # Inf - Inf: Inf met Inf, or -Inf, told apart below
            error = np.abs(got64 - expected64)
        agree = (np.isnan(got64) & np.isnan(expected64)) | (got64 == expected64)
        error = np.where(agree, 0.0, np.where(np.isnan(error), np.inf, error))
        bad = error > tolerance.ulps * step + tolerance.atol
        # Near zero the dtype's own ulp is far below atol; counting in it would report
        # billions of "ulps" for an error the tolerance accepts, so atol floors the unit.
        error_ulps = error / np.maximum(step, tolerance.atol)
    off = (error > 0) & ~bad
    n_off = int(off.sum())
    off_allowed = None
    if tolerance.off_fraction is not None:
        off_allowed = max(1, int(tolerance.off_fraction * error.size))
        if n_off > off_allowed:
            bad |= off
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
                      worst_index, worst_got, worst_expected, n_off, off_allowed)


def assert_close(got, expected, *, name: str = "k", tolerance: Tolerance | None = None,
                 triton_interpreter: bool = False) -> Comparison:
    """Raise ``AssertionError`` naming the worst element unless every element is in tolerance."""
    result = compare(got, expected, name=name, tolerance=tolerance, triton_interpreter=triton_interpreter)
    if not result.ok:
        raise AssertionError(result.report())
    return result


def assert_fp8_close(got, expected, *, triton_interpreter: bool, name: str = "k") -> Comparison:
    """:func:`assert_close` for a float8_e4m3fn cache written by a Triton kernel, which
    must say whether the kernel ran in Triton's interpreter (see :func:`compare`)."""
    if dtype_name(as_numpy(expected).dtype) != "float8_e4m3fn":
        raise AssertionError(f"{name}: expected a float8_e4m3fn array, got {dtype_name(as_numpy(expected).dtype)}")
    return assert_close(got, expected, name=name, triton_interpreter=triton_interpreter)


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


# A gradient is held to a fraction of the largest element of its tensor: grad_x = r * (w*gn
# - x*r * mean(...)) cancels terms the size of the tensor's large elements, so an element
# near zero carries their rounding, not its own ulp's. fp32: the kernels' fp32 sums in
# another order; fp16, bf16: a few roundings of the gradient's dtype (Triton's interpreter
# truncates to bf16).
GRADIENT_RELATIVE_ERROR = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def gradient_mismatch(got, expected, dtype: str, *, name: str = "grad_kv") -> str:
    """``''`` when ``got`` holds ``expected`` (float64) within :data:`GRADIENT_RELATIVE_ERROR`
    of ``dtype`` times the largest finite ``|expected|``, NaN exactly where it has NaN; else what differs."""
    got = as_numpy(got).astype(np.float64)
    if got.shape != expected.shape:
        return f"{name}: shape {got.shape}, expected {expected.shape}"
    nan = np.isnan(expected)
    if (np.isnan(got) != nan).any():
        differ = int((np.isnan(got) != nan).sum())
        return f"{name}: {differ} elements NaN where the reference is not, or not NaN where it is"
    scale = np.abs(expected[~nan]).max(initial=1.0)
    error = np.abs(got[~nan] - expected[~nan])
    allowed = GRADIENT_RELATIVE_ERROR[dtype] * scale
    if not (error <= allowed).all():  # NaN errors (an Inf against a finite value) fail too
        off = int((~(error <= allowed)).sum())
        return f"{name}: {off} elements off by more than {allowed:.3g} (the worst by {np.nanmax(error):.3g})"
    return ""


@dataclasses.dataclass(frozen=True)
class MaterializerCase:
    """Host (NumPy) arguments of one materializer and one call on it."""

    layers: tuple[LayerKV, ...]
    ctx_hidden: np.ndarray
    positions: np.ndarray

    def op_reference(self, kv, **cache):
        """The op's reference on ``kv`` (a materializer's own GEMM output) with these layers'
        arrays and positions; given ``cache_loc``, ``k_cache``, ``v_cache`` (and scales), the
        reference of the op written into those caches."""
        arrays = (kv, *stacked_op_arrays(self.layers), self.positions)
        static = dict(validate_layers(self.layers).op_kwargs(), v_multiplier=stacked_v_multiplier(self.layers),
                      layer_rope_table=stacked_rope_tables(self.layers)[1])
        if not cache:
            return fused_kv_norm_rope_reference(*arrays, **static)
        return fused_kv_norm_rope_into_cache_reference(*arrays, **cache, **static)

    def end_to_end_reference(self):
        """:func:`materializer_reference` of this case."""
        return materializer_reference(self.layers, self.ctx_hidden, self.positions)


def random_case(
    op: FusedKVConfig,
    *,
    n_layers: int,
    hidden: int,
    total_ctx: int,
    max_position: int = 4096,
    dtype: str = "bfloat16",
    position_dtype: str = "int32",
    seed: int = 0,
    k_norm: bool = True,
    v_multiplier: bool = False,
    kv_bias: bool = False,
) -> MaterializerCase:
    """Fresh random layers and hidden states; k_norm weights, eps and positions as the op's
    (no K-norm where ``k_norm`` is False; ``v_multiplier``: a random value scale per layer,
    of the size real drafts use; ``kv_bias``: a random projection bias per layer).

    Projection weights are gaussian with variance 1/hidden so that kv, like the op's
    random inputs, is of order one; biases are gaussian of variance 1/4.
    """
    op_inputs = random_inputs(op, n_layers=n_layers, total_ctx=total_ctx, max_position=max_position,
                              position_dtype=position_dtype, seed=seed)
    rng = np.random.default_rng(seed + 1)
    weights = rng.standard_normal((n_layers, 2 * op.kv_size, hidden), dtype=np.float32)
    weights /= np.sqrt(hidden)
    rope = RopeConfig(op.rotary_dim, max_position, style=op.rope_style)
    multipliers = rng.uniform(0.6, 0.72, size=n_layers) if v_multiplier else [None] * n_layers
    ctx_hidden = rng.standard_normal((total_ctx, hidden), dtype=np.float32).astype(numpy_dtype(dtype))
    biases = [None] * n_layers
    if kv_bias:  # drawn last, so that a case without biases is the one drawn before biases existed
        biases = (rng.standard_normal((n_layers, 2 * op.kv_size), dtype=np.float32) / 2).astype(numpy_dtype(dtype))
    layers = tuple(
        LayerKV(weights[index].astype(numpy_dtype(dtype)), op_inputs.k_norm_weight[index] if k_norm else None,
                float(op_inputs.eps[index]) if k_norm else None, op.num_kv_heads, op.head_dim, rope,
                None if multipliers[index] is None else float(multipliers[index]), biases[index])
        for index in range(n_layers)
    )
    return MaterializerCase(layers, ctx_hidden, op_inputs.positions)
