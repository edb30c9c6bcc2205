"""fusedkv on a mesh of 4 host devices: jit split by tokens and layers, shard_map over heads.

Four jax devices on a CPU machine need ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
before jax starts, so ``tests/test_sharding.py`` runs this module in a subprocess set up
so; in a process with fewer devices it is skipped. The kernel runs in Pallas interpret
mode. Every sharded result is compared with the interop reference (K under the
tolerance table, V bit for bit) and with the same call unsharded (bit for bit: each
device runs the same kernel on its part). Over Explicit mesh axes (``jax.make_mesh``'s
default) the shardings are known while tracing; over Auto axes XLA's partitioner decides
them: both are run.

Pallas interpret mode cannot run on values that carry varying manual axes (its HLO
interpreter checks them on every primitive it replays), so the numeric shard_map runs
here pass ``check_vma=False``; with shard_map's default settings the same functions are
traced and lowered for the GPU's Triton lowering, which is where the op used to fail,
and the GPU test file runs them for real.
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
from fusedkv_jax.sharding import head_major_kv, head_parallel_materializer
from interop.core.arrays import numpy_dtype
from interop.core.materializer import stacked_op_arrays
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference
from interop.core.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, assert_bit_exact, assert_close, gradient_mismatch, random_inputs

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 jax devices: tests/test_sharding.py runs this module with 4 host devices")

MODES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
COLLECTIVE = re.compile(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)")
OP = FusedKVConfig(4, 32, 16, "gptj")
BF16 = numpy_dtype("bfloat16")


def _static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim, rope_style=config.rope_style)


def _mesh(shape, names, mode):
    return jax.make_mesh(shape, names, axis_types=(MODES[mode],) * len(shape))


def _put(mesh, array, *spec):
    return jax.device_put(array, NamedSharding(mesh, P(*spec)))


def _inputs(config=OP, *, n_layers=2, total_ctx=8, seed=0):
    return random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=64,
                         seed=seed).arrays()


def _assert_matches(k, v, host, config, k_whole, v_whole):
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config))
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    assert_bit_exact(k, k_whole, name="k against the unsharded call")
    assert_bit_exact(v, v_whole, name="v against the unsharded call")


def _assert_no_collectives(compiled):
    found = sorted(set(COLLECTIVE.findall(compiled.as_text())))
    assert not found, f"the compiled program moves data between devices: {found}"


def _assert_split(array, mesh, *spec):
    assert array.sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), array.ndim), array.sharding


# Under jax.jit: tokens and layers.

@pytest.mark.parametrize("mode", MODES)
def test_jit_with_tokens_split_runs_each_device_on_its_tokens(mode):
    host = _inputs()
    k_whole, v_whole = fused_kv_norm_rope(*host, **_static(OP))
    mesh = _mesh((4,), ("x",), mode)
    kv, weight, eps, cos_sin, positions = host
    args = (_put(mesh, kv, "x"), _put(mesh, weight), _put(mesh, eps), _put(mesh, cos_sin),
            _put(mesh, positions, "x"))
    compiled = jax.jit(functools.partial(fused_kv_norm_rope, **_static(OP))).lower(*args).compile()
    _assert_no_collectives(compiled)
    k, v = compiled(*args)
    _assert_split(k, mesh, None, "x")
    _assert_split(v, mesh, None, "x")
    _assert_matches(k, v, host, OP, k_whole, v_whole)


@pytest.mark.parametrize("mode", MODES)
def test_jit_with_tokens_and_layers_split_on_a_2x2_mesh(mode):
    config = FusedKVConfig(2, 96, 32, "neox")
    host = _inputs(config, n_layers=2, total_ctx=6, seed=1)
    k_whole, v_whole = fused_kv_norm_rope(*host, **_static(config))
    mesh = _mesh((2, 2), ("tokens", "layers"), mode)
    kv, weight, eps, cos_sin, positions = host
    args = (_put(mesh, kv, "tokens", "layers"), _put(mesh, weight, "layers"),
            _put(mesh, eps, "layers"), _put(mesh, cos_sin), _put(mesh, positions, "tokens"))
    compiled = jax.jit(functools.partial(fused_kv_norm_rope, **_static(config))).lower(*args).compile()
    _assert_no_collectives(compiled)
    k, v = compiled(*args)
    _assert_split(k, mesh, "layers", "tokens")
    _assert_matches(k, v, host, config, k_whole, v_whole)


def _cache_case(config, n_layers, num_slots, seed):
    rng = np.random.default_rng(seed)
    shape = (n_layers, num_slots, config.num_kv_heads, config.head_dim)
    k_cache = (8.0 * rng.standard_normal(shape)).astype(BF16)
    v_cache = (8.0 * rng.standard_normal(shape)).astype(BF16)
    return k_cache, v_cache


@pytest.mark.parametrize("mode", MODES)
def test_jit_into_caches_split_by_layers_writes_each_devices_layers(mode):
    host = _inputs(n_layers=4, total_ctx=5, seed=2)
    slots = np.array([6, -1, 0, 3, 9], np.int32)
    k_cache, v_cache = _cache_case(OP, 4, 10, seed=3)
    k_whole, v_whole = fused_kv_norm_rope_into_cache(*host, slots, k_cache, v_cache, **_static(OP))
    mesh = _mesh((4,), ("layers",), mode)
    kv, weight, eps, cos_sin, positions = host
    args = (_put(mesh, kv, None, "layers"), _put(mesh, weight, "layers"), _put(mesh, eps, "layers"),
            _put(mesh, cos_sin), _put(mesh, positions), _put(mesh, slots),
            _put(mesh, k_cache, "layers"), _put(mesh, v_cache, "layers"))
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(OP)))
    compiled = step.lower(*args).compile()
    _assert_no_collectives(compiled)
    k, v = compiled(*args)
    _assert_split(k, mesh, "layers")
    k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(
        *host, slots, k_cache, v_cache, **_static(OP))
    assert_close(k, k_expected, name="k_cache")
    assert_bit_exact(v, v_expected, name="v_cache")
    assert_bit_exact(k, k_whole, name="k_cache against the unsharded call")
    assert_bit_exact(v, v_whole, name="v_cache against the unsharded call")


def _refusal(mode, message):
    # Over Explicit axes the ValueError is raised while tracing; over Auto axes XLA's
    # partitioner calls the rule while compiling and reports it as a JaxRuntimeError.
    error = ValueError if mode == "explicit" else jax.errors.JaxRuntimeError
    return pytest.raises(error, match=re.escape(message))


@pytest.mark.parametrize("mode", MODES)
def test_kv_split_along_its_columns_is_refused_not_gathered(mode):
    kv, weight, eps, cos_sin, positions = _inputs(total_ctx=4)
    mesh = _mesh((4,), ("x",), mode)
    with _refusal(mode, "Invalid kv sharding for fused KV materialization: got its last dim split "
                       "over mesh axes 'x', expected it whole: per token and layer it holds all K "
                       "heads then all V heads"):
        jax.jit(functools.partial(fused_kv_norm_rope, **_static(OP))).lower(
            _put(mesh, kv, None, None, "x"), weight, eps, cos_sin, positions).compile()


@pytest.mark.parametrize("mode", MODES)
def test_cache_call_with_tokens_split_is_refused(mode):
    kv, weight, eps, cos_sin, positions = _inputs(total_ctx=4)
    k_cache, v_cache = _cache_case(OP, 2, 6, seed=4)
    mesh = _mesh((4,), ("x",), mode)
    with _refusal(mode, "Invalid kv sharding for fused KV materialization into a paged cache: got "
                       "tokens split over mesh axes 'x', expected tokens whole"):
        jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(OP))).lower(
            _put(mesh, kv, "x"), weight, eps, cos_sin, _put(mesh, positions, "x"),
            _put(mesh, np.arange(4, dtype=np.int32), "x"), k_cache, v_cache).compile()


# Inside jax.shard_map: heads.

def _head_parallel(function, mesh, in_specs, out_specs, *, check_vma):
    return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))


def _op_over_heads(mesh, config, *, cache, check_vma, interpret=None):
    """shard_map of one entry point, each device its share of the heads of kv laid out shard by shard."""
    local = dict(_static(config), num_kv_heads=config.num_kv_heads // mesh.size, interpret=interpret)
    by_heads = P(None, None, "h")
    whole = P()
    if cache:
        def function(kv, weight, eps, cos_sin, positions, slots, k_cache, v_cache):
            return fused_kv_norm_rope_into_cache(kv, weight, eps, cos_sin, positions, slots,
                                                 k_cache, v_cache, **local)
        in_specs = (by_heads, whole, whole, whole, whole, whole, by_heads, by_heads)
    else:
        function = functools.partial(fused_kv_norm_rope, **local)
        in_specs = (by_heads, whole, whole, whole, whole)
    return _head_parallel(function, mesh, in_specs, by_heads, check_vma=check_vma)


def test_shard_map_over_heads_equals_the_whole_op():
    host = _inputs(seed=5)
    k_whole, v_whole = fused_kv_norm_rope(*host, **_static(OP))
    mesh = _mesh((4,), ("h",), "auto")
    kv, *rest = host
    kv_by_heads = head_major_kv(kv, num_kv_heads=OP.num_kv_heads, head_dim=OP.head_dim, num_shards=4)
    args = (_put(mesh, kv_by_heads, None, None, "h"), *(_put(mesh, a) for a in rest))
    k, v = _op_over_heads(mesh, OP, cache=False, check_vma=False)(*args)
    _assert_split(k, mesh, None, None, "h")
    _assert_matches(k, v, host, OP, k_whole, v_whole)


def test_shard_map_over_heads_into_caches_split_by_heads():
    host = _inputs(total_ctx=5, seed=6)
    slots = np.array([1, 7, -2, 4, 0], np.int32)
    k_cache, v_cache = _cache_case(OP, 2, 8, seed=7)
    k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(
        *host, slots, k_cache, v_cache, **_static(OP))
    mesh = _mesh((4,), ("h",), "explicit")
    kv, *rest = host
    kv_by_heads = head_major_kv(kv, num_kv_heads=OP.num_kv_heads, head_dim=OP.head_dim, num_shards=4)
    args = (_put(mesh, kv_by_heads, None, None, "h"), *(_put(mesh, a) for a in rest),
            _put(mesh, slots), _put(mesh, k_cache, None, None, "h"), _put(mesh, v_cache, None, None, "h"))
    k, v = _op_over_heads(mesh, OP, cache=True, check_vma=False)(*args)
    assert_close(k, k_expected, name="k_cache")
    assert_bit_exact(v, v_expected, name="v_cache")


def test_grad_inside_shard_map_over_tokens_matches_the_reference_backward():
    # A data-parallel training step: each device differentiates the op on its tokens, and
    # the weight's gradient is the sum of the devices' (psum), as over the whole context.
    kv, weight, eps, cos_sin, positions = _inputs(total_ctx=8, seed=8)
    rng = np.random.default_rng(9)
    grad_k, grad_v = (rng.standard_normal((2, 8, OP.num_kv_heads, OP.head_dim)).astype(np.float32) for _ in range(2))
    mesh = _mesh((4,), ("x",), "explicit")

    def grads(kv, positions, grad_k, grad_v, weight, eps, cos_sin):
        def loss(kv, weight):
            k, v = fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **_static(OP))
            return jnp.sum(k * grad_k) + jnp.sum(v * grad_v)
        return jax.grad(loss, argnums=(0, 1))(kv, weight)

    def local(*args):
        grad_kv, grad_weight = grads(*args)
        return grad_kv, jax.lax.psum(grad_weight, "x")

    by_tokens, of_outputs, whole = P("x"), P(None, "x"), P()
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(by_tokens, by_tokens, of_outputs, of_outputs,
                                                             whole, whole, whole),
                                 out_specs=(by_tokens, whole), check_vma=False))
    grad_kv, grad_weight = step(_put(mesh, kv, "x"), _put(mesh, positions, "x"), _put(mesh, grad_k, None, "x"),
                                _put(mesh, grad_v, None, "x"), weight, eps, cos_sin)
    expected_kv, expected_weight, _ = fused_kv_norm_rope_backward_reference(
        kv, weight, eps, cos_sin, positions, grad_k, grad_v, **_static(OP))
    _assert_split(grad_kv, mesh, "x")
    whole_kv, _ = jax.jit(grads)(kv, positions, grad_k, grad_v, weight, eps, cos_sin)
    assert_bit_exact(grad_kv, whole_kv, name="grad_kv against the unsharded gradient")
    for name, got, expected in (("grad_kv", grad_kv, expected_kv),
                                ("grad_k_norm_weight", grad_weight, expected_weight)):
        mismatch = gradient_mismatch(got, expected, str(kv.dtype), name=name)
        assert not mismatch, mismatch

@pytest.mark.parametrize("cache", [False, True], ids=["op", "into_cache"])
def test_shard_map_with_default_settings_lowers_for_the_gpu(cache):
    # What used to fail: with check_vma (shard_map's default) the kernel's outputs must
    # say how they vary over the mesh, or tracing stops with a ValueError.
    config = FusedKVConfig(8, 128, 128, "neox")
    mesh = _mesh((4,), ("h",), "explicit")

    def sds(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

    args = [sds((64, 5, 2 * config.kv_size), jnp.bfloat16, None, None, "h"),
            sds((5, 128), jnp.float32), sds((5,), jnp.float32), sds((100, 128), jnp.float32),
            sds((64,), jnp.int32)]
    if cache:
        args += [sds((64,), jnp.int32), *2 * [sds((5, 80, 8, 128), jnp.bfloat16, None, None, "h")]]
    # The GPU kernel (interpret=False), lowered for "cuda" on this CPU machine.
    step = _op_over_heads(mesh, config, cache=cache, check_vma=True, interpret=False)
    try:
        text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as error:
        # jax 0.11 reads the compute capability off a visible GPU to lower Pallas-Triton;
        # this subprocess sees host devices only. tests/test_sharding_gpu.py lowers it there.
        if "No supported GPU devices found" not in str(error):
            raise
        pytest.skip("this jax lowers the GPU kernel only where it sees a GPU")
    assert "xla.gpu.triton" in text or "triton_kernel_call" in text


def _materializer_over_heads(mesh, specs, method):
    def function(materializer, ctx_hidden, positions, *cache_args):
        if method == "project":
            return materializer.project(ctx_hidden)
        return getattr(materializer, method)(ctx_hidden, positions, *cache_args)
    by_heads = P(None, None, "h")
    in_specs = (specs, P(), P()) + ((P(), by_heads, by_heads) if method == "materialize_into_cache" else ())
    return _head_parallel(function, mesh, in_specs, by_heads, check_vma=False)


@pytest.mark.parametrize("kv_bias", [False, True], ids=["no-bias", "bias"])
def test_materializer_over_heads_gives_each_device_its_heads_of_the_whole(kv_bias):
    case = random_case(OP, n_layers=2, hidden=48, total_ctx=6, max_position=64, seed=8, kv_bias=kv_bias)
    whole = FusedKVMaterializer(case.layers)
    k_whole, v_whole = whole.materialize(jnp.asarray(case.ctx_hidden), jnp.asarray(case.positions))
    mesh = _mesh((2,), ("h",), "explicit")
    materializer, specs = head_parallel_materializer(case.layers, mesh, "h")
    args = (materializer, _put(mesh, case.ctx_hidden), _put(mesh, case.positions))
    kv = np.asarray(_materializer_over_heads(mesh, specs, "project")(*args))
    k, v = _materializer_over_heads(mesh, specs, "materialize")(*args)
    slots = np.array([3, -1, 0, 7, 5, 2], np.int32)
    k_cache, v_cache = _cache_case(OP, 2, 8, seed=9)
    k_written, v_written = _materializer_over_heads(mesh, specs, "materialize_into_cache")(
        *args, _put(mesh, slots), _put(mesh, k_cache, None, None, "h"), _put(mesh, v_cache, None, None, "h"))
    _assert_split(k, mesh, None, None, "h")
    # Device r's result is the op on its own projection (its heads' K and V columns).
    local_heads, width = OP.num_kv_heads // 2, kv.shape[2] // 2
    local_op = dict(_static(OP), num_kv_heads=local_heads)
    for device in range(2):
        heads = slice(device * local_heads, (device + 1) * local_heads)
        host = (kv[:, :, device * width:(device + 1) * width],
                *stacked_op_arrays(case.layers), case.positions)
        k_expected, v_expected = fused_kv_norm_rope_reference(*host, **local_op)
        assert_close(np.asarray(k)[:, :, heads], k_expected, name=f"k of device {device}")
        assert_bit_exact(np.asarray(v)[:, :, heads], v_expected, name=f"v of device {device}")
        k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(
            *host, slots, k_cache[:, :, heads], v_cache[:, :, heads], **local_op)
        assert_close(np.asarray(k_written)[:, :, heads], k_expected, name=f"k_cache of device {device}")
        assert_bit_exact(np.asarray(v_written)[:, :, heads], v_expected, name=f"v_cache of device {device}")
    # And together the heads of the one-device materializer, up to the rounding of a GEMM
    # computed over other columns.
    assert_close(k, k_whole, name="k against one device", tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_whole, name="v against one device", tolerance=END_TO_END_TOLERANCE)
