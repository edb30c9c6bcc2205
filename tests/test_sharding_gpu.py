"""The sharded paths on a one-GPU mesh, with the kernel compiled for real (skipped without a GPU).

``jax.shard_map`` with its default settings (``check_vma=True``) and a ``jax.jit`` whose
inputs carry a ``NamedSharding`` run the same kernel as the plain call on one device:
the results must be the plain call's bit for bit, and the compiled program must hold
one kernel and no more copies than the plain call's. Draft shape: 5 layers, 8 KV heads,
head_dim 128, bf16, 4096 tokens.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fusedkv_jax import FusedKVMaterializer, fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_jax.sharding import head_parallel_materializer
from interop.core.arrays import numpy_dtype
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_reference
from interop.core.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, assert_bit_exact, assert_close, random_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (jax.default_backend() == 'gpu')"),
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

DRAFT = FusedKVConfig(8, 128, 128, "neox")
STATIC = dict(num_kv_heads=8, head_dim=128, rotary_dim=128, rope_style="neox")
N_LAYERS, TOTAL_CTX, NUM_SLOTS = 5, 4096, 6000
MODES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _inputs():
    return tuple(jax.device_put(a) for a in random_inputs(
        DRAFT, n_layers=N_LAYERS, total_ctx=TOTAL_CTX, max_position=32768, seed=31).arrays())


def _caches():
    rng = np.random.default_rng(32)
    shape = (N_LAYERS, NUM_SLOTS, DRAFT.num_kv_heads, DRAFT.head_dim)
    slots = rng.permutation(NUM_SLOTS)[:TOTAL_CTX].astype(np.int32)
    slots[::7] = -1
    cache = rng.standard_normal(shape).astype(numpy_dtype("bfloat16"))
    return jax.device_put(slots), cache


def _count(text, op):
    return len(re.findall(rf"\s{op}\(", text))


def _kernels(text):
    return sum(1 for line in text.splitlines() if "custom-call(" in line and "triton" in line)


def _assert_same_program_cost(sharded, plain, args, donated=()):
    """One kernel each, and no copy the plain call's compiled program does not have."""
    sharded_text, plain_text = (jax.jit(function, donate_argnums=donated).lower(*args).compile().as_text()
                                for function in (sharded, plain))
    assert _kernels(sharded_text) == _kernels(plain_text) == 1
    assert _count(sharded_text, "copy") + _count(sharded_text, "copy-start") <= (
        _count(plain_text, "copy") + _count(plain_text, "copy-start"))


def _one_device_mesh(mode, name):
    return jax.make_mesh((1,), (name,), axis_types=(MODES[mode],))


def test_shard_map_with_default_settings_equals_the_plain_call():
    host = _inputs()
    mesh = _one_device_mesh("auto", "h")
    by_heads, whole = P(None, None, "h"), P()
    sharded = jax.shard_map(functools.partial(fused_kv_norm_rope, **STATIC), mesh=mesh,
                            in_specs=(by_heads, whole, whole, whole, whole), out_specs=by_heads)
    plain = functools.partial(fused_kv_norm_rope, **STATIC)
    k, v = jax.jit(sharded)(*host)
    k_plain, v_plain = jax.jit(plain)(*host)
    assert_bit_exact(k, k_plain, name="k")
    assert_bit_exact(v, v_plain)
    k_expected, v_expected = fused_kv_norm_rope_reference(*(np.asarray(a) for a in host), **STATIC)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    _assert_same_program_cost(sharded, plain, host)


def test_shard_map_into_donated_caches_equals_the_plain_call():
    host = _inputs()
    slots, cache = _caches()
    mesh = _one_device_mesh("auto", "h")
    by_heads, whole = P(None, None, "h"), P()
    plain = functools.partial(fused_kv_norm_rope_into_cache, **STATIC)
    sharded = jax.shard_map(plain, mesh=mesh, in_specs=(by_heads, *5 * (whole,), by_heads, by_heads),
                            out_specs=by_heads)
    results = []
    for function in (sharded, plain):
        caches = jnp.array(cache, copy=True), jnp.array(cache, copy=True)
        results.append(jax.jit(function, donate_argnums=(6, 7))(*host, slots, *caches))
    (k, v), (k_plain, v_plain) = results
    assert_bit_exact(k, k_plain, name="k_cache")
    assert_bit_exact(v, v_plain, name="v_cache")
    _assert_same_program_cost(sharded, plain, (*host, slots, cache, cache), donated=(6, 7))


@pytest.mark.parametrize("mode", MODES)
def test_jit_with_inputs_on_a_one_device_mesh_equals_the_plain_call(mode):
    host = _inputs()
    mesh = _one_device_mesh(mode, "tokens")
    kv, weight, eps, cos_sin, positions = host
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in (
        (kv, P("tokens")), (weight, P()), (eps, P()), (cos_sin, P()), (positions, P("tokens")))]
    call = functools.partial(fused_kv_norm_rope, **STATIC)
    k, v = jax.jit(call)(*placed)
    k_plain, v_plain = jax.jit(call)(*host)
    assert_bit_exact(k, k_plain, name="k")
    assert_bit_exact(v, v_plain)
    text = jax.jit(call).lower(*placed).compile().as_text()
    plain_text = jax.jit(call).lower(*host).compile().as_text()
    assert _kernels(text) == 1
    assert _count(text, "copy") <= _count(plain_text, "copy")


def test_materializer_over_heads_on_a_one_device_mesh_equals_the_plain_materializer():
    case = random_case(DRAFT, n_layers=N_LAYERS, hidden=4096, total_ctx=TOTAL_CTX, max_position=32768, seed=33)
    plain = FusedKVMaterializer(case.layers)
    mesh = _one_device_mesh("auto", "h")
    materializer, specs = head_parallel_materializer(case.layers, mesh, "h")
    ctx_hidden, positions = jax.device_put(case.ctx_hidden), jax.device_put(case.positions)
    sharded = jax.jit(jax.shard_map(lambda m, x, p: m.materialize(x, p), mesh=mesh,
                                    in_specs=(specs, P(), P()), out_specs=P(None, None, "h")))
    k, v = sharded(materializer, ctx_hidden, positions)
    k_plain, v_plain = plain.materialize(ctx_hidden, positions)
    # The same GEMM, but compiled twice: XLA may pick another algorithm for it.
    assert_close(k, k_plain, name="k", tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_plain, name="v", tolerance=END_TO_END_TOLERANCE)
