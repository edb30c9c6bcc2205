"""The JAX materializer against the interop reference: three result paths, donated caches.

The op's exactness is checked on the materializer's own GEMM output (``project``),
since XLA may round its bf16 GEMM differently from NumPy's fp32 one; the whole path
is checked against the fp32 NumPy path under the looser END_TO_END_TOLERANCE.
On a machine without a GPU the Pallas kernel runs in interpret mode: sizes stay small.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedkv_jax.materializer import FusedKVMaterializer
from interop.materializer_spec import random_case, stacked_op_arrays
from interop.reference import fused_kv_norm_rope_reference, rope_cos_sin_cache
from interop.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, assert_bit_exact, assert_close

ON_GPU = jax.default_backend() == "gpu"
OP = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
NUM_SLOTS = 12
POISON = -3.5  # exactly representable in bf16 and fp8, and not a value the op writes here


@dataclasses.dataclass
class Setup:
    case: object
    materializer: FusedKVMaterializer
    ctx_hidden: jax.Array
    positions: jax.Array


def _setup(op=OP, *, n_layers=3, hidden=64, total_ctx=8, position_dtype="int32", seed=0,
           dtype="bfloat16", **materializer_options) -> Setup:
    case = random_case(op, n_layers=n_layers, hidden=hidden, total_ctx=total_ctx, max_position=256,
                       dtype=dtype, position_dtype=position_dtype, seed=seed)
    return Setup(case, FusedKVMaterializer(case.layers, **materializer_options),
                 jnp.asarray(case.ctx_hidden), jnp.asarray(case.positions.astype(np.int32)))


def _poisoned_caches(setup, dtype=jnp.bfloat16, num_slots=NUM_SLOTS):
    config = setup.materializer.config
    shape = (config.n_layers, num_slots, config.op.num_kv_heads, config.op.head_dim)
    return jnp.full(shape, POISON, dtype), jnp.full(shape, POISON, dtype)


def _host(array) -> np.ndarray:
    """A host copy that holds no reference to the buffer (a view would block its donation)."""
    return np.array(array, copy=True)


CASES = [
    # (op, n_layers, total_ctx, position dtype): the common shape, then an odd one.
    (OP, 3, 8, "int32"),
    (FusedKVConfig(num_kv_heads=1, head_dim=96, rotary_dim=32, rope_style="gptj"), 1, 1, "int64"),
]


@pytest.mark.parametrize("op, n_layers, total_ctx, position_dtype", CASES)
def test_returned_kv_is_the_op_on_the_materializers_own_gemm(op, n_layers, total_ctx, position_dtype):
    setup = _setup(op, n_layers=n_layers, total_ctx=total_ctx, position_dtype=position_dtype)
    # Host int64 positions go in as given: the materializer narrows them before jit.
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.case.positions)
    k_expected, v_expected = setup.case.op_reference(setup.materializer.project(setup.ctx_hidden))
    assert k.shape == v.shape == (n_layers, total_ctx, op.num_kv_heads, op.head_dim)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)


def test_end_to_end_matches_the_fp32_numpy_path():
    setup = _setup(total_ctx=6, seed=3)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = setup.case.end_to_end_reference()
    assert_close(k, k_expected, tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_expected, name="v", tolerance=END_TO_END_TOLERANCE)


def test_project_is_the_stacked_gemm_viewed_per_layer():
    setup = _setup(total_ctx=4)
    kv = setup.materializer.project(setup.ctx_hidden)
    assert kv.shape == (4, 3, 2 * OP.kv_size)
    for layer, layer_kv in enumerate(setup.case.layers):
        expected = jnp.dot(setup.ctx_hidden, jnp.asarray(layer_kv.kv_proj_weight).T)
        assert_bit_exact(kv[:, layer], expected, name=f"kv of layer {layer}")


def test_callback_gets_every_layer_in_order_with_the_returned_values():
    setup = _setup(total_ctx=5, seed=1)
    received = []
    setup.materializer.materialize_layers(
        setup.ctx_hidden, setup.positions, lambda layer, k, v: received.append((layer, k, v)))
    k_expected, v_expected = setup.case.op_reference(setup.materializer.project(setup.ctx_hidden))
    assert [layer for layer, _, _ in received] == [0, 1, 2]
    for layer, k, v in received:
        assert k.shape == v.shape == (5, OP.num_kv_heads, OP.head_dim)
        assert_close(k, k_expected[layer], name=f"k of layer {layer}")
        assert_bit_exact(v, v_expected[layer], name=f"v of layer {layer}")


def _scatter_step(materializer, ctx_hidden, positions, cache_loc, k_cache, v_cache):
    return materializer.materialize_into_cache(ctx_hidden, positions, cache_loc, k_cache, v_cache)


def test_into_cache_under_jit_with_donated_caches_updates_them_in_place():
    setup = _setup(total_ctx=6, seed=2)
    step = jax.jit(_scatter_step, donate_argnums=(4, 5))
    k_cache, v_cache = _poisoned_caches(setup)
    k_before, v_before = _host(k_cache), _host(v_cache)
    k_pointer = k_cache.unsafe_buffer_pointer()
    # Two padding slots, one past the end; written slots are distinct.
    cache_loc = jnp.asarray([7, -1, 0, NUM_SLOTS, 11, -5], jnp.int32)
    k_new, v_new = step(setup.materializer, setup.ctx_hidden, setup.positions, cache_loc,
                        k_cache, v_cache)
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert k_new.unsafe_buffer_pointer() == k_pointer
    k_expected, v_expected = setup.case.op_reference(
        setup.materializer.project(setup.ctx_hidden), cache_loc=np.asarray(cache_loc),
        k_cache=k_before, v_cache=v_before)
    assert_close(k_new, k_expected)
    assert_bit_exact(v_new, v_expected)
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in (7, 0, 11)]
    assert_bit_exact(np.asarray(k_new)[:, untouched], k_before[:, untouched], name="k padding")
    assert_bit_exact(np.asarray(v_new)[:, untouched], v_before[:, untouched], name="v padding")


def test_an_eager_call_donates_the_caches_too():
    setup = _setup(total_ctx=2, seed=6)
    k_cache, v_cache = _poisoned_caches(setup)
    k_new, _ = setup.materializer.materialize_into_cache(
        setup.ctx_hidden, setup.positions, jnp.asarray([1, 4], jnp.int32), k_cache, v_cache)
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert k_new.shape == (3, NUM_SLOTS, OP.num_kv_heads, OP.head_dim)


def test_fp8_cache_is_quantized_with_per_layer_scales():
    setup = _setup(total_ctx=5, seed=5)
    k_cache, v_cache = _poisoned_caches(setup, dtype=jnp.float8_e4m3fn)
    k_before, v_before = _host(k_cache), _host(v_cache)
    k_scale = jnp.asarray([0.5, 0.02, 1.0], jnp.float32)
    v_scale = jnp.asarray([0.25, 1.0, 0.01], jnp.float32)
    cache_loc = jnp.asarray([2, -1, 5, 8, 10], jnp.int32)
    k_new, v_new = setup.materializer.materialize_into_cache(
        setup.ctx_hidden, setup.positions, cache_loc, k_cache, v_cache,
        k_scale=k_scale, v_scale=v_scale)
    k_expected, v_expected = setup.case.op_reference(
        setup.materializer.project(setup.ctx_hidden), cache_loc=np.asarray(cache_loc),
        k_cache=k_before, v_cache=v_before, k_scale=np.asarray(k_scale), v_scale=np.asarray(v_scale))
    assert_close(k_new, k_expected)
    assert_close(v_new, v_expected, name="v")


def test_per_layer_cache_lists_are_refused():
    setup = _setup(total_ctx=2)
    k_cache, v_cache = _poisoned_caches(setup)
    with pytest.raises(ValueError, match=r"^Invalid k_cache for fused KV materialization: got a "
                                         r"list of per-layer caches"):
        setup.materializer.materialize_into_cache(
            setup.ctx_hidden, setup.positions, jnp.asarray([0, 1], jnp.int32), list(k_cache), v_cache)
    assert not v_cache.is_deleted()


def test_a_layer_mismatch_is_refused_naming_the_layer():
    layers = list(random_case(OP, n_layers=3, hidden=64, total_ctx=0).layers)
    layers[1] = dataclasses.replace(layers[1], head_dim=64)
    with pytest.raises(ValueError, match=r"^Invalid fused KV materializer layer 1: head_dim got "
                                         r"64, expected 32 as in layer 0\.$"):
        FusedKVMaterializer(layers)


def test_a_rejected_call_leaves_the_donated_caches_alive_and_untouched():
    setup = _setup(total_ctx=4)
    step = jax.jit(_scatter_step, donate_argnums=(4, 5))
    k_cache, v_cache = _poisoned_caches(setup)
    with pytest.raises(ValueError, match=r"^Invalid cache_loc shape"):
        step(setup.materializer, setup.ctx_hidden, setup.positions, jnp.zeros(3, jnp.int32),
             k_cache, v_cache)
    assert not k_cache.is_deleted() and not v_cache.is_deleted()
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())



def test_one_array_as_both_caches_is_refused_before_jit_donates_it():
    setup = _setup(total_ctx=4)
    cache = _poisoned_caches(setup)[0]
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid v_cache for fused KV materialization: got a buffer overlapping k_cache, expected "
            "outputs that overlap neither each other nor kv.") + "$"):
        setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions,
                                                  jnp.asarray([0, 1, 2, 3], jnp.int32), cache, cache)
    assert not cache.is_deleted() and bool((cache == POISON).all())


def test_a_torch_tensor_is_refused_with_a_pointer_to_interop():
    torch = pytest.importorskip("torch")
    setup = _setup(total_ctx=4)
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid positions for fused KV materialization: got torch.Tensor, expected a jax or NumPy array "
            "(fusedkv_jax takes jax and NumPy arrays; interop.fused_kv_norm_rope takes arrays of any "
            "framework).") + "$"):
        setup.materializer.materialize(setup.ctx_hidden, torch.from_numpy(np.array(setup.positions)))


def test_out_of_range_positions_give_nan_k_rows_and_a_too_high_bound_is_refused():
    setup = _setup(total_ctx=4)
    # 2**32 + 5 would wrap to position 5 if a host int64 reached jit unnarrowed.
    positions = np.array([0, 2**32 + 5, -1, 255], np.int64)
    k, _ = setup.materializer.materialize(setup.ctx_hidden, positions, max_position=256)
    k = np.asarray(k).astype(np.float32)
    assert np.isnan(k[:, [1, 2]]).all() and not np.isnan(k[:, [0, 3]]).any()
    with pytest.raises(ValueError, match=r"^Invalid max_position for fused KV materialization: "
                                         r"got 257, expected at most 256"):
        setup.materializer.materialize(setup.ctx_hidden, positions, max_position=257)


def test_an_empty_context_returns_empty_outputs_and_leaves_the_caches():
    setup = _setup(total_ctx=0)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    assert k.shape == v.shape == (3, 0, OP.num_kv_heads, OP.head_dim)
    k_cache, v_cache = setup.materializer.materialize_into_cache(
        setup.ctx_hidden, setup.positions, jnp.zeros(0, jnp.int32), *_poisoned_caches(setup))
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())


def test_hidden_states_are_cast_once_to_the_weight_dtype():
    setup = _setup(total_ctx=3)
    k_bf16, v_bf16 = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_fp32, v_fp32 = setup.materializer.materialize(setup.ctx_hidden.astype(jnp.float32),
                                                    setup.positions)
    assert k_fp32.dtype == jnp.bfloat16
    assert_bit_exact(k_fp32, k_bf16, name="k")
    assert_bit_exact(v_fp32, v_bf16)


def test_a_given_cos_sin_cache_replaces_the_built_table_and_fp32_weights_work():
    table = rope_cos_sin_cache(256, OP.rotary_dim, base=500.0)
    setup = _setup(total_ctx=4, dtype="float32", cos_sin_cache=jnp.asarray(table))
    kv = setup.materializer.project(setup.ctx_hidden)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = fused_kv_norm_rope_reference(
        kv, *stacked_op_arrays(setup.case.layers, table), setup.positions,
        **setup.materializer.config.op_kwargs())
    assert k.dtype == jnp.float32
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)


# --- on a GPU: real sizes, donated caches under jit ------------------------------------------

REAL_OP = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128)
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() == 'gpu')")


@pytest.mark.gpu
@needs_gpu
def test_gpu_real_sizes_match_the_reference_and_update_donated_caches_in_place():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=512, seed=7)
    kv = setup.materializer.project(setup.ctx_hidden)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = setup.case.op_reference(kv)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    k_e2e, v_e2e = setup.case.end_to_end_reference()
    assert_close(k, k_e2e, tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_e2e, name="v", tolerance=END_TO_END_TOLERANCE)

    step = jax.jit(_scatter_step, donate_argnums=(4, 5))
    k_cache, v_cache = _poisoned_caches(setup, num_slots=4096)
    k_before, v_before = _host(k_cache), _host(v_cache)
    k_pointer = k_cache.unsafe_buffer_pointer()
    slots = np.random.default_rng(7).permutation(4096)[:512].astype(np.int32)
    slots[::7] = -1
    k_new, v_new = step(setup.materializer, setup.ctx_hidden, setup.positions, jnp.asarray(slots),
                        k_cache, v_cache)
    assert k_cache.is_deleted() and k_new.unsafe_buffer_pointer() == k_pointer
    k_expected, v_expected = setup.case.op_reference(kv, cache_loc=slots, k_cache=k_before,
                                                     v_cache=v_before)
    assert_close(k_new, k_expected)
    assert_bit_exact(v_new, v_expected)
