"""The op's contract, one suite for both backends: what fusedkv_torch and fusedkv_jax must
do alike (CONTRACT.md), against interop's NumPy reference on fresh random inputs.

K within the tolerance table, V bit for bit; the edge values of the README; the paged
cache, fp8 included; every refusal with its message word for word, raised before
anything is written. Each class has an interpreted twin (``...Interpreted``), as
JAX's Pallas tests do: the twin runs everywhere, the compiled class on a GPU machine
(``backends.py`` says where each backend runs). What only one backend has (registered
ops, launches, strided torch views; jit, donation, lowerings) stays in its own file.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from backends import host
from cases import (FP8, CacheCase, Call, OpCase, check_cache_case, check_op_case, forgive_interpreters_fp8_nan,
                   forgive_interpreters_fp8_ties, poisoned)
from interop.core.arrays import numpy_dtype
from interop.core.reference import (FP8_SCALE_MAX, FP8_SCALE_MIN, fused_kv_norm_rope_into_cache_reference,
                               fused_kv_norm_rope_reference, rope_cos_sin_cache)
from interop.core.spec import FusedKVConfig, device_name
from interop.testing import Tolerance, assert_bit_exact, assert_close, assert_fp8_close, compare, random_inputs

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# The interpreters compute in NumPy, which warns about the Inf and NaN these tests are about.
ieee_edge = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ARGUMENTS = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions")


def static(config: FusedKVConfig) -> dict:
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim, rope_style=config.rope_style)


def call(heads, head_dim, rotary_dim, style, *, n_layers, total_ctx, dtype="bfloat16", weight_dtype="float32",
         position_dtype="int32", max_position=64, outside=(), kv_padding=None, on_host=False, seed=0) -> Call:
    """A :class:`cases.Call`; ``outside``: (token, position) pairs beyond the cos/sin table."""
    return Call(n_layers=n_layers, num_kv_heads=heads, head_dim=head_dim, rotary_dim=rotary_dim,
                rope_style=style, dtype=dtype, weight_dtype=weight_dtype, total_ctx=total_ctx,
                max_position=max_position, position_dtype=position_dtype, out_of_range_positions=outside,
                kv_workspace_padding=kv_padding, small_on_host=on_host, seed=seed)


def run_op(backend, arrays, config):
    """``fused_kv_norm_rope`` on these host arrays, checked against the reference; the host results."""
    k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in arrays), **static(config))
    expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config))
    assert_close(k, expected_k)
    assert_bit_exact(v, expected_v)
    return host(k), host(v)


# (heads, head_dim, rotary_dim, style): head_dim 64 to 192 and the odd 96 and 8, partial
# and full rotation, both styles, each kv, weight and position dtype, one token of one
# layer, a strided kv, positions on the host, given outputs. Each case is a compilation
# of the jax kernel, so each combines several of these; the property tests draw the rest.
OP_CASES = {
    "d128-neox-bf16-16-tokens-into-given-outputs": OpCase(call(2, 128, 128, "neox", n_layers=2, total_ctx=16), True),
    "d128-gptj-fp16-int64-positions-on-host": OpCase(call(
        2, 128, 128, "gptj", n_layers=2, total_ctx=3, dtype="float16", position_dtype="int64", on_host=True, seed=1),
        False),
    "d128-r64-neox-fp32-bf16-weights": OpCase(call(
        2, 128, 64, "neox", n_layers=2, total_ctx=3, dtype="float32", weight_dtype="bfloat16", seed=2), False),
    "d128-r64-gptj-fp16-weights-strided-kv": OpCase(call(
        2, 128, 64, "gptj", n_layers=2, total_ctx=3, weight_dtype="float16", kv_padding=(8, 24), seed=3), False),
    "d192-r64-neox-fp16-three-layers": OpCase(call(1, 192, 64, "neox", n_layers=3, total_ctx=3, dtype="float16",
                                                   seed=4), False),
    "d192-gptj-fp32-int64-positions": OpCase(call(
        1, 192, 192, "gptj", n_layers=2, total_ctx=3, dtype="float32", position_dtype="int64", seed=5), False),
    "d96-neox-int32-positions-on-host-into-given-outputs": OpCase(call(
        3, 96, 96, "neox", n_layers=2, total_ctx=3, on_host=True, seed=6), True),
    "d96-r32-gptj-fp16-one-layer": OpCase(call(3, 96, 32, "gptj", n_layers=1, total_ctx=5, dtype="float16", seed=7),
                                          False),
    # The shape of the refusals' good call, compiled once for both.
    "d64-r32-neox-into-given-outputs": OpCase(call(2, 64, 32, "neox", n_layers=2, total_ctx=3, max_position=16,
                                                   seed=8), True),
    "d64-gptj-one-token-of-one-layer": OpCase(call(1, 64, 64, "gptj", n_layers=1, total_ctx=1, seed=9), False),
    "d64-r32-neox-one-token-of-one-layer-bf16-weights": OpCase(call(
        3, 64, 32, "neox", n_layers=1, total_ctx=1, weight_dtype="bfloat16", seed=10), False),
    "d8-r6-neox-fp32-int64-fp64-weights": OpCase(call(
        2, 8, 6, "neox", n_layers=2, total_ctx=7, dtype="float32", position_dtype="int64", weight_dtype="float64",
        seed=11), False),
}

# Positions past either end of the table, and int64 ones that wrap into it if narrowed to
# int32 carelessly (2**32 + 3 is 3). In the shapes of the edge values and of an OP_CASES
# case: interpreted, jax compiles the kernel once per shape and dtype.
OUTSIDE_CASES = {
    "neox-int64": OpCase(call(2, 32, 16, "neox", n_layers=1, total_ctx=4, position_dtype="int64",
                              outside=((0, 64), (1, 2**32 + 3), (2, -1)), on_host=True, seed=12), False),
    "gptj-int32": OpCase(call(3, 96, 32, "gptj", n_layers=1, total_ctx=5, dtype="float16",
                              outside=((0, -1), (2, 64), (4, 2**31 - 1)), seed=13), False),
}

# NaN with a payload, negative NaN, signaling NaN, +Inf, -Inf: bit patterns per kv dtype.
SPECIAL_BITS = {
    "float32": (np.uint32, [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000]),
    "bfloat16": (np.uint16, [0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80]),
    "float16": (np.uint16, [0x7E01, 0xFE00, 0x7C01, 0x7C00, 0xFC00]),
}


def special_values(dtype: str) -> np.ndarray:
    width, bits = SPECIAL_BITS[dtype]
    return np.array(bits, width).view(numpy_dtype(dtype))


def cpu_scatter_changes_bits(values: np.ndarray) -> bool:
    """Whether an XLA scatter on the CPU, the store of Pallas interpret mode, writes other
    bits than ``values``."""
    import jax

    cpu = jax.devices("cpu")[0]
    target = jax.device_put(np.zeros_like(values), cpu)
    indices = jax.device_put(np.arange(values.size), cpu)
    stored = jax.jit(lambda t, i, x: t.at[i].set(x, mode="drop"))(target, indices, jax.device_put(values, cpu))
    unsigned = np.dtype(f"uint{8 * values.itemsize}")
    return not np.array_equal(np.asarray(stored).view(unsigned), values.view(unsigned))


EDGE = {style: FusedKVConfig(2, 32, 16, style) for style in ("neox", "gptj")}


def edge_inputs(style: str, dtype: str):
    """One layer, 4 tokens, 2 heads of 32 with 16 rotated: one shape for every edge value."""
    return EDGE[style], random_inputs(EDGE[style], n_layers=1, total_ctx=4, dtype=dtype, max_position=64, seed=50)


def k_head(kv, config, token, head):
    """The K elements of one head of layer 0, as a writable view."""
    return kv[token, 0, head * config.head_dim:(head + 1) * config.head_dim]


def all_nan(k, token, head) -> bool:
    return bool(np.isnan(k[0, token, head].astype(np.float32)).all())


def per_layer_tables(max_position: int, rotary_dim: int, dtype: str) -> np.ndarray:
    """Two RoPE tables of other bases (a full-attention and a sliding-window one), ``[2, max_pos, rotary_dim]``."""
    return np.stack([rope_cos_sin_cache(max_position, rotary_dim, base)
                     for base in (1e6, 1e4)]).astype(numpy_dtype(dtype))


class TestOp:
    """``fused_kv_norm_rope``: compiled kernels."""

    interpret = False

    @pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES)
    def test_k_matches_the_reference_and_v_is_copied_bit_for_bit(self, backend, case):
        check_op_case(backend, case)

    @pytest.mark.parametrize("case", OUTSIDE_CASES.values(), ids=OUTSIDE_CASES)
    def test_positions_outside_the_table_give_all_nan_k_rows_and_exact_v(self, backend, case):
        check_op_case(backend, case)

    @pytest.mark.parametrize("tile", [(1, 1, 1), (2, 2, 2), (4, 1, 4)], ids=str)
    def test_a_tile_override_gives_the_reference_results(self, backend, tile):
        config = FusedKVConfig(2, 96, 64, "gptj")
        inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=64, seed=14)
        block_tokens, block_heads, num_warps = tile
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in inputs.arrays()), **static(config),
                                                 block_tokens=block_tokens, block_heads=block_heads,
                                                 num_warps=num_warps)
        expected_k, expected_v = fused_kv_norm_rope_reference(*inputs.arrays(), **static(config))
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)

    def test_check_positions_passes_positions_in_range_and_an_empty_context(self, backend):
        config = FusedKVConfig(2, 64, 64)
        inputs = random_inputs(config, n_layers=1, total_ctx=3, max_position=16, seed=11)
        inputs.positions[:2] = (0, 15)  # both ends of the table
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in inputs.arrays()), **static(config),
                                                 check_positions=True)
        expected_k, expected_v = fused_kv_norm_rope_reference(*inputs.arrays(), **static(config))
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
        empty = random_inputs(config, n_layers=3, total_ctx=0, max_position=16)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in empty.arrays()), **static(config),
                                                 check_positions=True)
        assert k.shape == v.shape == (3, 0, 2, 64)

    def test_an_empty_context_gives_empty_outputs_on_the_kv_device(self, backend):
        inputs = random_inputs(FusedKVConfig(2, 64, 32), n_layers=3, total_ctx=0, max_position=16)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in inputs.arrays()),
                                                 num_kv_heads=2, head_dim=64, rotary_dim=32)
        assert k.shape == v.shape == (3, 0, 2, 64)
        assert host(k).dtype == host(v).dtype == numpy_dtype("bfloat16")
        assert device_name(k) == device_name(v) == backend.device_name

    def test_no_layers_give_empty_outputs_with_and_without_given_outputs(self, backend):
        config = FusedKVConfig(2, 16, 16)
        inputs = random_inputs(config, n_layers=0, total_ctx=3, max_position=16)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in inputs.arrays()), **static(config))
        assert k.shape == v.shape == (0, 3, 2, 16)
        assert device_name(k) == device_name(v) == backend.device_name
        empty = poisoned((0, 3, 2, 16), "bfloat16", seed=3)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in inputs.arrays()), **static(config),
                                                 k_out=backend.put(empty), v_out=backend.put(empty.copy()))
        assert host(k).shape == host(v).shape == (0, 3, 2, 16)

    @pytest.mark.parametrize("style, rotary_dim", [("neox", 64), ("gptj", 32), ("neox", 24)])
    def test_a_draft_without_a_k_norm_gets_rope_of_the_projected_k(self, backend, style, rotary_dim):
        config = FusedKVConfig(2, 64, rotary_dim, style)
        inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=64, seed=31)
        arrays = (inputs.kv, None, None, inputs.cos_sin_cache, inputs.positions)
        k, v = backend.kernel.fused_kv_norm_rope(*(None if a is None else backend.put(a) for a in arrays),
                                                 **static(config))
        expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config))
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
        # Position 0 rotates by cos 1 and sin 0: K comes back as projected, bit for bit.
        at_zero = (inputs.kv, None, None, inputs.cos_sin_cache, np.zeros_like(inputs.positions))
        k, _ = backend.kernel.fused_kv_norm_rope(*(None if a is None else backend.put(a) for a in at_zero),
                                                 **static(config))
        projected_k = inputs.kv[:, :, :config.kv_size].reshape(5, 2, 2, 64).transpose(1, 0, 2, 3)
        assert_bit_exact(k, np.ascontiguousarray(projected_k), name="k")

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
    def test_v_multiplier_scales_v_in_fp32_rounded_once(self, backend, dtype):
        config = FusedKVConfig(2, 64, 32)
        inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, dtype=dtype, seed=32)
        multiplier = np.array([0.61, 2.0, 0.7071], np.float32)
        arrays = inputs.arrays()
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in arrays), **static(config),
                                                 v_multiplier=backend.put(multiplier))
        expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config), v_multiplier=multiplier)
        assert_close(k, expected_k)
        if backend.triton_interpreter and dtype == "bfloat16":  # it rounds to bf16 by truncation (README)
            assert_close(v, expected_v, name="v")
        else:
            assert_bit_exact(v, expected_v)
        # A power of two scales exactly: layer 1's V is twice its input, bit for bit.
        doubled = (2 * inputs.kv[:, 1, config.kv_size:].astype(np.float32)).astype(inputs.kv.dtype)
        assert_bit_exact(host(v)[1], doubled.reshape(4, 2, 64), name="v")

    @pytest.mark.parametrize("table_dtype", ["bfloat16", "float16"])
    def test_a_table_in_the_model_dtype_is_read_as_fp32(self, backend, table_dtype):
        config = FusedKVConfig(2, 32, 16, "gptj")
        inputs = random_inputs(config, n_layers=2, total_ctx=4, max_position=64, seed=34)
        table = inputs.cos_sin_cache.astype(numpy_dtype(table_dtype))
        arrays = (inputs.kv, inputs.k_norm_weight, inputs.eps, table, inputs.positions)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in arrays), **static(config))
        expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config))
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
        # One conversion per element loaded: the same K as the table converted to fp32 beforehand.
        upcast = arrays[:3] + (table.astype(np.float32), inputs.positions)
        k_upcast, _ = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in upcast), **static(config))
        assert_bit_exact(k, host(k_upcast), name="k")

    @pytest.mark.parametrize("style, table_dtype", [("neox", "float32"), ("gptj", "bfloat16")])
    def test_per_layer_tables_rotate_each_layer_by_the_table_it_names(self, backend, style, table_dtype):
        config = FusedKVConfig(2, 32, 16, style)
        inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, seed=36)
        tables = per_layer_tables(64, 16, table_dtype)
        layer_rope_table = np.array([1, 0, 1], np.int32)
        arrays = inputs.arrays()[:3] + (tables, inputs.positions)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in arrays), **static(config),
                                                 layer_rope_table=backend.put(layer_rope_table))
        expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config),
                                                              layer_rope_table=layer_rope_table)
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
        # Each layer's K is what the one-table op gives with that layer's table.
        for table in (0, 1):
            one_table = arrays[:3] + (tables[table], inputs.positions)
            k_one, _ = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in one_table), **static(config))
            layers = layer_rope_table == table
            assert_bit_exact(host(k)[layers], host(k_one)[layers], name="k")

    @ieee_edge
    def test_a_table_index_outside_the_tables_gives_that_layer_all_nan_k_and_exact_v(self, backend):
        config = FusedKVConfig(2, 32, 32, "neox")
        inputs = random_inputs(config, n_layers=4, total_ctx=3, max_position=64, seed=37)
        layer_rope_table = np.array([2, 0, -1, 1], np.int32)
        arrays = inputs.arrays()[:3] + (per_layer_tables(64, 32, "float32"), inputs.positions)
        k, v = backend.kernel.fused_kv_norm_rope(*(backend.put(a) for a in arrays), **static(config),
                                                 layer_rope_table=backend.put(layer_rope_table))
        expected_k, expected_v = fused_kv_norm_rope_reference(*arrays, **static(config),
                                                              layer_rope_table=layer_rope_table)
        assert np.isnan(host(k)[[0, 2]].astype(np.float32)).all()
        assert not np.isnan(host(k)[[1, 3]].astype(np.float32)).any()
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)

    # Edge values (README, "Edge values"): each against the reference and the rule itself.

    @ieee_edge
    @pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
    def test_nan_and_inf_in_v_pass_through_bit_for_bit(self, backend, dtype, request):
        if backend.name == "jax" and backend.interpret and cpu_scatter_changes_bits(special_values(dtype)):
            # Interpret mode stores through an XLA scatter, which on the CPU quiets bf16 NaNs and
            # drops their payloads (sign kept) in some jax versions; the GPU kernel stores the
            # bits as loaded.
            request.applymarker(pytest.mark.xfail(strict=True, reason="XLA:CPU's bf16 scatter canonicalizes "
                                                                      "NaN payloads"))
        config, inputs = edge_inputs("neox", dtype)
        inputs.kv[0, 0, config.kv_size:config.kv_size + 5] = special_values(dtype)
        inputs.kv[1, 0, -5:] = special_values(dtype)
        k, v = run_op(backend, inputs.arrays(), config)
        assert_bit_exact(v[0, 0, 0, :5], special_values(dtype))
        assert not np.isnan(k.astype(np.float32)).any()

    @ieee_edge
    @pytest.mark.parametrize("style", ["neox", "gptj"])
    def test_nan_or_inf_in_a_k_head_gives_that_head_all_nan(self, backend, style):
        config, inputs = edge_inputs(style, "bfloat16")
        k_head(inputs.kv, config, 0, 0)[3] = np.nan
        k_head(inputs.kv, config, 1, 1)[20] = np.inf  # in the unrotated tail
        k_head(inputs.kv, config, 2, 0)[10] = -np.inf
        k, _ = run_op(backend, inputs.arrays(), config)
        poisoned_heads = {(0, 0), (1, 1), (2, 0)}
        for token in range(4):
            for head in range(2):
                assert all_nan(k, token, head) == ((token, head) in poisoned_heads)
        assert not np.isnan(k[:, 3].astype(np.float32)).any()

    @ieee_edge
    def test_k_squares_overflowing_fp32_give_that_head_all_nan(self, backend):
        config, inputs = edge_inputs("gptj", "float32")
        k_head(inputs.kv, config, 1, 0)[7] = 1e20  # finite, but its square is not
        k_head(inputs.kv, config, 2, 1)[:] = -2e19
        k, _ = run_op(backend, inputs.arrays(), config)
        assert all_nan(k, 1, 0) and all_nan(k, 2, 1)
        assert not np.isnan(k[0, 1, 1]).any() and not np.isnan(k[0, 2, 0]).any()

    @ieee_edge
    @pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
    def test_eps_zero_with_zero_or_denormal_k_gives_zeros(self, backend, dtype):
        config, inputs = edge_inputs("neox", dtype)
        inputs.eps[:] = 0.0
        k_head(inputs.kv, config, 0, 0)[:] = 0.0
        # Denormal in fp32 and bf16 alike; their squares underflow to zero.
        k_head(inputs.kv, config, 2, 1)[:] = 2.0 ** -130 * np.sign(np.arange(32) - 15.5)
        k, _ = run_op(backend, inputs.arrays(), config)
        k32 = k.astype(np.float32)
        assert (k32[0, 0, 0] == 0).all() and (k32[0, 2, 1] == 0).all()
        assert (k32[0, 0, 1] != 0).any() and not np.isnan(k32).any()

    @ieee_edge
    def test_fp16_output_beyond_its_range_is_inf(self, backend):
        config, inputs = edge_inputs("neox", "float16")
        inputs.k_norm_weight[:] = 1e6
        k, _ = run_op(backend, inputs.arrays(), config)
        k32 = k.astype(np.float32)
        assert np.isinf(k32).any() and not np.isnan(k32).any()

    @ieee_edge
    @pytest.mark.parametrize("style", ["neox", "gptj"])
    def test_huge_weights_in_the_unrotated_tail_give_inf_not_nan(self, backend, style):
        config, inputs = edge_inputs(style, "float32")
        inputs.k_norm_weight[:, 16:] = 3e38  # kn overflows fp32 wherever |k * inv_rms| > 1.14
        k, _ = run_op(backend, inputs.arrays(), config)
        assert np.isinf(k[..., 16:]).any() and not np.isnan(k).any()
        assert np.isfinite(k[..., :16]).all()


class TestOpInterpreted(TestOp):
    """``fused_kv_norm_rope``: the interpreted twin."""

    interpret = True


# The paged cache: each token's K and V go to its slot, the rest of the cache keeps its
# bits. (token, slot) pairs of `skipped_slots` put a token's slot outside the cache:
# negative (padding), just past the end, or an int64 that wraps into it if narrowed.
CACHE_CASES = {
    "d64-r32-neox-padding-and-past-the-end": CacheCase(call(2, 64, 32, "neox", n_layers=2, total_ctx=3,
                                                            max_position=16, seed=20), 2,
                                                       "int64", "bfloat16", "bfloat16", ((1, -1), (2, 5))),
    "d96-neox-int64-slots": CacheCase(call(3, 96, 96, "neox", n_layers=2, total_ctx=6, seed=21), 3,
                                      "int64", "bfloat16", "bfloat16", ((1, -1), (3, 9))),
    "d96-r32-gptj-fp32-one-layer": CacheCase(call(2, 96, 32, "gptj", n_layers=1, total_ctx=3, dtype="float32",
                                                  seed=22), 7, "int64", "float32", "float32", ((2, -5),)),
    "d192-r64-neox-fp16": CacheCase(call(1, 192, 64, "neox", n_layers=2, total_ctx=6, dtype="float16", seed=23), 3,
                                    "int32", "float16", "float16", ((1, -1), (3, 9))),
    "d16-fp8-caches-wrapping-int64-slot": CacheCase(call(2, 16, 16, "neox", n_layers=2, total_ctx=6, seed=24), 4,
                                                    "int64", FP8, FP8, ((2, -1), (5, 2**32 + 2))),
    "d16-r8-gptj-fp8-k-bf16-v-one-token-scale-on-host": CacheCase(
        call(1, 16, 8, "gptj", n_layers=2, total_ctx=1, on_host=True, seed=25), 9, "int32", FP8, "bfloat16", ()),
    "d96-r64-gptj-bf16-k-fp8-v-scale-on-host": CacheCase(
        call(2, 96, 64, "gptj", n_layers=2, total_ctx=5, on_host=True, seed=26), 3, "int32", "bfloat16", FP8,
        ((1, -1),)),
}


def cache_scales(n_layers: int, seed: int) -> np.ndarray:
    """fp32[2, n_layers] scales for K and V from 0.02 to 0.05 with random mantissas: a round
    scale divides bf16 values into exact fp8 ties, which Triton's interpreter rounds away
    from zero (the GPU, like the reference, to even)."""
    return np.random.default_rng(seed).uniform(0.02, 0.05, size=(2, n_layers)).astype(np.float32)


def run_cache_op(backend, arrays, slots, k_before, v_before, config, **scales):
    """``fused_kv_norm_rope_into_cache`` on host arrays; the host caches it returns and the reference's."""
    k_cache, v_cache = backend.put(k_before), backend.put(v_before)
    k, v = backend.kernel.fused_kv_norm_rope_into_cache(
        *(backend.put(a) for a in arrays), backend.put(slots), k_cache, v_cache, **static(config),
        **{name: backend.put(scale) for name, scale in scales.items()})
    if backend.writes_in_place:
        assert k is k_cache and v is v_cache, "caches are written in place"
    expected = fused_kv_norm_rope_into_cache_reference(*arrays, slots, k_before, v_before, **static(config),
                                                       **scales)
    return (host(k), host(v)), expected


class TestCacheOp:
    """``fused_kv_norm_rope_into_cache``: compiled kernels."""

    interpret = False

    @pytest.mark.parametrize("case", CACHE_CASES.values(), ids=CACHE_CASES)
    def test_each_token_is_written_at_its_slot_and_every_other_slot_keeps_its_bits(self, backend, case):
        check_cache_case(backend, case)

    @pytest.mark.parametrize("style", ["neox", "gptj"])
    def test_fp8_caches_hold_value_over_scale_rounded_once_and_saturated(self, backend, style):
        config = FusedKVConfig(2, 96, 64, style)
        inputs = random_inputs(config, n_layers=2, total_ctx=6, max_position=64, seed=27)
        # Some values past the fp8 range (the scales are at most 0.05): they must saturate to
        # +-448, not turn into NaN. In V given so; in K through weights that make |kn| ~ 100.
        inputs.kv[0, 0, config.kv_size:config.kv_size + 4] = [30.0, -30.0, 1.0, -1.0]
        inputs.k_norm_weight[0, :8] = 100.0
        slots = np.array([4, -1, 0, 9, 2, 8])
        before = poisoned((2, 9, 2, 96), FP8, seed=27)
        k_scale, v_scale = cache_scales(2, seed=27)
        (k, v), (expected_k, expected_v) = run_cache_op(backend, inputs.arrays(), slots, before, before, config,
                                                        k_scale=k_scale, v_scale=v_scale)
        assert np.nanmax(np.abs(k.astype(np.float32))) == np.nanmax(v.astype(np.float32)) == 448.0
        interpreted = backend.triton_interpreter
        assert_fp8_close(k, expected_k, triton_interpreter=interpreted)
        assert_fp8_close(v, expected_v, name="v", triton_interpreter=interpreted)
        # The comparison catches a cache quantized with scales 5% off.
        (k_off, v_off), _ = run_cache_op(backend, inputs.arrays(), slots, before, before, config,
                                         k_scale=k_scale * np.float32(1.05), v_scale=v_scale * np.float32(1.05))
        for name, got, expected in (("k", k_off, expected_k), ("v", v_off, expected_v)):
            assert not compare(got, expected, name=name, triton_interpreter=interpreted).ok

    @ieee_edge
    def test_fp8_caches_saturate_inf_and_big_values_and_keep_nan(self, backend):
        config = FusedKVConfig(2, 16, 8, "neox")
        inputs = random_inputs(config, n_layers=1, total_ctx=3, max_position=64, seed=28)
        inputs.kv[0, 0, config.kv_size:config.kv_size + 5] = [np.inf, -np.inf, 1e4, -1e4, np.nan]
        inputs.kv[0, 0, 5] = np.inf  # K head 0 of token 0: all NaN
        inputs.k_norm_weight[:, 8:] = 3e38  # the unrotated tail overflows to +-Inf: +-448
        slots = np.array([2, 0, 3], np.int32)
        before = poisoned((1, 4, 2, 16), FP8, seed=28)
        k_scale, v_scale = cache_scales(1, seed=28)
        (k, v), (expected_k, expected_v) = run_cache_op(backend, inputs.arrays(), slots, before, before, config,
                                                        k_scale=k_scale, v_scale=v_scale)
        if backend.triton_interpreter:
            k, v = forgive_interpreters_fp8_nan(k, expected_k), forgive_interpreters_fp8_nan(v, expected_v)
        assert_fp8_close(k, expected_k, triton_interpreter=backend.triton_interpreter)
        assert_fp8_close(v, expected_v, name="v", triton_interpreter=backend.triton_interpreter)
        k32, v32 = k.astype(np.float32), v.astype(np.float32)
        assert np.isnan(k32[0, 2, 0]).all() and not np.isnan(k32[0, 2, 1]).any()
        assert v32[0, 2, 0, :4].tolist() == [448, -448, 448, -448] and np.isnan(v32[0, 2, 0, 4])
        assert np.abs(k32[0, 0, :, 8:]).max() == 448  # token 1's tail

    def test_an_empty_context_leaves_the_caches_as_they_were(self, backend):
        config = FusedKVConfig(2, 64, 64)
        inputs = random_inputs(config, n_layers=2, total_ctx=0, max_position=64)
        k_before, v_before = poisoned((2, 4, 2, 64), "bfloat16", seed=1), poisoned((2, 4, 2, 64), "bfloat16", seed=2)
        (k, v), _ = run_cache_op(backend, inputs.arrays(), np.zeros(0, np.int32), k_before, v_before, config)
        assert_bit_exact(k, k_before, name="k_cache")
        assert_bit_exact(v, v_before, name="v_cache")

    def test_caches_without_slots_or_layers_are_accepted_and_nothing_is_written(self, backend):
        config = FusedKVConfig(2, 16, 16)
        for n_layers, num_slots in ((2, 0), (0, 4)):
            inputs = random_inputs(config, n_layers=n_layers, total_ctx=3, max_position=16)
            k_before = poisoned((n_layers, num_slots, 2, 16), "bfloat16", seed=4)
            v_before = poisoned((n_layers, num_slots, 2, 16), "bfloat16", seed=5)
            (k, v), (expected_k, expected_v) = run_cache_op(backend, inputs.arrays(), np.array([0, 1, -1]),
                                                            k_before, v_before, config)
            assert_bit_exact(k, expected_k, name="k_cache")
            assert_bit_exact(v, expected_v, name="v_cache")


    @ieee_edge
    def test_fp8_v_codes_are_the_correctly_rounded_quotient_at_every_scale_in_range(self, backend):
        # One layer per scale: a short decimal (XLA's division by a broadcast scalar is a
        # product with its reciprocal, a code off), the range's ends (a reciprocal of 2**100
        # and more), and a random mantissa near each end. V spans codes around its scale.
        scales = np.array([0.9, FP8_SCALE_MIN, FP8_SCALE_MAX, FP8_SCALE_MIN * 1.37, FP8_SCALE_MAX / 1.37],
                          np.float32)
        config = FusedKVConfig(2, 64, 64, "neox")
        inputs = random_inputs(config, n_layers=len(scales), total_ctx=8, max_position=64, seed=29)
        rng = np.random.default_rng(29)
        magnitudes = np.exp2(rng.uniform(-6, 9.5, size=(8, len(scales), config.kv_size)))
        signs = rng.choice([-1.0, 1.0], size=magnitudes.shape)
        v = (signs * magnitudes * scales[None, :, None].astype(np.float64)).astype(numpy_dtype("bfloat16"))
        if not backend.triton_interpreter:  # it converts quotients below 2**-9 wrongly (README)
            v[0, :, :4] = np.float32(1e-39) * np.array([1, -1, 3, -3], np.float32)  # denormals: code 0
        inputs.kv[:, :, config.kv_size:] = v
        slots = np.arange(8)
        before = poisoned((len(scales), 8, 2, 64), FP8, seed=29)
        (_, got), (_, expected) = run_cache_op(backend, inputs.arrays(), slots, before, before, config,
                                               k_scale=scales, v_scale=scales)
        if backend.triton_interpreter:
            got = forgive_interpreters_fp8_ties(got, expected, v.astype(np.float32).transpose(1, 0, 2)
                                                .reshape(expected.shape) / scales[:, None, None, None])
        exact = Tolerance(ulps=0, atol=0.0, reason="the one correctly rounded quotient, rounded once")
        assert_close(got, expected, name="v", tolerance=exact, triton_interpreter=backend.triton_interpreter)

    def test_caches_of_a_draft_without_k_norm_and_with_a_v_multiplier_hold_the_reference(self, backend):
        config = FusedKVConfig(2, 32, 16, "gptj")
        inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=64, seed=33)
        arrays = (inputs.kv, None, None, inputs.cos_sin_cache, inputs.positions)
        slots, multiplier = np.array([3, -1, 0, 6, 2]), np.array([0.65, 0.7], np.float32)
        for cache_dtype, scales in (("bfloat16", {}), (FP8, dict(zip(("k_scale", "v_scale"), cache_scales(2, 33))))):
            before = poisoned((2, 7, 2, 32), cache_dtype, seed=33)
            k_cache, v_cache = backend.put(before), backend.put(before.copy())
            k, v = backend.kernel.fused_kv_norm_rope_into_cache(
                *(None if a is None else backend.put(a) for a in arrays), backend.put(slots), k_cache, v_cache,
                **static(config), v_multiplier=backend.put(multiplier),
                **{name: backend.put(scale) for name, scale in scales.items()})
            expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
                *arrays, slots, before, before, **static(config), v_multiplier=multiplier, **scales)
            interpreted = backend.triton_interpreter
            assert_close(host(k), expected_k, name="k_cache", triton_interpreter=interpreted and bool(scales))
            assert_close(host(v), expected_v, name="v_cache", triton_interpreter=interpreted and bool(scales))

    @ieee_edge
    def test_fp8_scale_outside_its_range_writes_nan_for_that_layer_only(self, backend):
        scales = np.array([1e-40, 0.0, -0.5, np.inf, np.nan, FP8_SCALE_MAX * 2, FP8_SCALE_MIN / 2, 0.0371],
                          np.float32)
        config = FusedKVConfig(1, 16, 16, "neox")
        inputs = random_inputs(config, n_layers=len(scales), total_ctx=3, max_position=64, seed=30)
        slots = np.array([2, 0, 3], np.int32)
        before = poisoned((len(scales), 4, 1, 16), FP8, seed=30)
        (k, v), (expected_k, expected_v) = run_cache_op(backend, inputs.arrays(), slots, before, before, config,
                                                        k_scale=scales, v_scale=scales)
        assert np.isnan(expected_v[:-1, slots].astype(np.float32)).all()
        assert not np.isnan(expected_v[-1, slots].astype(np.float32)).any()
        if backend.triton_interpreter:
            k, v = forgive_interpreters_fp8_nan(k, expected_k), forgive_interpreters_fp8_nan(v, expected_v)
        assert_fp8_close(k, expected_k, triton_interpreter=backend.triton_interpreter)
        assert_fp8_close(v, expected_v, name="v", triton_interpreter=backend.triton_interpreter)


    def test_a_table_in_the_model_dtype_serves_the_cache_variant(self, backend):
        config = FusedKVConfig(2, 32, 32, "neox")
        inputs = random_inputs(config, n_layers=2, total_ctx=4, max_position=64, seed=35)
        arrays = inputs.arrays()[:3] + (inputs.cos_sin_cache.astype(numpy_dtype("bfloat16")), inputs.positions)
        slots = np.array([4, -1, 0, 2])
        before = poisoned((2, 6, 2, 32), "bfloat16", seed=35)
        (k, v), (expected_k, expected_v) = run_cache_op(backend, arrays, slots, before, before, config)
        assert_close(k, expected_k, name="k_cache")
        assert_bit_exact(v, expected_v, name="v_cache")


    def test_per_layer_tables_serve_the_cache_variant(self, backend):
        config = FusedKVConfig(1, 16, 16, "gptj")
        inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, seed=38)
        arrays = inputs.arrays()[:3] + (per_layer_tables(64, 16, "float16"), inputs.positions)
        layer_rope_table = np.array([0, 3, 1], np.int32)
        slots = np.array([4, -1, 0, 2])
        before = poisoned((3, 6, 1, 16), "bfloat16", seed=38)
        k_cache, v_cache = backend.put(before), backend.put(before.copy())
        k, v = backend.kernel.fused_kv_norm_rope_into_cache(
            *(backend.put(a) for a in arrays), backend.put(slots), k_cache, v_cache, **static(config),
            layer_rope_table=backend.put(layer_rope_table))
        expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
            *arrays, slots, before, before, **static(config), layer_rope_table=layer_rope_table)
        assert np.isnan(host(k)[1, [4, 0, 2]].astype(np.float32)).all()
        assert_close(host(k), expected_k, name="k_cache")
        assert_bit_exact(host(v), expected_v, name="v_cache")

class TestCacheOpInterpreted(TestCacheOp):
    """``fused_kv_norm_rope_into_cache``: the interpreted twin."""

    interpret = True


# Refusals: a good call of 3 tokens and 2 layers into given outputs (or a cache of 5
# slots), changed in one argument; the message word for word; nothing written.
REFUSED = FusedKVConfig(2, 64, 32)


def good_call(total_ctx: int = 3) -> dict:
    """Host arguments of an accepted call into poisoned outputs."""
    inputs = random_inputs(REFUSED, n_layers=2, total_ctx=total_ctx, max_position=16, seed=12)
    shape = REFUSED.output_shape(2, total_ctx)
    return dict(zip(ARGUMENTS, inputs.arrays()), k_out=poisoned(shape, "bfloat16", seed=1),
                v_out=poisoned(shape, "bfloat16", seed=2))


def good_cache_call() -> dict:
    """Host arguments of an accepted call into poisoned caches of 5 slots."""
    arguments = good_call()
    del arguments["k_out"], arguments["v_out"]
    return dict(arguments, cache_loc=np.array([4, -1, 0]), k_cache=poisoned((2, 5, 2, 64), "bfloat16", seed=3),
                v_cache=poisoned((2, 5, 2, 64), "bfloat16", seed=4))


# name: (the change to the good call: host arguments replaced or static settings, the message).
BAD_CALLS = {
    "kv_not_3d": (dict(kv=lambda a: a["kv"][:, 0]),
                  "Invalid stacked fused KV projection shape: got (3, 256), expected 3D "
                  "[total_ctx, n_layers, kv_size*2]."),
    "kv_trailing_dim": (dict(kv=lambda a: a["kv"][:, :, :-2]),
                        "Invalid fused KV projection shape: got (3, 2, 254), expected trailing dim 256."),
    "rotary_dim_odd": (dict(rotary_dim=31), "Invalid fused KV rotary/head dim pair: rotary_dim=31, head_dim=64."),
    "rotary_dim_too_large": (dict(rotary_dim=66),
                             "Invalid fused KV rotary/head dim pair: rotary_dim=66, head_dim=64."),
    "k_norm_weight_shape": (dict(k_norm_weight=lambda a: a["k_norm_weight"][:, :32]),
                            "Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 32), "
                            "expected (2, 64)."),
    "eps_shape": (dict(eps=lambda a: a["eps"][:1]),
                  "Invalid stacked eps shape for fused KV materialization: got (1,), expected (2,)."),
    "rope_style": (dict(rope_style="llama"),
                   "Invalid rope_style for fused KV materialization: got 'llama', expected one of "
                   "('neox', 'gptj')."),
    "kv_dtype": (dict(kv=lambda a: a["kv"].astype(np.int32)),
                 "Invalid kv dtype for fused KV materialization: got int32, expected one of "
                 "('bfloat16', 'float16', 'float32')."),
    "eps_dtype_float64": (dict(eps=lambda a: a["eps"].astype(np.float64)),
                          "Invalid eps dtype for fused KV materialization: got float64, expected one of "
                          "('float32',)."),
    "eps_dtype_float16": (dict(eps=lambda a: a["eps"].astype(np.float16)),
                          "Invalid eps dtype for fused KV materialization: got float16, expected one of "
                          "('float32',)."),
    "cos_sin_cache_dtype": (dict(cos_sin_cache=lambda a: a["cos_sin_cache"].astype(np.float64)),
                            "Invalid cos_sin_cache dtype for fused KV materialization: got float64, expected "
                            "one of ('float32', 'bfloat16', 'float16')."),
    "cos_sin_cache_width": (dict(cos_sin_cache=lambda a: a["cos_sin_cache"][:, :16]),
                            "Invalid cos_sin_cache shape for fused KV materialization: got (16, 16), "
                            "expected (max_pos, 32) with max_pos > 0."),
    "positions_length": (dict(positions=lambda a: a["positions"][:2]),
                         "Invalid positions shape for fused KV materialization: got (2,), expected (3,)."),
    "positions_dtype": (dict(positions=lambda a: a["positions"].astype(np.float32)),
                        "Invalid positions dtype for fused KV materialization: got float32, expected one of "
                        "('int32', 'int64')."),
    "k_out_shape": (dict(k_out=lambda a: a["k_out"][:, :2]),
                    "Invalid k_out shape for fused KV materialization: got (2, 2, 2, 64), expected (2, 3, 2, 64)."),
    "v_out_dtype": (dict(v_out=lambda a: a["v_out"].astype(np.float32)),
                    "Invalid v_out device/dtype for fused KV materialization: got device={device}, "
                    "dtype=float32, expected device={device}, dtype=bfloat16."),
    "position_past_the_table_checked": (
        dict(positions=lambda a: np.array([3, 16, 0], a["positions"].dtype), check_positions=True),
        "Invalid positions for fused KV materialization: got values outside [0, 16) (min 0, max 16), "
        "expected every position in [0, 16)."),
    "negative_position_checked": (
        dict(positions=lambda a: np.array([5, -1, 2], a["positions"].dtype), check_positions=True),
        "Invalid positions for fused KV materialization: got values outside [0, 16) (min -1, max 5), "
        "expected every position in [0, 16)."),
    "eps_without_k_norm_weight": (dict(k_norm_weight=lambda a: None),
                                  "Invalid eps for fused KV materialization: got an array without a "
                                  "k_norm_weight, expected None (eps is the K-norm's epsilon; k_norm_weight=None "
                                  "means no K-norm)."),
    "k_norm_weight_without_eps": (dict(eps=lambda a: None),
                                  "Invalid eps for fused KV materialization: got None with a k_norm_weight, "
                                  "expected float32(2,)."),
    "v_multiplier_shape": (dict(v_multiplier=lambda a: np.ones(3, np.float32)),
                           "Invalid v_multiplier for fused KV materialization: got float32(3,), expected "
                           "float32(2,) (a per-layer multiplier of V, or None)."),
    "v_multiplier_dtype": (dict(v_multiplier=lambda a: np.ones(2, np.float16)),
                           "Invalid v_multiplier for fused KV materialization: got float16(2,), expected "
                           "float32(2,) (a per-layer multiplier of V, or None)."),
    "layer_rope_table_with_one_table": (
        dict(layer_rope_table=lambda a: np.zeros(2, np.int32)),
        "Invalid layer_rope_table for fused KV materialization: got an array with a 2-D cos_sin_cache, expected "
        "None (one table serves every layer; a 3-D cos_sin_cache [n_tables, max_pos, rotary_dim] takes a table "
        "index per layer)."),
    "tables_without_layer_rope_table": (
        dict(cos_sin_cache=lambda a: np.stack([a["cos_sin_cache"]] * 2)),
        "Invalid layer_rope_table for fused KV materialization: got None with a 3-D cos_sin_cache of 2 tables, "
        "expected int32(2,) naming each layer's table."),
    "block_tokens_3": (dict(block_tokens=3),
                       "Invalid block_tokens for fused KV materialization: got 3, expected a power of two."),
}

# name: (the change to the good cache call, the message word for word).
BAD_CACHE_CALLS = {
    "kv_trailing_dim": (dict(kv=lambda a: a["kv"][:, :, :-2]),
                        "Invalid fused KV projection shape: got (3, 2, 254), expected trailing dim 256."),
    "eps_shape": (dict(eps=lambda a: a["eps"][:1]),
                  "Invalid stacked eps shape for fused KV materialization: got (1,), expected (2,)."),
    "cache_loc_dtype": (dict(cache_loc=lambda a: a["cache_loc"].astype(np.float32)),
                        "Invalid cache_loc dtype for fused KV materialization: got float32, expected one of "
                        "('int32', 'int64')."),
    "cache_loc_length": (dict(cache_loc=lambda a: a["cache_loc"][:2]),
                         "Invalid cache_loc shape for fused KV materialization: got (2,), expected (3,)."),
    "k_cache_heads": (dict(k_cache=lambda a: a["k_cache"][:, :, :1]),
                      "Invalid k_cache shape for fused KV materialization: got (2, 5, 1, 64), expected "
                      "(n_layers, num_slots, num_kv_heads, head_dim) = (2, num_slots, 2, 64)."),
    "v_cache_slots": (dict(v_cache=lambda a: a["v_cache"][:, :4]),
                      "Invalid v_cache shape for fused KV materialization: got (2, 4, 2, 64), expected the "
                      "shape of k_cache (2, 5, 2, 64)."),
    "cache_dtype": (dict(v_cache=lambda a: a["v_cache"].astype(np.float32)),
                    "Invalid v_cache device/dtype for fused KV materialization: got device={device}, "
                    "dtype=float32, expected device={device}, dtype one of ('bfloat16', 'float8_e4m3fn')."),
    "scale_for_a_bf16_cache": (dict(k_scale=lambda a: np.ones(2, np.float32)),
                               "Invalid k_scale for fused KV materialization: got a scale, expected None for a "
                               "cache that is not float8_e4m3fn."),
    "fp8_cache_without_scale": (dict(k_cache=lambda a: a["k_cache"].astype(numpy_dtype(FP8))),
                                "Invalid k_scale for fused KV materialization: got None, expected float32(2,) "
                                "for a float8_e4m3fn cache."),
    "num_warps_3": (dict(num_warps=3),
                    "Invalid num_warps for fused KV materialization: got 3, expected a power of two."),
}

# entry point: (its good call, its bad calls, the buffers it writes).
ENTRY_POINTS = {
    "fused_kv_norm_rope": (good_call, BAD_CALLS, ("k_out", "v_out")),
    "fused_kv_norm_rope_into_cache": (good_cache_call, BAD_CACHE_CALLS, ("k_cache", "v_cache")),
}

# The sizes that are not positive ints, refused before any work.
BAD_SIZES = {
    "heads-2.5": (dict(num_kv_heads=2.5), TypeError,
                  "Invalid num_kv_heads for fused KV materialization: got 2.5 (float), expected a positive int."),
    "heads-2.0": (dict(num_kv_heads=2.0), TypeError,
                  "Invalid num_kv_heads for fused KV materialization: got 2.0 (float), expected a positive int."),
    "heads-True": (dict(num_kv_heads=True), TypeError,
                   "Invalid num_kv_heads for fused KV materialization: got True (bool), expected a positive int."),
    "heads-str": (dict(num_kv_heads="2"), TypeError,
                  "Invalid num_kv_heads for fused KV materialization: got '2' (str), expected a positive int."),
    "heads-0": (dict(num_kv_heads=0), ValueError,
                "Invalid num_kv_heads for fused KV materialization: got 0, expected a positive int."),
    "head_dim-str": (dict(head_dim="64"), TypeError,
                     "Invalid head_dim for fused KV materialization: got '64' (str), expected a positive int."),
    "head_dim-True": (dict(head_dim=True), TypeError,
                      "Invalid head_dim for fused KV materialization: got True (bool), expected a positive int."),
    "rotary-float": (dict(rotary_dim=32.0), TypeError,
                     "Invalid rotary_dim for fused KV materialization: got 32.0 (float), expected an even int in "
                     "[2, 64]."),
}

OVERLAP = "got a buffer overlapping {}, expected outputs that overlap neither each other nor kv."


def changed(arguments: dict, change: dict) -> tuple[dict, dict]:
    """``(host arguments, static settings)`` of the good call with ``change`` made."""
    arguments, settings = dict(arguments), static(REFUSED)
    for name, value in change.items():
        if callable(value):
            arguments[name] = value(arguments)
        else:
            settings[name] = value
    return arguments, settings


def put_all(backend, arguments: dict) -> dict:
    return {name: None if array is None else backend.put(array) for name, array in arguments.items()}


class TestRefusals:
    """Bad calls of both entry points: compiled kernels (what a refusal leaves behind
    depends on where the buffers live)."""

    interpret = False

    @pytest.mark.parametrize("entry_point, name", [(entry_point, name) for entry_point, (_, bad_calls, _) in
                                                   ENTRY_POINTS.items() for name in bad_calls])
    def test_a_bad_call_raises_its_message_and_writes_nothing(self, backend, entry_point, name):
        good, bad_calls, outputs = ENTRY_POINTS[entry_point]
        change, message = bad_calls[name]
        arguments, settings = changed(good(), change)
        given = put_all(backend, arguments)
        with pytest.raises(ValueError, match=backend.error_pattern(message.format(device=backend.device_name))):
            getattr(backend.kernel, entry_point)(**given, **settings)
        for output in outputs:
            backend.assert_untouched(given[output], arguments[output], name=output)

    def test_an_empty_context_is_still_validated(self, backend):
        arguments = put_all(backend, good_call(total_ctx=0))
        with pytest.raises(ValueError, match=backend.error_pattern(
                "Invalid stacked k_norm_weight shape for fused KV materialization: got (1, 64), "
                "expected (2, 64).")):
            backend.kernel.fused_kv_norm_rope(**{**arguments, "k_norm_weight": arguments["k_norm_weight"][:1]},
                                              **static(REFUSED))

    @pytest.mark.parametrize("total_ctx", [3, 64])  # from 64 tokens the Triton tile divides by the heads
    @pytest.mark.parametrize("name", BAD_SIZES)
    def test_sizes_that_are_not_positive_ints_are_refused_before_any_work(self, backend, name, total_ctx):
        sizes, error, message = BAD_SIZES[name]
        arguments = good_call(total_ctx)
        given = put_all(backend, arguments)
        with pytest.raises(error, match=backend.error_pattern(message)):
            backend.kernel.fused_kv_norm_rope(**given, **{**static(REFUSED), **sizes})
        for output in ("k_out", "v_out"):
            backend.assert_untouched(given[output], arguments[output], name=output)

    @pytest.mark.parametrize("name", ["kv", "positions", "v_out"])
    def test_arrays_of_another_framework_are_refused_with_a_pointer_to_interop(self, backend, name):
        arguments = good_call()
        given = put_all(backend, arguments)
        if name == "positions":
            given[name], got = arguments[name].tolist(), "list"
        else:
            given[name], got = backend.foreign(arguments[name]), backend.foreign_type
        message = f"Invalid {name} for fused KV materialization: got {got}, expected {backend.takes}."
        with pytest.raises(TypeError, match=backend.error_pattern(message)):
            backend.kernel.fused_kv_norm_rope(**given, **static(REFUSED))
        backend.assert_untouched(given["k_out"], arguments["k_out"], name="k_out")

    def test_another_frameworks_cache_is_refused_with_a_pointer_to_interop(self, backend):
        arguments = good_cache_call()
        given = dict(put_all(backend, arguments), v_cache=backend.foreign(arguments["v_cache"]))
        message = (f"Invalid v_cache for fused KV materialization: got {backend.foreign_type}, "
                   f"expected {backend.takes}.")
        with pytest.raises(TypeError, match=backend.error_pattern(message)):
            backend.kernel.fused_kv_norm_rope_into_cache(**given, **static(REFUSED))
        backend.assert_untouched(given["k_cache"], arguments["k_cache"], name="k_cache")

    @pytest.mark.parametrize("entry_point", ENTRY_POINTS)
    def test_one_array_as_both_outputs_is_refused_on_every_call_and_nothing_is_written(self, backend, entry_point):
        good, _, (first, second) = ENTRY_POINTS[entry_point]
        call = getattr(backend.kernel, entry_point)
        arguments = good()
        given = put_all(backend, arguments)
        # The same metadata with separate outputs first: accepted (and, in torch, remembered).
        call(**given, **static(REFUSED))
        given[first] = backend.put(arguments[first])
        given[second] = given[first]
        message = f"Invalid {second} for fused KV materialization: " + OVERLAP.format(first)
        for _ in range(2):
            with pytest.raises(ValueError, match=backend.error_pattern(message)):
                call(**given, **static(REFUSED))
        backend.assert_untouched(given[first], arguments[first], name=first)
        backend.assert_untouched(given["kv"], arguments["kv"], name="kv")


class TestRefusalsInterpreted(TestRefusals):
    """Bad calls of both entry points: the interpreted twin."""

    interpret = True


@pytest.mark.gpu
def test_torch_twins_pass_under_the_triton_interpreter():
    # Triton picks its interpreter once per process, at import: where this process compiles
    # the kernel, the torch twins of the contract suite run in a process of their own.
    pytest.importorskip("torch")
    from backends import TorchBackend

    if TorchBackend.unavailable(interpret=False):
        pytest.skip("this process runs the interpreted twins itself")
    root = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "Interpreted and torch",
         *(str(path) for path in sorted(root.glob("tests/test_contract_*.py")))],
        cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
