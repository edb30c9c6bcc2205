"""Calls of the op as data, and the check of one call against the reference.

A :class:`Call` holds what both entry points share (the configuration, dtypes, token
count, a strided ``kv`` or not, indices on the host or not, positions outside the
cos/sin table) and the seed that makes its arrays (``interop.testing.random_inputs``);
an :class:`OpCase` is a ``fused_kv_norm_rope`` call, a :class:`CacheCase` one into a
paged cache. :func:`check_op_case` and :func:`check_cache_case` run one on a backend
(``backends.py``) and hold it to ``interop.core.reference``: K within the tolerance table, V
bit for bit, all-NaN K rows where a position is out of range, cache slots not written
bit for bit as poisoned. The contract suite lists its cases; the property tests draw them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import currently_in_test_context, note

from interop.core.arrays import as_numpy, numpy_dtype
from interop.core.reference import (fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference,
                                    rope_cos_sin_cache)
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, assert_fp8_close, random_inputs

FP8 = "float8_e4m3fn"
# The bases of the tables a call of per-layer tables has (a full-attention and a sliding-window RoPE).
ROPE_TABLES = (1e6, 1e4)


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
    # Positions, cache slots and fp8 scales left on the host: a CPU tensor beside CUDA
    # ones in torch, a NumPy array in jax; both kernels take them from any device.
    small_on_host: bool
    seed: int
    table_dtype: str = "float32"
    # Each layer's table among ROPE_TABLES (indices outside them included); () for one 2-D table.
    layer_rope_tables: tuple[int, ...] = ()
    # False: a draft without a K-norm (k_norm_weight and eps None).
    normed: bool = True
    # True: a seeded per-layer v_multiplier (a model's value scale).
    v_multiplied: bool = False

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
                               table_dtype=self.table_dtype, seed=self.seed)
        positions = inputs.positions.copy()
        for token, position in self.out_of_range_positions:
            positions[token] = position
        table = inputs.cos_sin_cache
        if self.layer_rope_tables:
            table = np.stack([rope_cos_sin_cache(self.max_position, self.rotary_dim, base)
                              for base in ROPE_TABLES]).astype(table.dtype)
        if not self.normed:
            return (inputs.kv, None, None, table, positions)
        return (inputs.kv, inputs.k_norm_weight, inputs.eps, table, positions)

    def v_multiplier(self) -> np.ndarray | None:
        """fp32[n_layers] in [0.5, 2), or None where the call has none."""
        if not self.v_multiplied:
            return None
        return np.random.default_rng(self.seed + 5).uniform(0.5, 2.0, self.n_layers).astype(np.float32)

    def v_bit_exact(self, backend) -> bool:
        """Whether V must come back bit for bit: a copy always; scaled, not from Triton's
        interpreter in bf16, which rounds to bf16 by truncation (README)."""
        return not (self.v_multiplied and backend.triton_interpreter and self.dtype == "bfloat16")

    def layer_rope_table(self) -> np.ndarray | None:
        return np.array(self.layer_rope_tables, np.int32) if self.layer_rope_tables else None

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
    """A ``fused_kv_norm_rope_into_cache`` call into poisoned caches (:func:`poisoned`) of
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


def poisoned(shape, dtype: str, *, seed: int) -> np.ndarray:
    """Values the op never writes, with NaN in every third row of the second axis (a cache
    slot, an output token): what is not written must come back bit for bit, values and NaN
    alike."""
    values = (8.0 * np.random.default_rng(seed).standard_normal(shape)).astype(numpy_dtype(dtype))
    values[:, ::3] = np.nan
    return values


def _device_inputs(backend, call: Call, host):
    kv, *rest, positions = host
    return [backend.kv(kv, call.kv_workspace_padding), *(None if a is None else backend.put(a) for a in rest),
            backend.put_small(positions, call.small_on_host)]


def _per_layer_options(backend, call: Call) -> dict:
    """The call's ``layer_rope_table`` and ``v_multiplier`` keywords, on the backend (those it has)."""
    options = dict(layer_rope_table=call.layer_rope_table(), v_multiplier=call.v_multiplier())
    return {name: backend.put_small(array, call.small_on_host) for name, array in options.items()
            if array is not None}


def _assert_v(v, expected_v, call: Call, backend, name: str = "v") -> None:
    if call.v_bit_exact(backend):
        assert_bit_exact(v, expected_v, name=name)
    else:
        assert_close(v, expected_v, name=name)


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
        poison = np.full(call.output_shape, np.nan, np.float32).astype(numpy_dtype(call.dtype))
        outputs = dict(k_out=backend.put(poison), v_out=backend.put(poison))
    k, v = backend.kernel.fused_kv_norm_rope(*_device_inputs(backend, call, host), **call.static, **outputs,
                                             **_per_layer_options(backend, call))
    if case.outputs_given and backend.writes_in_place:
        assert k is outputs["k_out"] and v is outputs["v_out"], "given outputs are written in place"
    k, v = as_numpy(k), as_numpy(v)
    assert k.shape == v.shape == call.output_shape
    assert k.dtype == v.dtype == numpy_dtype(call.dtype)
    expected_k, expected_v = fused_kv_norm_rope_reference(*host, **call.static,
                                                          layer_rope_table=call.layer_rope_table(),
                                                          v_multiplier=call.v_multiplier())
    assert_close(k, expected_k)
    _assert_v(v, expected_v, call, backend)
    assert np.isnan(k[:, call.bad_tokens].astype(np.float32)).all(), "out-of-range positions give NaN K rows"


def forgive_interpreters_fp8_ties(got: np.ndarray, expected: np.ndarray, quotient: np.ndarray) -> np.ndarray:
    """``got`` (a float8_e4m3fn cache Triton's interpreter wrote) with ``expected`` wherever
    the fp32 ``quotient`` it rounded is an exact tie between two codes and the interpreter
    took the one away from zero (its conversion rounds ties away; the GPU's, to even).
    Only there: any other difference stays."""
    codes = np.arange(256, dtype=np.uint8).view(expected.dtype).astype(np.float32)
    finite = np.unique(codes[np.isfinite(codes)])
    upper = np.clip(np.searchsorted(finite, quotient), 1, len(finite) - 1)
    low, high = finite[upper - 1], finite[upper]
    tie = (quotient - low == high - quotient) & (np.abs(quotient) <= finite[-1])
    away = np.where(quotient > 0, high, low)
    interpreted_tie = tie & (got.astype(np.float32) == away)
    return np.where(interpreted_tie, expected, got)


def forgive_interpreters_fp8_nan(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """``got`` (a float8_e4m3fn cache Triton's interpreter wrote) with NaN wherever
    ``expected`` holds NaN and the interpreter stored its image of NaN.

    Its fp32->fp8 conversion (``_convert_float`` in triton/runtime/interpreter.py) has no
    NaN case: the exponent saturates and the NaN's top mantissa bits stay, giving +-384;
    the GPU's conversion keeps NaN. Only that image, only where NaN is expected, is forgiven.
    """
    nan = np.isnan(expected.astype(np.float32))
    stored = got[nan].astype(np.float32)
    assert (np.isnan(stored) | (np.abs(stored) == 384.0)).all(), (
        f"{stored[~np.isnan(stored) & (np.abs(stored) != 384.0)]} where NaN is expected: not the "
        "interpreter's NaN (+-384)")
    got = got.copy()
    got[nan] = np.nan
    return got


def check_cache_case(backend, case: CacheCase) -> None:
    """One ``fused_kv_norm_rope_into_cache`` call against the reference."""
    call = case.call
    host = call.host_inputs()
    slots = case.slots()
    _note_arrays(call, positions=host[4], slots=slots)
    k_before = poisoned(case.cache_shape(), case.k_cache_dtype, seed=call.seed + 3)
    v_before = poisoned(case.cache_shape(), case.v_cache_dtype, seed=call.seed + 4)
    scales = case.scales()
    k_cache, v_cache = backend.put(k_before), backend.put(v_before)
    k, v = backend.kernel.fused_kv_norm_rope_into_cache(
        *_device_inputs(backend, call, host), backend.put_small(slots, call.small_on_host), k_cache, v_cache,
        **call.static, **_per_layer_options(backend, call),
        **{name: backend.put_small(scale, call.small_on_host) for name, scale in scales.items()})
    if backend.writes_in_place:
        assert k is k_cache and v is v_cache, "caches are written in place"
    k, v = as_numpy(k), as_numpy(v)
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *host, slots, k_before, v_before, **call.static, **scales, layer_rope_table=call.layer_rope_table(),
        v_multiplier=call.v_multiplier())

    written = [int(slot) for slot in slots if 0 <= slot < case.num_slots]
    untouched = sorted(set(range(case.num_slots)) - set(written))
    assert_bit_exact(k[:, untouched], k_before[:, untouched], name="k_cache untouched")
    assert_bit_exact(v[:, untouched], v_before[:, untouched], name="v_cache untouched")
    nan_rows = [int(slots[token]) for token in call.bad_tokens if 0 <= slots[token] < case.num_slots]
    interpreted = backend.triton_interpreter
    if case.k_cache_dtype == FP8:
        if interpreted:
            k = forgive_interpreters_fp8_nan(k, expected_k)
        assert_fp8_close(k, expected_k, triton_interpreter=interpreted, name="k_cache")
    else:
        assert_close(k, expected_k, name="k_cache")
    if case.v_cache_dtype == FP8:
        assert_fp8_close(v, expected_v, triton_interpreter=interpreted, name="v_cache")
    else:
        _assert_v(v, expected_v, call, backend, name="v_cache")
    assert np.isnan(k[:, nan_rows].astype(np.float32)).all(), "out-of-range positions give NaN K rows"

