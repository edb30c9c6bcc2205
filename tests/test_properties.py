"""Property tests: drawn configurations, both backends, both entry points, against the reference.

Hypothesis draws the whole call (layers, heads, head_dim, rotary_dim, rope style, dtypes,
the cos/sin table's included, one table or one per RoPE with each layer's index (some
outside the tables), a K-norm or none, a v_multiplier or none, token count, a strided or contiguous ``kv``, given or absent
outputs, int32/int64 positions with some out of range, a paged cache with padding slots
and fp8 caches) and a
seed for NumPy's generator, which makes the arrays (``interop.testing.random_inputs``).
Expected values come from ``interop.core.reference`` alone: K within the tolerance table, V
bit for bit, all-NaN K rows where a position is out of range, untouched cache slots
bit for bit as poisoned.

The cases and their check are ``cases.py``'s, which the contract suite lists by hand; the
backends (``backends.py``) run where this machine runs them by default: interpreted
without a GPU, compiled with one.

Profiles (``FUSEDKV_HYPOTHESIS_PROFILE``): ``ci`` (the default) is deterministic and
small enough for interpret mode on two CPU cores; ``gpu`` draws many more and larger
cases (up to 4096 tokens), fresh ones each run. A failure prints the drawn case as a
dataclass repr and a ``@reproduce_failure`` blob; the case alone replays it:
``check_op_case(TorchBackend(interpret=True), OpCase(...))``. ``FUSEDKV_HYPOTHESIS_EXAMPLES``
overrides the number of examples per test.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import FP8, ROPE_TABLES, CacheCase, Call, OpCase, check_cache_case, check_op_case
from interop.core.spec import KV_DTYPES, POSITION_DTYPES, ROPE_STYLES, ROPE_TABLE_DTYPES, SATURATED_INDEX_RANGE

INT32_MIN = -(2**31)
INT32_MAX = SATURATED_INDEX_RANGE[1]


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
    # Per-layer tables: each layer's index, now and then one outside the tables.
    table_index = st.integers(0, len(ROPE_TABLES) - 1) | st.sampled_from((-1, len(ROPE_TABLES)))
    layer_rope_tables = draw(st.just(()) | st.lists(table_index, min_size=n_layers, max_size=n_layers).map(tuple))
    return Call(
        n_layers=n_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
        rope_style=draw(st.sampled_from(ROPE_STYLES)), dtype=draw(st.sampled_from(KV_DTYPES)),
        weight_dtype=draw(st.sampled_from(WEIGHT_DTYPES)), total_ctx=total_ctx,
        max_position=max_position, position_dtype=position_dtype, out_of_range_positions=out_of_range,
        kv_workspace_padding=padding, small_on_host=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)), table_dtype=draw(st.sampled_from(ROPE_TABLE_DTYPES)),
        layer_rope_tables=layer_rope_tables, normed=draw(st.booleans()), v_multiplied=draw(st.booleans()),
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


@PROFILE_SETTINGS
@given(case=op_cases())
def test_op_matches_reference_on_drawn_calls(backend, case):
    check_op_case(backend, case)


@PROFILE_SETTINGS
@given(case=cache_cases())
def test_cache_op_matches_reference_on_drawn_calls(backend, case):
    check_cache_case(backend, case)


