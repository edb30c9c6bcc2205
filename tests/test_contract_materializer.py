"""The materializer's contract, one suite for both ``FusedKVMaterializer`` classes: three
result paths (returned, per-layer callback, paged cache), fp8 and mixed caches, refusals
word for word, against interop's reference.

The op's exactness is checked on the materializer's own GEMM output (``project``), since
a framework may round its bf16 GEMM differently from NumPy's fp32 one; the whole path is
checked against the fp32 NumPy path under the looser END_TO_END_TOLERANCE. As in
``test_contract_op.py``, the class runs compiled kernels on a GPU machine and its
interpreted twin everywhere. What only one materializer has (torch: workspace reuse,
per-layer cache views, given outputs, CUDA graphs; jax: donation under jit, refused
per-layer lists) stays in its own file.
"""

import dataclasses
import re

import numpy as np
import pytest

from backends import host
from cases import FP8, poisoned
from interop.core.arrays import numpy_dtype
from interop.core.materializer import RopeConfig, projection_reference, stacked_op_arrays
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_reference, rope_cos_sin_cache
from interop.core.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, Tolerance, assert_bit_exact, assert_close, assert_fp8_close

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

OP = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
NUM_SLOTS = 12
POISON = -3.5  # exactly representable in bf16 and fp8, and not a value the op writes here
# Per-layer scales from 0.01 to 1 with random mantissas: a round scale (a power of two, or
# a short decimal) divides bf16 values into exact fp8 ties, which Triton's interpreter
# rounds away from zero (the GPU, like the reference, to even).
SCALES = (2.0 ** np.random.default_rng(8).uniform(-6.6, 0, (2, 3))).astype(np.float32)


@dataclasses.dataclass
class Setup:
    backend: object
    case: object
    materializer: object
    ctx_hidden: object
    positions: object

    def poisoned_cache(self, dtype: str = "bfloat16", num_slots: int = NUM_SLOTS) -> np.ndarray:
        config = self.materializer.config
        shape = (config.n_layers, num_slots, config.op.num_kv_heads, config.op.head_dim)
        return np.full(shape, POISON, np.float32).astype(numpy_dtype(dtype))

    def kv(self) -> np.ndarray:
        """The materializer's own GEMM output, on the host."""
        return host(self.materializer.project(self.ctx_hidden))

    def into_cache(self, cache_loc, k_before, v_before, **options):
        """``materialize_into_cache`` into caches holding ``k_before``, ``v_before``; the updated caches."""
        k_cache, v_cache = self.backend.put(k_before), self.backend.put(v_before)
        k, v = self.materializer.materialize_into_cache(self.ctx_hidden, self.positions, cache_loc, k_cache, v_cache,
                                                        **options)
        if self.backend.writes_in_place:
            assert k is k_cache and v is v_cache, "caches are written in place"
        return host(k), host(v)


def setup(backend, op=OP, *, n_layers=3, hidden=64, total_ctx=8, position_dtype="int32", positions_on_host=False,
          seed=0, dtype="bfloat16", k_norm=True, v_multiplier=False, kv_bias=False, **materializer_options) -> Setup:
    case = random_case(op, n_layers=n_layers, hidden=hidden, total_ctx=total_ctx, max_position=256,
                       dtype=dtype, position_dtype=position_dtype, seed=seed, k_norm=k_norm, v_multiplier=v_multiplier,
                       kv_bias=kv_bias)
    layers = [_on(backend, layer) for layer in case.layers]
    return Setup(backend, case, backend.kernel.FusedKVMaterializer(layers, **materializer_options),
                 backend.put(case.ctx_hidden), backend.put_small(case.positions, positions_on_host))


def _on(backend, layer):
    """The layer with its arrays on the backend."""
    arrays = {field: getattr(layer, field) for field in ("kv_proj_weight", "kv_proj_bias", "k_norm_weight")}
    return dataclasses.replace(layer, **{field: None if array is None else backend.put(array)
                                         for field, array in arrays.items()})


# kv is rounded to bfloat16 once (in the GEMM's epilogue) or twice (the dot, then the sum with
# the bias): 1 ulp of the sum, and half an ulp of a dot below 8 in magnitude, 2**-7.
BIASED_GEMM_TOLERANCE = Tolerance(ulps=1, atol=2.0 ** -7, reason="the dot may be rounded before its bias is added")

REAL_OP = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128)

CASES = {
    # (op, n_layers, total_ctx, position dtype, positions on the host): the common shape, then the odd ones.
    "draft-like": (OP, 3, 8, "int32", False),
    "d96-gptj-one-token-of-one-layer-int64-on-host": (
        FusedKVConfig(num_kv_heads=1, head_dim=96, rotary_dim=32, rope_style="gptj"), 1, 1, "int64", True),
    "d16-r8-three-heads-int64": (FusedKVConfig(num_kv_heads=3, head_dim=16, rotary_dim=8), 2, 5, "int64", False),
}


class TestMaterializer:
    """``FusedKVMaterializer``: compiled kernels."""

    interpret = False

    @pytest.mark.parametrize("op, n_layers, total_ctx, position_dtype, on_host", CASES.values(), ids=CASES)
    def test_returned_kv_is_the_op_on_the_materializers_own_gemm(self, backend, op, n_layers, total_ctx,
                                                                position_dtype, on_host):
        # Host int64 positions go in as given (jax: the materializer narrows them before jit).
        s = setup(backend, op, n_layers=n_layers, total_ctx=total_ctx, position_dtype=position_dtype,
                  positions_on_host=on_host)
        kv = s.kv()
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = s.case.op_reference(kv)
        assert k.shape == v.shape == (n_layers, total_ctx, op.num_kv_heads, op.head_dim)
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)

    @pytest.mark.parametrize("k_norm, v_multiplier", [(False, False), (False, True), (True, True)],
                             ids=["no-k-norm", "no-k-norm-v-multiplier", "v-multiplier"])
    def test_drafts_without_a_k_norm_or_with_a_value_scale_match_the_reference(self, backend, k_norm, v_multiplier):
        s = setup(backend, seed=4, k_norm=k_norm, v_multiplier=v_multiplier)
        kv = s.kv()
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = s.case.op_reference(kv)
        assert_close(k, k_expected)
        if backend.triton_interpreter and v_multiplier:  # it rounds to bf16 by truncation (README)
            assert_close(v, v_expected, name="v")
        else:
            assert_bit_exact(v, v_expected)
        k_cache, v_cache = s.into_cache(backend.put(np.arange(8)[::-1].copy()), poisoned((3, 9, 2, 32), "bfloat16", seed=4),
                                        poisoned((3, 9, 2, 32), "bfloat16", seed=5))
        assert_close(k_cache[:, 7::-1], k_expected, name="k_cache")
        assert_close(v_cache[:, 7::-1], v_expected, name="v_cache")

    def test_layers_that_disagree_on_the_k_norm_or_the_value_scale_are_refused_naming_the_layer(self, backend):
        for field, message in (
                ("k_norm_weight", "K-norm got none, expected a k_norm_weight as in layer 0."),
                ("v_multiplier", "v_multiplier got a v_multiplier, expected none as in layer 0.")):
            case = random_case(OP, n_layers=3, hidden=64, total_ctx=0)
            layers = [dataclasses.replace(layer, kv_proj_weight=backend.put(layer.kv_proj_weight),
                                          k_norm_weight=backend.put(layer.k_norm_weight)) for layer in case.layers]
            change = dict(k_norm_weight=None, eps=None) if field == "k_norm_weight" else dict(v_multiplier=0.7)
            layers[2] = dataclasses.replace(layers[2], **change)
            with pytest.raises(ValueError, match=re.escape(f"Invalid fused KV materializer layer 2: {message}")):
                backend.kernel.FusedKVMaterializer(layers)

    def test_a_projection_bias_is_added_by_the_gemm_on_every_path(self, backend):
        s = setup(backend, seed=6, kv_bias=True)
        kv = s.kv()
        kv_expected = projection_reference(s.case.layers, s.case.ctx_hidden).astype(kv.dtype)
        assert_close(kv, kv_expected, name="kv", tolerance=BIASED_GEMM_TOLERANCE)
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = s.case.op_reference(kv)
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
        k_e2e, v_e2e = s.case.end_to_end_reference()
        assert_close(k, k_e2e, tolerance=END_TO_END_TOLERANCE)
        assert_close(v, v_e2e, name="v", tolerance=END_TO_END_TOLERANCE)
        cache_loc = np.arange(8)[::-1].copy()
        k_cache, v_cache = s.into_cache(backend.put(cache_loc), s.poisoned_cache(), s.poisoned_cache())
        assert_close(k_cache[:, 7::-1], k_expected, name="k_cache")
        assert_bit_exact(v_cache[:, 7::-1], v_expected, name="v_cache")

    @pytest.mark.parametrize("change, message", [
        (lambda layer, backend: dict(kv_proj_bias=None),
         "kv_proj_bias got none, expected a kv_proj_bias as in layer 0."),
        (lambda layer, backend: dict(kv_proj_bias=layer.kv_proj_bias[:64]),
         "kv_proj_bias shape got (64,), expected (128,) = (2*num_kv_heads*head_dim,)."),
        (lambda layer, backend: dict(kv_proj_bias=backend.put(host(layer.kv_proj_bias).astype(np.float32))),
         "kv_proj_bias dtype got float32, expected bfloat16, the kv_proj_weight dtype."),
    ], ids=["missing-in-one-layer", "shape", "dtype"])
    def test_a_bad_projection_bias_is_refused_naming_the_layer(self, backend, change, message):
        layers = _layers_on(backend, n_layers=3, kv_bias=True)
        layers[2] = dataclasses.replace(layers[2], **change(layers[2], backend))
        message = f"Invalid fused KV materializer layer 2: {message}"
        with pytest.raises(ValueError, match=backend.error_pattern(message)):
            backend.kernel.FusedKVMaterializer(layers)

    def test_end_to_end_matches_the_fp32_numpy_path(self, backend):
        s = setup(backend, seed=3)
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = s.case.end_to_end_reference()
        assert_close(k, k_expected, tolerance=END_TO_END_TOLERANCE)
        assert_close(v, v_expected, name="v", tolerance=END_TO_END_TOLERANCE)

    def test_project_is_the_stacked_gemm_viewed_per_layer(self, backend):
        s = setup(backend)
        kv = s.materializer.project(s.ctx_hidden)
        assert kv.shape == (8, 3, 2 * OP.kv_size)
        for layer, layer_kv in enumerate(s.case.layers):
            expected = backend.gemm(s.ctx_hidden, backend.put(layer_kv.kv_proj_weight))
            assert_bit_exact(kv[:, layer], expected, name=f"kv of layer {layer}")

    def test_callback_gets_every_layer_in_order_with_the_returned_values(self, backend):
        s = setup(backend, seed=1)
        received = []
        # torch hands views of a staging buffer it reuses: copied at once, as the docstring says.
        s.materializer.materialize_layers(s.ctx_hidden, s.positions,
                                          lambda layer, k, v: received.append((layer, host(k), host(v))))
        k_expected, v_expected = s.case.op_reference(s.kv())
        assert [layer for layer, _, _ in received] == [0, 1, 2]
        for layer, k, v in received:
            assert k.shape == v.shape == (8, OP.num_kv_heads, OP.head_dim)
            assert_close(k, k_expected[layer], name=f"k of layer {layer}")
            assert_bit_exact(v, v_expected[layer], name=f"v of layer {layer}")

    def test_into_cache_writes_each_tokens_slot_and_leaves_every_other_slot_untouched(self, backend):
        s = setup(backend, seed=2)
        k_before, v_before = s.poisoned_cache(), s.poisoned_cache()
        # Two padding slots, one past the end; written slots are distinct.
        cache_loc = np.array([7, -1, 0, NUM_SLOTS, 11, -5, 3, 5])
        k, v = s.into_cache(backend.put(cache_loc), k_before, v_before)
        k_expected, v_expected = s.case.op_reference(s.kv(), cache_loc=cache_loc, k_cache=k_before, v_cache=v_before)
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
        written = [7, 0, 11, 3, 5]
        untouched = [slot for slot in range(NUM_SLOTS) if slot not in written]
        assert_bit_exact(k[:, untouched], k_before[:, untouched], name="k padding")
        assert_bit_exact(v[:, untouched], v_before[:, untouched], name="v padding")
        assert (k[:, written].astype(np.float32) != POISON).any()

    @pytest.mark.parametrize("k_dtype, v_dtype", [(FP8, FP8), (FP8, "bfloat16"), ("bfloat16", FP8)],
                             ids=["fp8-both", "fp8-k-bf16-v", "bf16-k-fp8-v"])
    def test_fp8_caches_are_quantized_with_their_own_per_layer_scales(self, backend, k_dtype, v_dtype):
        s = setup(backend, seed=5)
        k_before, v_before = s.poisoned_cache(k_dtype), s.poisoned_cache(v_dtype)
        scales = {f"{name}_scale": scale
                  for name, dtype, scale in (("k", k_dtype, SCALES[0]), ("v", v_dtype, SCALES[1])) if dtype == FP8}
        cache_loc = np.array([2, -1, 5, 8, 10, 0, 13, 7])
        k, v = s.into_cache(backend.put(cache_loc), k_before, v_before,
                            **{name: backend.put(scale) for name, scale in scales.items()})
        k_expected, v_expected = s.case.op_reference(s.kv(), cache_loc=cache_loc, k_cache=k_before,
                                                     v_cache=v_before, **scales)
        interpreted = backend.triton_interpreter
        if k_dtype == FP8:
            assert_fp8_close(k, k_expected, triton_interpreter=interpreted)
        else:
            assert_close(k, k_expected)
        if v_dtype == FP8:
            assert_fp8_close(v, v_expected, name="v", triton_interpreter=interpreted)
        else:
            assert_bit_exact(v, v_expected)

    def test_out_of_range_positions_give_nan_k_rows_and_a_too_high_bound_is_refused(self, backend):
        s = setup(backend)
        # 2**32 + 5 would wrap to position 5 if a host int64 reached the kernel narrowed carelessly.
        positions = backend.put_small(np.array([0, 2**32 + 5, -1, 255, 256, 1, 2**31, 7], np.int64), on_host=True)
        k, _ = s.materializer.materialize(s.ctx_hidden, positions, max_position=256)
        k = host(k).astype(np.float32)
        assert np.isnan(k[:, [1, 2, 4, 6]]).all() and not np.isnan(k[:, [0, 3, 5, 7]]).any()
        with pytest.raises(ValueError, match=backend.error_pattern(
                "Invalid max_position for fused KV materialization: got 257, expected at most 256, the rows "
                "of cos_sin_cache.")):
            s.materializer.materialize(s.ctx_hidden, positions, max_position=257)

    def test_an_empty_context_returns_empty_outputs_and_leaves_the_caches(self, backend):
        s = setup(backend, total_ctx=0)
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        assert k.shape == v.shape == (3, 0, OP.num_kv_heads, OP.head_dim)
        before = s.poisoned_cache()
        k_cache, v_cache = s.into_cache(backend.put(np.zeros(0, np.int32)), before, before)
        assert_bit_exact(k_cache, before, name="k_cache")
        assert_bit_exact(v_cache, before, name="v_cache")

    def test_hidden_states_are_cast_once_to_the_weight_dtype(self, backend):
        s = setup(backend)
        k_bf16, v_bf16 = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_fp32, v_fp32 = s.materializer.materialize(backend.put(s.case.ctx_hidden.astype(np.float32)), s.positions)
        assert host(k_fp32).dtype == numpy_dtype("bfloat16")
        assert_bit_exact(k_fp32, k_bf16, name="k")
        assert_bit_exact(v_fp32, v_bf16)

    def test_a_given_cos_sin_cache_replaces_the_built_table_and_fp32_weights_work(self, backend):
        table = rope_cos_sin_cache(256, OP.rotary_dim, base=500.0)
        s = setup(backend, total_ctx=4, dtype="float32", cos_sin_cache=backend.put(table))
        kv = s.kv()
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = fused_kv_norm_rope_reference(
            kv, *stacked_op_arrays(s.case.layers, table), s.case.positions, **s.materializer.config.op_kwargs())
        assert host(k).dtype == np.float32
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)

    def test_a_given_cos_sin_cache_in_the_model_dtype_is_read_as_fp32(self, backend):
        table = rope_cos_sin_cache(256, OP.rotary_dim).astype(numpy_dtype("bfloat16"))
        s = setup(backend, total_ctx=4, cos_sin_cache=backend.put(table))
        kv = s.kv()
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = fused_kv_norm_rope_reference(
            kv, *stacked_op_arrays(s.case.layers, table), s.case.positions, **s.materializer.config.op_kwargs())
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
        k_cache, v_cache = s.into_cache(backend.put(np.arange(4)), poisoned((3, 4, 2, 32), "bfloat16", seed=6),
                                        poisoned((3, 4, 2, 32), "bfloat16", seed=7))
        assert_close(k_cache, k_expected, name="k_cache")
        assert_bit_exact(v_cache, v_expected, name="v_cache")

    def test_layers_of_another_rope_base_are_rotated_by_their_own_table_in_one_launch(self, backend):
        case = random_case(OP, n_layers=3, hidden=64, total_ctx=5, max_position=256, seed=9)
        sliding = RopeConfig(OP.rotary_dim, 256, base=500.0)
        layers = list(case.layers)
        layers[1] = dataclasses.replace(layers[1], rope=sliding)
        case = dataclasses.replace(case, layers=tuple(layers))
        materializer = backend.kernel.FusedKVMaterializer([_on(backend, layer) for layer in layers])
        assert host(materializer.layer_rope_table).tolist() == [0, 1, 0]
        ctx_hidden, positions = backend.put(case.ctx_hidden), backend.put(case.positions)
        kv = host(materializer.project(ctx_hidden))
        k, v = materializer.materialize(ctx_hidden, positions)
        k_expected, v_expected = case.op_reference(kv)
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
        # Layer 1 is what a materializer of the sliding table alone makes of it.
        alone = backend.kernel.FusedKVMaterializer([_on(backend, layers[1])])
        assert_bit_exact(host(k)[1], host(alone.materialize(ctx_hidden, positions)[0])[0], name="k")
        k_cache, v_cache = Setup(backend, case, materializer, ctx_hidden, positions).into_cache(
            backend.put(np.arange(5)), poisoned((3, 5, 2, 32), "bfloat16", seed=9),
            poisoned((3, 5, 2, 32), "bfloat16", seed=10))
        assert_close(k_cache, k_expected, name="k_cache")
        assert_bit_exact(v_cache, v_expected, name="v_cache")

    @pytest.mark.gpu
    def test_real_sizes_match_the_reference_on_every_path(self, backend):
        if self.interpret:
            pytest.skip("real sizes: compiled kernels only (an interpreter pays per program)")
        s = setup(backend, REAL_OP, n_layers=5, hidden=4096, total_ctx=512, seed=7)
        kv = s.kv()
        k, v = s.materializer.materialize(s.ctx_hidden, s.positions)
        k_expected, v_expected = s.case.op_reference(kv)
        assert_close(k, k_expected)
        assert_bit_exact(v, v_expected)
        k_e2e, v_e2e = s.case.end_to_end_reference()
        assert_close(k, k_e2e, tolerance=END_TO_END_TOLERANCE)
        assert_close(v, v_e2e, name="v", tolerance=END_TO_END_TOLERANCE)
        before = s.poisoned_cache(num_slots=4096)
        cache_loc = np.random.default_rng(7).permutation(4096)[:512]
        cache_loc[::7] = -1
        k_cache, v_cache = s.into_cache(backend.put(cache_loc), before, before)
        k_expected, v_expected = s.case.op_reference(kv, cache_loc=cache_loc, k_cache=before, v_cache=before)
        assert_close(k_cache, k_expected)
        assert_bit_exact(v_cache, v_expected)

    # Refusals: the message word for word, the caches as they were.

    def test_a_layer_mismatch_is_refused_naming_the_layer(self, backend):
        case = random_case(OP, n_layers=3, hidden=64, total_ctx=0)
        layers = [dataclasses.replace(layer, kv_proj_weight=backend.put(layer.kv_proj_weight),
                                      k_norm_weight=backend.put(layer.k_norm_weight)) for layer in case.layers]
        layers[1] = dataclasses.replace(layers[1], head_dim=64)
        with pytest.raises(ValueError, match=backend.error_pattern(
                "Invalid fused KV materializer layer 1: head_dim got 64, expected 32 as in layer 0.")):
            backend.kernel.FusedKVMaterializer(layers)

    @pytest.mark.parametrize("hidden_columns, cache_loc, message", [
        (64, np.zeros(4, np.float32),
         "Invalid cache_loc dtype for fused KV materialization: got float32, expected one of ('int32', 'int64')."),
        (64, np.zeros(3, np.int32),
         "Invalid cache_loc shape for fused KV materialization: got (3,), expected (4,)."),
        (32, np.arange(4, dtype=np.int32),
         "Invalid ctx_hidden shape for fused KV materialization: got (4, 32), expected (total_ctx, 64)."),
    ], ids=["cache_loc-dtype", "cache_loc-length", "ctx_hidden-width"])
    def test_a_rejected_call_leaves_the_caches_untouched(self, backend, hidden_columns, cache_loc, message):
        s = setup(backend, total_ctx=4)
        before = s.poisoned_cache()
        k_cache, v_cache = backend.put(before), backend.put(before)
        with pytest.raises(ValueError, match=backend.error_pattern(message)):
            s.materializer.materialize_into_cache(s.ctx_hidden[:, :hidden_columns], s.positions,
                                                  backend.put(cache_loc), k_cache, v_cache)
        backend.assert_untouched(k_cache, before, name="k_cache")
        backend.assert_untouched(v_cache, before, name="v_cache")

    def test_one_array_as_both_caches_is_refused_untouched(self, backend):
        s = setup(backend, total_ctx=4)
        before = s.poisoned_cache()
        cache = backend.put(before)
        with pytest.raises(ValueError, match=backend.error_pattern(
                "Invalid v_cache for fused KV materialization: got a buffer overlapping k_cache, expected outputs "
                "that overlap neither each other nor kv.")):
            s.materializer.materialize_into_cache(s.ctx_hidden, s.positions, backend.put(np.arange(4)), cache, cache)
        backend.assert_untouched(cache, before, name="cache")

    @pytest.mark.parametrize("name", ["ctx_hidden", "positions"])
    def test_arrays_of_another_framework_are_refused_with_a_pointer_to_interop(self, backend, name):
        s = setup(backend, total_ctx=4)
        arguments = dict(ctx_hidden=s.ctx_hidden, positions=s.positions)
        arguments[name] = backend.foreign(host(arguments[name]))
        before = s.poisoned_cache()
        k_cache, v_cache = backend.put(before), backend.put(before)
        message = (f"Invalid {name} for fused KV materialization: got {backend.foreign_type}, "
                   f"expected {backend.takes}.")
        with pytest.raises(TypeError, match=backend.error_pattern(message)):
            s.materializer.materialize_into_cache(arguments["ctx_hidden"], arguments["positions"],
                                                  backend.put(np.arange(4)), k_cache, v_cache)
        backend.assert_untouched(k_cache, before, name="k_cache")
        backend.assert_untouched(v_cache, before, name="v_cache")

    @pytest.mark.parametrize("dtype", ["int32", "bool", "complex64", "float64"])
    def test_hidden_states_of_a_dtype_the_gemm_would_cast_silently_are_refused_untouched(self, backend, dtype):
        s = setup(backend, total_ctx=4)
        before = s.poisoned_cache()
        k_cache, v_cache = backend.put(before), backend.put(before)
        with pytest.raises(ValueError, match=backend.error_pattern(
                f"Invalid ctx_hidden dtype for fused KV materialization: got {dtype}, expected one of "
                "('bfloat16', 'float16', 'float32').")):
            s.materializer.materialize_into_cache(backend.put(s.case.ctx_hidden.astype(dtype)), s.positions,
                                                  backend.put(np.arange(4)), k_cache, v_cache)
        backend.assert_untouched(k_cache, before, name="k_cache")
        backend.assert_untouched(v_cache, before, name="v_cache")

    def test_a_layer_that_is_not_a_layer_kv_is_refused_naming_it(self, backend):
        layers = _layers_on(backend)
        layers[1] = dataclasses.asdict(layers[1])
        with pytest.raises(TypeError, match=backend.error_pattern(
                "Invalid layers[1] for fused KV materialization: got dict, expected an "
                "interop.core.materializer.LayerKV.")):
            backend.kernel.FusedKVMaterializer(layers)

    @pytest.mark.parametrize("field", ["kv_proj_weight", "kv_proj_bias", "k_norm_weight"])
    def test_weights_of_another_framework_are_refused_naming_the_layer(self, backend, field):
        layers = _layers_on(backend, kv_bias=True)
        layers[1] = dataclasses.replace(layers[1], **{field: backend.foreign(host(getattr(layers[1], field)))})
        with pytest.raises(TypeError, match=backend.error_pattern(
                f"Invalid layers[1].{field} for fused KV materialization: got {backend.foreign_type}, "
                f"expected {backend.takes}.")):
            backend.kernel.FusedKVMaterializer(layers)

    def test_a_cos_sin_cache_of_another_framework_is_refused(self, backend):
        table = backend.foreign(rope_cos_sin_cache(256, OP.rotary_dim))
        with pytest.raises(TypeError, match=backend.error_pattern(
                f"Invalid cos_sin_cache for fused KV materialization: got {backend.foreign_type}, "
                f"expected {backend.takes}.")):
            backend.kernel.FusedKVMaterializer(_layers_on(backend), cos_sin_cache=table)


def _layers_on(backend, n_layers=2, kv_bias=False):
    """Random layers (256 positions) as the backend's arrays, in a list to change."""
    case = random_case(OP, n_layers=n_layers, hidden=64, total_ctx=0, max_position=256, kv_bias=kv_bias)
    return [_on(backend, layer) for layer in case.layers]


class TestMaterializerInterpreted(TestMaterializer):
    """``FusedKVMaterializer``: the interpreted twin."""

    interpret = True
