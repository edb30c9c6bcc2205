"""The jax op's backward (the Pallas backward kernel behind jax.custom_vjp) against the
NumPy reference backward: under jax.vjp, jax.grad in jit, jax.checkpoint, check_grads,
and through the materializer."""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import fusedkv_jax  # noqa: E402
from interop.core.materializer import LayerKV, RopeConfig  # noqa: E402
from interop.core.reference import rope_cos_sin_cache  # noqa: E402
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference  # noqa: E402
from interop.core.spec import FusedKVConfig  # noqa: E402
from interop.testing import assert_bit_exact, random_inputs  # noqa: E402
from backward_cases import (LAYER_ROPE_TABLES, MAX_POSITION, assert_grad_close, edge_case,  # noqa: E402
                            with_per_layer_tables)


ON_GPU = jax.default_backend() == "gpu"


def _inputs(config, *, dtype="float32", n_layers=2, total_ctx=3, seed=0):
    host = random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, dtype=dtype, max_position=MAX_POSITION,
                         seed=seed)
    rng = np.random.default_rng(seed + 1)
    shape = config.output_shape(n_layers, total_ctx)
    grads = [rng.standard_normal(shape).astype(host.kv.dtype) for _ in range(2)]
    return list(host.arrays()), grads, rng.uniform(0.5, 2.0, size=n_layers).astype(np.float32)


def _static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
                rope_style=config.rope_style)


def _op(config, eps, cache, positions, layer_rope_table=None):
    def op(kv, weight, multiplier):
        return fusedkv_jax.fused_kv_norm_rope(kv, weight, None if weight is None else eps, cache, positions,
                                              **_static(config), v_multiplier=multiplier,
                                              layer_rope_table=layer_rope_table)
    return op


def _jax_and_reference_grads(config, arrays, grads, multiplier, *, normed=True, layer_rope_table=None):
    kv, weight, eps, cache, positions = arrays
    weight = weight if normed else None
    _, vjp = jax.vjp(_op(config, eps, cache, positions, layer_rope_table), jnp.asarray(kv),
                     None if weight is None else jnp.asarray(weight),
                     None if multiplier is None else jnp.asarray(multiplier))
    got = vjp(tuple(jnp.asarray(g) for g in grads))
    expected = fused_kv_norm_rope_backward_reference(kv, weight, eps if normed else None, cache, positions, *grads,
                                                     **_static(config), v_multiplier=multiplier,
                                                     layer_rope_table=layer_rope_table)
    return got, expected


FORMS = [
    # (config, normed, multiplied)
    (FusedKVConfig(2, 16, 16, "neox"), True, True),
    (FusedKVConfig(2, 16, 16, "gptj"), True, False),
    (FusedKVConfig(1, 16, 8, "neox"), False, True),
    (FusedKVConfig(2, 12, 4, "gptj"), True, True),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("config, normed, multiplied", FORMS, ids=str)
def test_jax_gradients_match_the_reference_backward(config, normed, multiplied, dtype):
    arrays, grads, multiplier = _inputs(config, dtype=dtype)
    multiplier = multiplier if multiplied else None
    got, expected = _jax_and_reference_grads(config, arrays, grads, multiplier, normed=normed)
    assert_grad_close(got[0], expected[0], dtype, "grad_kv")
    assert got[0].dtype == jnp.dtype(dtype)
    if not multiplied:  # V's gradient is the incoming one, bit for bit
        v_grad = np.asarray(got[0])[:, :, config.kv_size:].reshape(3, 2, -1, config.head_dim).transpose(1, 0, 2, 3)
        assert_bit_exact(v_grad, grads[1])
    for name, index in (("grad_k_norm_weight", 1), ("grad_v_multiplier", 2)):
        if expected[index] is None:
            assert got[index] is None, name
        else:
            assert_grad_close(got[index], expected[index], "float32", name)


@pytest.mark.parametrize("config", [FusedKVConfig(4, 16, 16, "neox"), FusedKVConfig(3, 12, 4, "gptj")], ids=str)
def test_jax_gradients_on_tiles_of_one_token_and_one_head_match_the_reference_backward(config):
    # The tiles a short call with large tiles takes on a GPU: the weight's and the
    # multiplier's partial sums then come from one program per head.
    (kv, weight, eps, cache, positions), grads, multiplier = _inputs(config, seed=11)

    def op(kv, weight, multiplier):
        return fusedkv_jax.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                              v_multiplier=multiplier, block_tokens=1, block_heads=1, num_warps=1)

    _, vjp = jax.vjp(op, jnp.asarray(kv), jnp.asarray(weight), jnp.asarray(multiplier))
    got = vjp(tuple(jnp.asarray(g) for g in grads))
    expected = fused_kv_norm_rope_backward_reference(kv, weight, eps, cache, positions, *grads, **_static(config),
                                                     v_multiplier=multiplier)
    for name, index in (("grad_kv", 0), ("grad_k_norm_weight", 1), ("grad_v_multiplier", 2)):
        assert_grad_close(got[index], expected[index], "float32", name)


@pytest.mark.parametrize("kind", ["position outside the table", "head without a scale", "nan head", "inf head",
                                  "overflowing head"])
def test_jax_gradients_take_the_references_edge_values(kind):
    config = FusedKVConfig(2, 16, 16, "gptj")
    arrays, grads, multiplier = _inputs(config, seed=5)
    got, expected = _jax_and_reference_grads(config, edge_case(kind, arrays), grads, multiplier)
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        assert_grad_close(got_grad, expected_grad, "float32", name)


@pytest.mark.parametrize("config", [FusedKVConfig(1, 8, 8, "neox"), FusedKVConfig(2, 8, 4, "gptj")], ids=str)
def test_jax_op_passes_check_grads_in_fp32(config):
    (kv, weight, eps, cache, positions), _, multiplier = _inputs(config, n_layers=1, total_ctx=2, seed=9)
    op = _op(config, eps, cache, positions)
    # fp32 finite differences: steps of 1e-3 keep the rounding noise below the tolerance.
    check_grads(op, (jnp.asarray(kv), jnp.asarray(weight), jnp.asarray(multiplier)), order=1, modes=["rev"],
                eps=1e-3, atol=2e-3, rtol=2e-3)


def test_jax_grad_in_jit_through_checkpoint_matches_the_reference_and_leaves_the_rest_undifferentiated():
    config = FusedKVConfig(2, 8, 8, "neox")
    (kv, weight, eps, cache, positions), (probe_k, probe_v), multiplier = _inputs(config, seed=12)

    @jax.jit
    def loss_grads(kv, weight, eps, cache, multiplier):
        def loss(kv, weight, eps, cache, multiplier):
            k, v = jax.checkpoint(lambda *a: fusedkv_jax.fused_kv_norm_rope(
                *a[:4], positions, **_static(config), v_multiplier=a[4]))(kv, weight, eps, cache, multiplier)
            return jnp.sum(k * probe_k) + jnp.sum(v * probe_v)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(kv, weight, eps, cache, multiplier)

    grad_kv, grad_weight, grad_eps, grad_cache, grad_multiplier = loss_grads(
        *(jnp.asarray(a) for a in (kv, weight, eps, cache, multiplier)))
    expected = fused_kv_norm_rope_backward_reference(kv, weight, eps, cache, positions, probe_k, probe_v,
                                                     **_static(config), v_multiplier=multiplier)
    for name, got, want in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"),
                               (grad_kv, grad_weight, grad_multiplier), expected):
        assert_grad_close(got, want, "float32", name)
    # eps and the table are not differentiated: their cotangents are zeros.
    assert not np.asarray(grad_eps).any() and not np.asarray(grad_cache).any()


# One RoPE for both layers (one table), or a sliding-window layer of another base (per-layer tables).
@pytest.mark.parametrize("bases", [(1e4, 1e4), (1e4, 500.0)], ids=["one_rope", "two_ropes"])
def test_jax_materialize_differentiates_to_ctx_hidden_and_the_weights(bases):
    config, hidden, n_layers = FusedKVConfig(2, 8, 8, "neox"), 6, 2
    rng = np.random.default_rng(13)
    layers = [LayerKV(kv_proj_weight=(rng.standard_normal((2 * config.kv_size, hidden)) / hidden ** 0.5
                                      ).astype(np.float32),
                      k_norm_weight=(1 + 0.25 * rng.standard_normal(config.head_dim)).astype(np.float32),
                      eps=1e-6, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      rope=RopeConfig(config.rotary_dim, MAX_POSITION, base, style=config.rope_style))
              for base in bases]
    materializer = fusedkv_jax.FusedKVMaterializer(layers)
    ctx_hidden = rng.standard_normal((3, hidden)).astype(np.float32)
    positions = np.array([0, 5, 9], np.int32)
    probes = [rng.standard_normal(config.output_shape(n_layers, 3)).astype(np.float32) for _ in range(2)]

    def loss(materializer, ctx_hidden):
        k, v = materializer.materialize(ctx_hidden, positions)
        return jnp.sum(k * probes[0]) + jnp.sum(v * probes[1])

    # allow_int: per-layer tables make the materializer's int32 layer_rope_table a leaf (its gradient float0).
    grad_materializer, grad_hidden = jax.grad(loss, argnums=(0, 1), allow_int=True)(materializer,
                                                                                   jnp.asarray(ctx_hidden))
    weight = np.concatenate([layer.kv_proj_weight for layer in layers])
    kv = (ctx_hidden @ weight.T).reshape(3, n_layers, -1)
    grad_kv, grad_norm_weight, _ = fused_kv_norm_rope_backward_reference(
        kv, np.stack([layer.k_norm_weight for layer in layers]), np.full(n_layers, 1e-6, np.float32),
        np.asarray(materializer.cos_sin_cache), positions, *probes, **_static(config),
        layer_rope_table=materializer.layer_rope_table)
    grad_kv = grad_kv.reshape(3, -1)
    assert_grad_close(grad_hidden, grad_kv @ weight, "float32", "ctx_hidden")
    assert_grad_close(grad_materializer.kv_proj_weight, grad_kv.T @ ctx_hidden, "float32", "kv_proj_weight")
    assert_grad_close(grad_materializer.k_norm_weight, grad_norm_weight, "float32", "k_norm_weight")


@pytest.mark.parametrize("config, normed", [(FusedKVConfig(2, 16, 16, "gptj"), True),
                                            (FusedKVConfig(1, 16, 8, "neox"), False)], ids=str)
@pytest.mark.parametrize("kind", LAYER_ROPE_TABLES)
def test_jax_gradients_with_per_layer_tables_match_the_reference_backward(config, normed, kind):
    arrays, grads, multiplier = _inputs(config, seed=15)
    arrays, layer_rope_table = with_per_layer_tables(arrays), np.array(LAYER_ROPE_TABLES[kind], np.int32)
    got, expected = _jax_and_reference_grads(config, arrays, grads, multiplier, normed=normed,
                                             layer_rope_table=jnp.asarray(layer_rope_table))
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        if expected_grad is None:
            assert got_grad is None, name
        else:
            assert_grad_close(got_grad, expected_grad, "float32", name)


@pytest.mark.parametrize("tile, head_dim, warps", [((1, 8), 128, 2), ((1, 1), 64, 1), ((2, 4), 96, 2),
                                                   ((16, 8), 256, 8), ((4, 8), 128, 8)])
def test_jax_backward_keeps_the_forwards_tile_with_16_elements_a_thread(tile, head_dim, warps):
    from fusedkv_jax.backward import backward_tile
    assert backward_tile(*tile, head_dim) == (*tile, warps)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config", [FusedKVConfig(2, 64, 64, "neox"), FusedKVConfig(4, 128, 64, "neox"),
                                    FusedKVConfig(16, 192, 192, "gptj")], ids=str)
def test_a_training_step_lowers_to_the_forward_and_backward_triton_calls_without_a_gpu(config):
    # jax's cross-platform lowering for CUDA runs the Pallas Triton lowering on any machine.
    (kv, weight, eps, cache, positions), _, multiplier = _inputs(config, n_layers=3, total_ctx=37, seed=16)

    def loss(kv, weight, multiplier):
        k, v = fusedkv_jax.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                              v_multiplier=multiplier, interpret=False)
        return jnp.sum(k * k) + jnp.sum(v * v)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = step.trace(kv, weight, multiplier).lower(lowering_platforms=("cuda",)).as_text()
    assert len([target for target in re.findall(r"custom_call @([\w$.]+)", text) if "triton" in target]) == 2


# The Mosaic GPU lowering's backward kernel: in its interpreter on the CPU (multiples of 64
# tokens), compiled on a GPU.

MOSAIC_FORMS = [  # config, normed, multiplied, tables
    (FusedKVConfig(1, 32, 32, "neox"), True, False, False),
    (FusedKVConfig(2, 64, 32, "neox"), True, True, True),  # a tail, the options
    (FusedKVConfig(2, 64, 32, "gptj"), True, True, False),  # words of pairs, a tail of pairs
    (FusedKVConfig(1, 64, 64, "gptj"), False, True, True),
    (FusedKVConfig(1, 256, 256, "neox"), True, True, False),  # V's gradient scaled after the kernel
]


def _mosaic_grads(config, arrays, grads, multiplier, *, normed, tables, edge=None):
    """The Mosaic GPU lowering's gradients and the reference's, ``tables``: layer 0 by a
    second table, layer 1 by the first; ``edge``: kind of edge value (CONTRACT.md,
    Gradients) in some rows."""
    kv, weight, eps, cache, positions = arrays
    positions = np.where(np.arange(len(positions)) % 9 == 4, -1, positions).astype(positions.dtype)
    kv, eps = kv.copy(), eps.copy()
    if edge == "head without a scale":
        kv[5, 1, :config.head_dim], eps[1] = np.float32(1e-30), 0.0
    elif edge in ("nan head", "inf head"):
        kv[6, 0, 3] = {"nan head": np.nan, "inf head": np.inf}[edge]
    given = {}
    if tables:
        cache = np.stack([cache, rope_cos_sin_cache(len(cache), config.rotary_dim, base=1e6)])
        given = dict(layer_rope_table=np.array([1, 0], np.int32))
    weight = weight if normed else None

    def op(kv, weight, multiplier):
        return fusedkv_jax.fused_kv_norm_rope(kv, weight, None if weight is None else eps, cache, positions,
                                              **_static(config), **given, v_multiplier=multiplier,
                                              lowering="mosaic_gpu")

    _, vjp = jax.vjp(op, jnp.asarray(kv), None if weight is None else jnp.asarray(weight),
                     None if multiplier is None else jnp.asarray(multiplier))
    got = vjp(tuple(jnp.asarray(g) for g in grads))
    expected = fused_kv_norm_rope_backward_reference(kv, weight, eps if normed else None, cache, positions, *grads,
                                                     **_static(config), **given, v_multiplier=multiplier)
    return got, expected


def _assert_mosaic_grads(got, expected, grad_v, config, dtype, multiplied):
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        if expected_grad is None:
            assert got_grad is None, name
            continue
        assert_grad_close(got_grad, expected_grad, dtype, name)
    if not multiplied:  # V's gradient is the incoming one, bit for bit
        total_ctx, n_layers = got[0].shape[:2]
        v_grad = np.asarray(got[0])[:, :, config.kv_size:].reshape(total_ctx, n_layers, -1, config.head_dim)
        assert_bit_exact(v_grad.transpose(1, 0, 2, 3), grad_v)


@pytest.mark.parametrize("config, normed, multiplied, tables", MOSAIC_FORMS, ids=str)
def test_jax_gradients_on_the_mosaic_lowering_match_the_reference_backward(config, normed, multiplied, tables):
    arrays, grads, multiplier = _inputs(config, dtype="bfloat16", n_layers=2, total_ctx=64, seed=14)
    multiplier = multiplier if multiplied else None
    got, expected = _mosaic_grads(config, arrays, grads, multiplier, normed=normed, tables=tables)
    _assert_mosaic_grads(got, expected, grads[1], config, "bfloat16", multiplied)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("edge", ["head without a scale", "nan head", "inf head"])
def test_jax_gradients_on_the_mosaic_lowering_take_the_references_edge_values(edge, rope_style):
    config = FusedKVConfig(2, 64, 32, rope_style)
    arrays, grads, multiplier = _inputs(config, dtype="float16", n_layers=2, total_ctx=128, seed=21)
    got, expected = _mosaic_grads(config, arrays, grads, multiplier, normed=True, tables=False, edge=edge)
    _assert_mosaic_grads(got, expected, grads[1], config, "float16", True)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("multiplied", [False, True])
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_mosaic_gradients_in_programs_of_one_head_and_of_a_group_of_heads_match_the_reference_backward(
        heads, multiplied, rope_style, monkeypatch):
    from fusedkv_jax import devices, mosaic_kernel

    # Two (block, layer) pairs, two programs wanted a multiprocessor: one multiprocessor
    # leaves programs of every head, two of half of them, many of one.
    monkeypatch.setattr(devices, "multiprocessors", lambda: {1: 64, 2: 2, 4: 1}[heads])
    jax.clear_caches()  # else a kernel traced under another count of multiprocessors is reused
    config = FusedKVConfig(4, 64, 32, rope_style)  # a rotary tail
    assert mosaic_kernel.heads_per_program(config, 64, 2, jnp.bfloat16, head_tiles=3 + multiplied) == heads
    arrays, grads, multiplier = _inputs(config, dtype="bfloat16", n_layers=2, total_ctx=64, seed=17 + heads)
    got, expected = _mosaic_grads(config, arrays, grads, multiplier if multiplied else None, normed=True,
                                  tables=True)
    _assert_mosaic_grads(got, expected, grads[1], config, "bfloat16", multiplied)


@pytest.mark.parametrize("config, multiplied, heads", [
    (FusedKVConfig(8, 128, 128, "neox"), True, 8),  # nine 16 KiB tiles and 32 KiB of rows: 176 KiB
    (FusedKVConfig(4, 192, 96, "neox"), False, 4),  # seven 24 KiB tiles and 24 KiB of rows: 192 KiB
    (FusedKVConfig(4, 192, 96, "neox"), True, 1),  # nine: 240 KiB, over the 200 a program may take
    (FusedKVConfig(4, 192, 192, "gptj"), False, 1),  # seven and 48 KiB of rows: 216 KiB
], ids=str)
def test_mosaic_backward_programs_of_several_heads_need_room_for_two_of_each_tile_a_head_reads(config, multiplied,
                                                                                                 heads, monkeypatch):
    from fusedkv_jax import devices, mosaic_kernel

    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    # 32768 tokens of 8 layers: 4096 (block, layer) programs, enough to take every head.
    assert mosaic_kernel.heads_per_program(config, 32768, 8, jnp.bfloat16) == config.num_kv_heads
    assert mosaic_kernel.heads_per_program(config, 32768, 8, jnp.bfloat16, head_tiles=3 + multiplied) == heads


def test_jax_gradients_on_the_mosaic_lowering_under_vmap_match_each_call():
    config = FusedKVConfig(1, 64, 32, "gptj")
    contexts = [_inputs(config, dtype="bfloat16", n_layers=2, total_ctx=64, seed=50 + i) for i in range(2)]
    (_, weight, eps, cache, positions), grads, _ = contexts[0]
    kv = np.stack([arrays[0] for arrays, _, _ in contexts])

    def gradient(kv):
        _, vjp = jax.vjp(lambda kv: fusedkv_jax.fused_kv_norm_rope(
            kv, weight, eps, cache, positions, **_static(config), lowering="mosaic_gpu"), kv)
        return vjp(tuple(jnp.asarray(g) for g in grads))[0]

    batched = jax.vmap(gradient)(jnp.asarray(kv))
    for index in range(len(contexts)):
        expected, _, _ = fused_kv_norm_rope_backward_reference(kv[index], weight, eps, cache, positions, *grads,
                                                               **_static(config))
        assert_grad_close(batched[index], expected, "bfloat16", f"grad_kv of context {index}")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile the kernel for real")
@pytest.mark.parametrize("config, multiplied", [
    (FusedKVConfig(8, 128, 64, "neox"), True), (FusedKVConfig(2, 128, 128, "gptj"), False),
    # V's tile does not fit beside the others: V's gradient scaled by jnp after the kernel.
    (FusedKVConfig(2, 256, 256, "neox"), True),
], ids=str)
def test_the_mosaic_lowerings_gradients_lower_to_its_own_backward_kernel_and_no_triton_call(config, multiplied):
    (kv, weight, eps, cache, positions), _, multiplier = _inputs(config, dtype="bfloat16", n_layers=3,
                                                                 total_ctx=104, seed=16)

    def loss(kv, weight, multiplier):
        k, v = fusedkv_jax.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                              v_multiplier=multiplier, interpret=False, lowering="mosaic_gpu")
        return jnp.sum(k * k) + jnp.sum(v * v)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = step.trace(kv, weight, multiplier if multiplied else None).lower(lowering_platforms=("cuda",)).as_text()
    assert "fused_kv_norm_rope_mosaic_backward" in text
    assert not any("triton" in target for target in re.findall(r"custom_call @([\w$.]+)", text))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() == 'gpu')")
@pytest.mark.parametrize("config, n_layers, total_ctx", [
    (FusedKVConfig(8, 128, 128, "neox"), 5, 4096), (FusedKVConfig(4, 128, 64, "neox"), 3, 2104),
    (FusedKVConfig(8, 128, 64, "gptj"), 2, 72), (FusedKVConfig(1, 96, 32, "gptj"), 3, 7),
    (FusedKVConfig(1, 96, 96, "neox"), 2, 8), (FusedKVConfig(2, 256, 256, "gptj"), 2, 136),
], ids=str)
@pytest.mark.parametrize("multiplied", [False, True])
def test_gpu_mosaic_gradients_match_the_reference_backward(config, n_layers, total_ctx, multiplied):
    arrays, grads, multiplier = _inputs(config, dtype="bfloat16", n_layers=n_layers, total_ctx=total_ctx, seed=31)
    multiplier = multiplier if multiplied else None
    got, expected = _mosaic_grads(config, arrays, grads, multiplier, normed=True, tables=False)
    _assert_mosaic_grads(got, expected, grads[1], config, "bfloat16", multiplied)


@pytest.mark.parametrize("wrt", ["kv", "k_cache"])
def test_jax_grad_through_the_cache_variant_is_refused_naming_what_it_differentiates(wrt):
    config = FusedKVConfig(2, 8, 8, "neox")
    (kv, weight, eps, cache, positions), _, _ = _inputs(config, seed=15)
    slots = jnp.array([0, 2, 4], jnp.int32)
    k_cache, v_cache = jnp.zeros((2, 6, 2, 8), jnp.float32), jnp.ones((2, 6, 2, 8), jnp.float32)

    def loss(kv, k_cache):
        k, v = fusedkv_jax.fused_kv_norm_rope_into_cache(kv, weight, eps, cache, positions, slots, k_cache, v_cache,
                                                         **_static(config))
        return jnp.sum(k) + jnp.sum(v)

    message = (f"Invalid {wrt} for fused KV materialization: got a value jax differentiates (jax.grad, jax.jvp) "
               "in a cache variant")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
        jax.grad(loss, argnums=0 if wrt == "kv" else 1)(jnp.asarray(kv), k_cache)
    assert np.isfinite(float(jax.jit(loss)(jnp.asarray(kv), k_cache)))  # undifferentiated, it runs


@pytest.mark.parametrize("lowering, config, total_ctx", [("triton", FusedKVConfig(1, 8, 8, "neox"), 3),
                                                          ("mosaic_gpu", FusedKVConfig(1, 32, 32, "neox"), 64)])
def test_a_second_derivative_through_the_op_is_refused_naming_what_it_differentiates(lowering, config, total_ctx):
    (kv, weight, eps, cache, positions), _, _ = _inputs(config, total_ctx=total_ctx, seed=16, dtype="bfloat16")

    def loss(kv):
        k, _ = fusedkv_jax.fused_kv_norm_rope(kv, weight, eps, cache, positions, **_static(config),
                                              lowering=lowering)
        return jnp.sum(k * k)

    first = jax.grad(loss)(jnp.asarray(kv))  # first order: the backward kernel
    assert np.isfinite(np.asarray(first)).all()
    message = "Invalid kv for fused KV materialization: got a second derivative through the op"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
        jax.grad(lambda kv: jnp.sum(jax.grad(loss)(kv)))(jnp.asarray(kv))


def test_a_jit_of_many_differentiated_calls_traces_the_backward_kernel_once(monkeypatch):
    from fusedkv_jax import backward

    traced, pallas_call = [], backward.pl.pallas_call

    def counting(kernel, **options):
        traced.extend([1] if options.get("name") == "fused_kv_norm_rope_backward" else [])
        return pallas_call(kernel, **options)

    monkeypatch.setattr(backward.pl, "pallas_call", counting)
    jax.clear_caches()
    config = FusedKVConfig(2, 16, 16, "neox")
    (kv, weight, eps, cache, positions), _, _ = _inputs(config)
    op = _op(config, eps, cache, positions)

    def loss(kv, weight):
        total = 0.0
        for i in range(6):
            k, v = op(kv * (i + 1), weight, None)
            total = total + jnp.sum(k.astype(jnp.float32)) + jnp.sum(v.astype(jnp.float32))
        return total

    jax.jit(jax.grad(loss, argnums=(0, 1))).trace(jnp.asarray(kv), jnp.asarray(weight))
    assert len(traced) == 1
