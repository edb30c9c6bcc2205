"""Property tests: drawn configurations, both backends, both entry points, against the reference.

Hypothesis draws the whole call (layers, heads, head_dim, rotary_dim, rope style, dtypes,
token count, a strided or contiguous ``kv``, given or absent outputs, int32/int64
positions with some out of range, a paged cache with padding slots and fp8 caches) and a
seed for NumPy's generator, which makes the arrays (``interop.testing.random_inputs``).
Expected values come from ``interop.reference`` alone: K within the tolerance table, V
bit for bit, all-NaN K rows where a position is out of range, untouched cache slots
bit for bit as poisoned.

Profiles (``FUSEDKV_HYPOTHESIS_PROFILE``): ``ci`` (the default) is deterministic and
small enough for interpret mode on two CPU cores; ``gpu`` draws many more and larger
cases (up to 4096 tokens), fresh ones each run. A failure prints the drawn case as a
dataclass repr and a ``@reproduce_failure`` blob; the case alone replays it:
``check_op_case(TorchBackend(), OpCase(...))``. ``FUSEDKV_HYPOTHESIS_EXAMPLES``
overrides the number of examples per test.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, currently_in_test_context, given, note, settings
from hypothesis import strategies as st

from interop.arrays import as_numpy, numpy_dtype
from interop.exchange import INT32_MAX
from interop.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.spec import KV_DTYPES, POSITION_DTYPES, ROPE_STYLES, FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, assert_fp8_close, random_inputs

FP8 = "float8_e4m3fn"
INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class Limits:
    """How large a drawn case may be."""

    max_tokens: int
    # layers * heads * max(tokens, 1): bounds the programs of both kernels' grids,
    # which is what interpret mode pays for (Triton ~5-12 ms a program).
    max_rows: int
    max_position: int


PROFILES = {
    "ci": Limits(max_tokens=64, max_rows=128, max_position=256),
    "gpu": Limits(max_tokens=4096, max_rows=32768, max_position=8192),
}
# Examples per test; each backend has two tests (the op, the op into a cache). In the
# ci profile the same examples every run; in the gpu profile fresh ones (the blob replays).
EXAMPLES = {"ci": 20, "gpu": 250}
PROFILE = os.environ.get("FUSEDKV_HYPOTHESIS_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"Invalid FUSEDKV_HYPOTHESIS_PROFILE: got {PROFILE!r}, expected one of {tuple(PROFILES)}.")
for _name in PROFILES:
    settings.register_profile(
        _name, max_examples=int(os.environ.get("FUSEDKV_HYPOTHESIS_EXAMPLES", EXAMPLES[_name])),
        derandomize=_name == "ci", database=None, deadline=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow])
LIMITS = PROFILES[PROFILE]
PROFILE_SETTINGS = settings.get_profile(PROFILE)
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class Call:
    """The arguments both entry points share; ``seed`` makes the arrays."""

    n_layers: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_style: str
    dtype: str
    weight_dtype: str
    total_ctx: int
    max_position: int
    position_dtype: str
    # (token, position) pairs overriding a drawn position with one outside [0, max_position).
    out_of_range_positions: tuple[tuple[int, int], ...]
    # None: a contiguous kv; (left, right): kv is the columns between `left` and `right`
    # extra columns of a wider workspace (a strided view in torch).
    kv_workspace_padding: tuple[int, int] | None
    # Positions (and cache slots) left on the host: a CPU tensor beside CUDA ones in
    # torch, a NumPy array in jax; both kernels take indices from any device.
    indices_on_host: bool
    seed: int

    @property
    def config(self) -> FusedKVConfig:
        return FusedKVConfig(self.num_kv_heads, self.head_dim, self.rotary_dim, self.rope_style)

    @property
    def static(self) -> dict:
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    rotary_dim=self.rotary_dim, rope_style=self.rope_style)

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        return self.config.output_shape(self.n_layers, self.total_ctx)

    def host_inputs(self) -> tuple[np.ndarray, ...]:
        """``(kv, k_norm_weight, eps, cos_sin_cache, positions)`` in NumPy."""
        inputs = random_inputs(self.config, n_layers=self.n_layers, total_ctx=self.total_ctx,
                               dtype=self.dtype, max_position=self.max_position,
                               position_dtype=self.position_dtype, weight_dtype=self.weight_dtype,
                               seed=self.seed)
        positions = inputs.positions.copy()
        for token, position in self.out_of_range_positions:
            positions[token] = position
        return (inputs.kv, inputs.k_norm_weight, inputs.eps, inputs.cos_sin_cache, positions)

    @property
    def bad_tokens(self) -> list[int]:
        return sorted(token for token, _ in self.out_of_range_positions)


@dataclasses.dataclass(frozen=True)
class OpCase:
    """A ``fused_kv_norm_rope`` call; given outputs are poisoned with NaN first."""

    call: Call
    outputs_given: bool


@dataclasses.dataclass(frozen=True)
class CacheCase:
    """A ``fused_kv_norm_rope_into_cache`` call into NaN-poisoned caches of
    ``call.total_ctx + spare_slots`` slots; each token has its own slot (a seeded
    permutation) but those in ``skipped_slots`` ((token, slot) outside the cache)."""

    call: Call
    spare_slots: int
    slot_dtype: str
    k_cache_dtype: str
    v_cache_dtype: str
    skipped_slots: tuple[tuple[int, int], ...]

    @property
    def num_slots(self) -> int:
        return self.call.total_ctx + self.spare_slots

    def cache_shape(self) -> tuple[int, int, int, int]:
        call = self.call
        return (call.n_layers, self.num_slots, call.num_kv_heads, call.head_dim)

    def slots(self) -> np.ndarray:
        rng = np.random.default_rng(self.call.seed + 1)
        slots = rng.permutation(self.num_slots)[:self.call.total_ctx].astype(numpy_dtype(self.slot_dtype))
        for token, slot in self.skipped_slots:
            slots[token] = slot
        return slots

    def scales(self) -> dict:
        """fp32 per-layer scales for the fp8 caches: small enough that some values saturate."""
        rng = np.random.default_rng(self.call.seed + 2)
        return {name: rng.uniform(0.01, 0.5, self.call.n_layers).astype(np.float32)
                for name, dtype in (("k_scale", self.k_cache_dtype), ("v_scale", self.v_cache_dtype))
                if dtype == FP8}


def _outside(end: int, index_dtype: str) -> list[int]:
    """Indices outside ``[0, end)``: just past either end, and the dtype's extremes
    (int64 ones that wrap into range if narrowed to int32 carelessly)."""
    values = [-1, -2, INT32_MIN, end, end + 7, INT32_MAX]
    if index_dtype == "int64":
        values += [2**31, 2**32 + 1, -(2**32) + 1, 2**40]
    return values


@st.composite
def calls(draw, limits: Limits = LIMITS) -> Call:
    # Tokens first, so that the cap on rows trims layers and heads rather than the context.
    total_ctx = draw(st.integers(0, min(limits.max_tokens, limits.max_rows)))
    n_layers = draw(st.integers(1, min(8, limits.max_rows // max(total_ctx, 1))))
    num_kv_heads = draw(st.integers(1, min(16, limits.max_rows // (n_layers * max(total_ctx, 1)))))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    rotary_dim = draw(st.one_of(st.just(head_dim), st.integers(1, head_dim // 2).map(lambda half: 2 * half)))
    max_position = draw(st.integers(1, limits.max_position))
    position_dtype = draw(st.sampled_from(POSITION_DTYPES))
    out_of_range = ()
    if total_ctx:
        out_of_range = tuple(draw(st.lists(
            st.tuples(st.integers(0, total_ctx - 1), st.sampled_from(_outside(max_position, position_dtype))),
            max_size=min(total_ctx, 4), unique_by=lambda pair: pair[0])))
    padding = draw(st.none() | st.tuples(st.integers(0, 24), st.integers(1, 24)))
    return Call(
        n_layers=n_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_style=draw(st.sampled_from(ROPE_STYLES)), dtype=draw(st.sampled_from(KV_DTYPES)),
        weight_dtype=draw(st.sampled_from(WEIGHT_DTYPES)), total_ctx=total_ctx,
        max_position=max_position, position_dtype=position_dtype, out_of_range_positions=out_of_range,
        kv_workspace_padding=padding, indices_on_host=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def op_cases(draw) -> OpCase:
    return OpCase(draw(calls()), draw(st.booleans()))


@st.composite
def cache_cases(draw) -> CacheCase:
    call = draw(calls())
    spare_slots = draw(st.integers(0 if call.total_ctx else 1, 8))
    slot_dtype = draw(st.sampled_from(POSITION_DTYPES))
    skipped = ()
    if call.total_ctx:
        num_slots = call.total_ctx + spare_slots
        skipped = tuple(draw(st.lists(
            st.tuples(st.integers(0, call.total_ctx - 1), st.sampled_from(_outside(num_slots, slot_dtype))),
            max_size=min(call.total_ctx, 4), unique_by=lambda pair: pair[0])))
    return CacheCase(call, spare_slots, slot_dtype, draw(st.sampled_from((call.dtype, FP8))),
                     draw(st.sampled_from((call.dtype, FP8))), skipped)


# The backends: each moves host arrays where its kernel runs and calls its two entry points.

class TorchBackend:
    name = "torch"

    def __init__(self):
        import torch

        import fusedkv_torch

        self.torch, self.kernel = torch, fusedkv_torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.triton_interpreter = self.device == "cpu"

    def __repr__(self):  # as a falsifying example prints it, ready to paste
        return "TorchBackend()"

    def put(self, host: np.ndarray):
        from interop.exchange import to_torch

        return to_torch(np.ascontiguousarray(host)).to(self.device, copy=True)

    def indices(self, host: np.ndarray, on_host: bool):
        from interop.exchange import to_torch

        return to_torch(host.copy()) if on_host else self.put(host)

    def kv(self, host: np.ndarray, padding):
        if padding is None:
            return self.put(host)
        left, right = padding
        total_ctx, n_layers, width = host.shape
        workspace = self.torch.zeros((total_ctx, n_layers, left + width + right),
                                     dtype=getattr(self.torch, str(host.dtype)), device=self.device)
        view = workspace[:, :, left:left + width]
        view.copy_(self.put(host))
        return view


class JaxBackend:
    name = "jax"
    triton_interpreter = False  # Pallas interpret mode rounds like XLA

    def __init__(self):
        import fusedkv_jax

        self.kernel = fusedkv_jax

    def __repr__(self):
        return "JaxBackend()"

    def put(self, host: np.ndarray):
        from interop.exchange import to_jax

        return to_jax(np.ascontiguousarray(host))

    def indices(self, host: np.ndarray, on_host: bool):
        return host.copy() if on_host else self.put(host)

    def kv(self, host: np.ndarray, padding):
        if padding is None:
            return self.put(host)
        # jax arrays are dense: the slice of the wider workspace is a new array.
        left, right = padding
        total_ctx, n_layers, width = host.shape
        workspace = np.zeros((total_ctx, n_layers, left + width + right), host.dtype)
        workspace[:, :, left:left + width] = host
        return self.put(workspace)[:, :, left:left + width]


BACKENDS = {"torch": TorchBackend, "jax": JaxBackend}


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request):
    pytest.importorskip(request.param)
    return BACKENDS[request.param]()


def _poisoned(shape, dtype: str) -> np.ndarray:
    return np.full(shape, np.nan, np.float32).astype(numpy_dtype(dtype))


def _device_inputs(backend, call: Call, host):
    kv, *rest, positions = host
    return [backend.kv(kv, call.kv_workspace_padding), *(backend.put(a) for a in rest),
            backend.indices(positions, call.indices_on_host)]


def _note_arrays(call: Call, **arrays):
    """Printed with a falsifying example (the seed makes them, but they are what matters)."""
    if currently_in_test_context() and call.total_ctx <= 64:
        for name, array in arrays.items():
            note(f"{name} = {array.tolist()}")


def check_op_case(backend, case: OpCase) -> None:
    """One ``fused_kv_norm_rope`` call against the reference."""
    call = case.call
    host = call.host_inputs()
    _note_arrays(call, positions=host[4])
    outputs = {}
    if case.outputs_given:
        poison = _poisoned(call.output_shape, call.dtype)
        outputs = dict(k_out=backend.put(poison), v_out=backend.put(poison))
    k, v = backend.kernel.fused_kv_norm_rope(*_device_inputs(backend, call, host), **call.static, **outputs)
    if case.outputs_given and backend.name == "torch":
        assert k is outputs["k_out"] and v is outputs["v_out"], "given outputs are written in place"
    k, v = as_numpy(k), as_numpy(v)
    assert k.shape == v.shape == call.output_shape
    assert k.dtype == v.dtype == numpy_dtype(call.dtype)
    expected_k, expected_v = fused_kv_norm_rope_reference(*host, **call.static)
    assert_close(k, expected_k)
    assert_bit_exact(v, expected_v)
    assert np.isnan(k[:, call.bad_tokens].astype(np.float32)).all(), "out-of-range positions give NaN K rows"


def _interpreter_fp8_nan(cache: np.ndarray, rows: list[int]) -> np.ndarray:
    """``cache`` with NaN in ``rows`` where Triton's interpreter stored a NaN into fp8.

    Its fp32->fp8 conversion (``_convert_float`` in triton/runtime/interpreter.py) has no
    NaN case: the exponent saturates and the NaN's top mantissa bits stay, giving +-384;
    the GPU's conversion keeps NaN. Only that image, in only those rows, is forgiven.
    """
    stored = cache[:, rows].astype(np.float32)
    assert (np.abs(stored) == 384.0).all(), f"rows {rows} hold {stored}, not the interpreter's NaN (+-384)"
    cache = cache.copy()
    cache[:, rows] = np.nan
    return cache


def check_cache_case(backend, case: CacheCase) -> None:
    """One ``fused_kv_norm_rope_into_cache`` call against the reference."""
    call = case.call
    host = call.host_inputs()
    slots = case.slots()
    _note_arrays(call, positions=host[4], slots=slots)
    k_before = _poisoned(case.cache_shape(), case.k_cache_dtype)
    v_before = _poisoned(case.cache_shape(), case.v_cache_dtype)
    scales = case.scales()
    k_cache, v_cache = backend.put(k_before), backend.put(v_before)
    k, v = backend.kernel.fused_kv_norm_rope_into_cache(
        *_device_inputs(backend, call, host), backend.indices(slots, call.indices_on_host), k_cache, v_cache,
        **call.static,
        **{name: backend.put(scale) for name, scale in scales.items()})
    if backend.name == "torch":
        assert k is k_cache and v is v_cache, "caches are written in place"
    k, v = as_numpy(k), as_numpy(v)
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *host, slots, k_before, v_before, **call.static, **scales)

    written = [int(slot) for slot in slots if 0 <= slot < case.num_slots]
    untouched = sorted(set(range(case.num_slots)) - set(written))
    assert_bit_exact(k[:, untouched], k_before[:, untouched], name="k_cache untouched")
    assert_bit_exact(v[:, untouched], v_before[:, untouched], name="v_cache untouched")
    nan_rows = [int(slots[token]) for token in call.bad_tokens if 0 <= slots[token] < case.num_slots]
    interpreted = backend.triton_interpreter
    if case.k_cache_dtype == FP8:
        if interpreted and nan_rows:
            k = _interpreter_fp8_nan(k, nan_rows)
        assert_fp8_close(k, expected_k, triton_interpreter=interpreted, name="k_cache")
    else:
        assert_close(k, expected_k, name="k_cache")
    if case.v_cache_dtype == FP8:
        assert_fp8_close(v, expected_v, triton_interpreter=interpreted, name="v_cache")
    else:
        assert_bit_exact(v, expected_v, name="v_cache")
    assert np.isnan(k[:, nan_rows].astype(np.float32)).all(), "out-of-range positions give NaN K rows"


@PROFILE_SETTINGS
@given(case=op_cases())
def test_op_matches_reference_on_drawn_calls(backend, case):
    check_op_case(backend, case)


@PROFILE_SETTINGS
@given(case=cache_cases())
def test_cache_op_matches_reference_on_drawn_calls(backend, case):
    check_cache_case(backend, case)


