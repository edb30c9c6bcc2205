"""What only the jax materializer has: donated caches, eagerly and under jit, refused
per-layer cache lists, and on a GPU real sizes.

What both materializers must do alike is ``test_contract_materializer.py``'s; as there,
the op's exactness is checked on the materializer's own GEMM output (``project``) and
the whole path against the fp32 NumPy path under END_TO_END_TOLERANCE. On a machine
without a GPU the Pallas kernel runs in interpret mode: sizes stay small.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusedkv_jax.materializer import FusedKVMaterializer
from interop.testing import random_case
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close

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


def test_per_layer_cache_lists_are_refused():
    setup = _setup(total_ctx=2)
    k_cache, v_cache = _poisoned_caches(setup)
    with pytest.raises(ValueError, match=r"^Invalid k_cache for fused KV materialization: got a "
                                         r"list of per-layer caches"):
        setup.materializer.materialize_into_cache(
            setup.ctx_hidden, setup.positions, jnp.asarray([0, 1], jnp.int32), list(k_cache), v_cache)
    assert not v_cache.is_deleted()


def test_a_rejected_call_leaves_the_donated_caches_alive_and_untouched():
    setup = _setup(total_ctx=4)
    step = jax.jit(_scatter_step, donate_argnums=(4, 5))
    k_cache, v_cache = _poisoned_caches(setup)
    with pytest.raises(ValueError, match=r"^Invalid cache_loc shape"):
        step(setup.materializer, setup.ctx_hidden, setup.positions, jnp.zeros(3, jnp.int32),
             k_cache, v_cache)
    assert not k_cache.is_deleted() and not v_cache.is_deleted()
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())


def test_every_materializer_path_runs_on_the_mosaic_gpu_lowering():
    # Mosaic GPU's interpreter takes multiples of 64 tokens.
    setup = _setup(total_ctx=64, seed=9)
    kv = setup.materializer.project(setup.ctx_hidden)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions, lowering="mosaic_gpu")
    k_expected, v_expected = setup.case.op_reference(kv)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    layers = []
    setup.materializer.materialize_layers(setup.ctx_hidden, setup.positions,
                                          lambda layer, k, v: layers.append((layer, k, v)), lowering="mosaic_gpu")
    assert [layer for layer, _, _ in layers] == [0, 1, 2]
    assert_bit_exact(np.stack([np.asarray(k) for _, k, _ in layers]), np.asarray(k))
    k_cache, v_cache = _poisoned_caches(setup, num_slots=70)
    k_before, v_before = _host(k_cache), _host(v_cache)
    cache_loc = jnp.arange(64, dtype=jnp.int32)[::-1].at[::9].set(-1)
    k_new, v_new = setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, cache_loc,
                                                             k_cache, v_cache, lowering="mosaic_gpu")
    assert k_cache.is_deleted() and v_cache.is_deleted()
    k_expected, v_expected = setup.case.op_reference(kv, cache_loc=np.asarray(cache_loc), k_cache=k_before,
                                                     v_cache=v_before)
    assert_close(k_new, k_expected)
    assert_bit_exact(v_new, v_expected)


def test_a_call_the_mosaic_gpu_lowering_refuses_leaves_the_donated_caches_alive():
    # 12 tokens: refused by the GPU's rule (a multiple of 8 past 8) and the interpreter's.
    setup = _setup(total_ctx=12)
    k_cache, v_cache = _poisoned_caches(setup)
    with pytest.raises(ValueError, match=r"^Invalid total_ctx for fused KV materialization with "
                                         r"lowering='mosaic_gpu': got 12, expected "):
        setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, jnp.arange(12, dtype=jnp.int32),
                                                  k_cache, v_cache, lowering="mosaic_gpu")
    assert not k_cache.is_deleted() and bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())


# --- on a GPU: real sizes, donated caches under jit (every path: the contract suite) ----------

REAL_OP = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128)
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() == 'gpu')")


@pytest.mark.gpu
@needs_gpu
def test_gpu_real_sizes_update_donated_caches_in_place_under_jit():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=512, seed=7)
    kv = setup.materializer.project(setup.ctx_hidden)
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
