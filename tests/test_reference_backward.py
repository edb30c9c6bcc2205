"""The NumPy reference backward against autodiff of plain float64 formulations written
here (jnp under jax.vjp, torch under torch.autograd), and its edge values."""

import numpy as np
import pytest

from interop.core.reference import rope_cos_sin_cache
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference
from interop.core.spec import FusedKVConfig
from interop.testing import random_inputs

CASES = [
    # (heads, head_dim, rotary_dim, style, layers, tokens)
    (2, 16, 16, "neox", 2, 3),
    (2, 16, 16, "gptj", 2, 3),
    (1, 16, 8, "neox", 2, 2),
    (3, 12, 4, "gptj", 1, 3),
]
MAX_POSITION = 64


def _case(heads, dim, rotary_dim, style, layers, tokens, *, seed=0):
    config = FusedKVConfig(heads, dim, rotary_dim, style)
    inputs = random_inputs(config, n_layers=layers, total_ctx=tokens, dtype="float32",
                           max_position=MAX_POSITION, seed=seed)
    rng = np.random.default_rng(seed + 1)
    shape = config.output_shape(layers, tokens)
    grads = rng.standard_normal(shape), rng.standard_normal(shape)
    v_multiplier = rng.uniform(0.5, 2.0, size=layers).astype(np.float32)
    return config, list(inputs.arrays()), grads, v_multiplier


def _with_tables(config, arrays):
    """``arrays`` with two tables of other bases (a full-attention and a sliding-window RoPE)."""
    tables = np.stack([rope_cos_sin_cache(MAX_POSITION, config.rotary_dim, base) for base in (1e6, 1e4)])
    return [*arrays[:3], tables, arrays[4]]


def _reference(config, arrays, grads, v_multiplier=None, layer_rope_table=None):
    return fused_kv_norm_rope_backward_reference(
        *arrays, *grads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, v_multiplier=v_multiplier,
        layer_rope_table=layer_rope_table)


def _jnp_forward(kv, weight, eps, cache, positions, v_multiplier, config, table=None):
    """The op in plain jnp, float64; ``table``: each layer's table in a 3-D ``cache``."""
    import jax.numpy as jnp

    total_ctx, n_layers, _ = kv.shape
    heads, dim, rotary_dim, half = config.num_kv_heads, config.head_dim, config.rotary_dim, config.rotary_dim // 2
    k = kv[:, :, :config.kv_size].reshape(total_ctx, n_layers, heads, dim)
    if weight is not None:
        k = k / jnp.sqrt(jnp.mean(k * k, -1, keepdims=True) + eps[None, :, None, None]) * weight[None, :, None, :]
    rows = cache[positions][:, None] if table is None else jnp.swapaxes(cache[table][:, positions], 0, 1)
    cos, sin = rows[:, :, None, :half], rows[:, :, None, half:rotary_dim]
    if config.rope_style == "neox":
        a, b = k[..., :half], k[..., half:rotary_dim]
        rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = k[..., 0:rotary_dim:2], k[..., 1:rotary_dim:2]
        rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(*a.shape[:-1], rotary_dim)
    k = jnp.concatenate([rotated, k[..., rotary_dim:]], -1)
    v = kv[:, :, config.kv_size:].reshape(total_ctx, n_layers, heads, dim) * v_multiplier[None, :, None, None]
    return jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)


def _torch_forward(kv, weight, eps, cache, positions, v_multiplier, config, table=None):
    """The op in plain torch, float64, with RoPE as a complex rotation; ``table``: each layer's
    table in a 3-D ``cache``."""
    import torch

    total_ctx, n_layers, _ = kv.shape
    heads, dim, rotary_dim, half = config.num_kv_heads, config.head_dim, config.rotary_dim, config.rotary_dim // 2
    k = kv[:, :, :config.kv_size].reshape(total_ctx, n_layers, heads, dim)
    if weight is not None:
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps[None, :, None, None]) * weight[None, :, None, :]
    rows = cache[positions][:, None] if table is None else cache[table][:, positions].transpose(0, 1)
    angle = torch.complex(rows[:, :, None, :half], rows[:, :, None, half:rotary_dim])
    if config.rope_style == "neox":
        z = torch.complex(k[..., :half], k[..., half:rotary_dim]) * angle
        rotated = torch.cat([z.real, z.imag], -1)
    else:
        z = torch.complex(k[..., 0:rotary_dim:2], k[..., 1:rotary_dim:2]) * angle
        rotated = torch.stack([z.real, z.imag], -1).flatten(-2)
    k = torch.cat([rotated, k[..., rotary_dim:]], -1)
    v = kv[:, :, config.kv_size:].reshape(total_ctx, n_layers, heads, dim) * v_multiplier[None, :, None, None]
    return k.transpose(0, 1), v.transpose(0, 1)


def _tables_of(layers, tables):
    """A ``layer_rope_table`` naming each layer another table than its neighbour's, or None."""
    return (np.arange(1, layers + 1) % 2).astype(np.int32) if tables else None


TABLES = pytest.mark.parametrize("tables", [False, True], ids=["one_table", "per_layer_tables"])


@TABLES
@pytest.mark.parametrize("normed", [True, False], ids=["k_norm", "no_k_norm"])
@pytest.mark.parametrize("heads, dim, rotary_dim, style, layers, tokens", CASES)
def test_reference_backward_matches_jax_vjp_of_plain_jnp(heads, dim, rotary_dim, style, layers, tokens, normed,
                                                         tables):
    jax = pytest.importorskip("jax")
    config, arrays, grads, v_multiplier = _case(heads, dim, rotary_dim, style, layers, tokens)
    layer_rope_table = _tables_of(layers, tables)
    if tables:
        arrays = _with_tables(config, arrays)
    if not normed:
        arrays[1] = arrays[2] = None
    expected = _reference(config, arrays, grads, v_multiplier, layer_rope_table)
    with jax.enable_x64(True):
        kv, weight, eps, cache = (None if a is None else jax.numpy.asarray(a, jax.numpy.float64) for a in arrays[:4])

        def forward(kv, weight, v_multiplier):
            return _jnp_forward(kv, weight, eps, cache, arrays[4], v_multiplier, config, layer_rope_table)

        _, vjp = jax.vjp(forward, kv, weight, jax.numpy.asarray(v_multiplier, jax.numpy.float64))
        got = vjp(tuple(jax.numpy.asarray(g) for g in grads))
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        if expected_grad is None:
            assert got_grad is None, name
            continue
        np.testing.assert_allclose(np.asarray(got_grad), expected_grad, rtol=1e-10, atol=1e-12, err_msg=name)


@TABLES
@pytest.mark.parametrize("heads, dim, rotary_dim, style, layers, tokens", CASES)
def test_reference_backward_matches_torch_autograd_of_plain_torch(heads, dim, rotary_dim, style, layers, tokens,
                                                                  tables):
    torch = pytest.importorskip("torch")
    config, arrays, grads, v_multiplier = _case(heads, dim, rotary_dim, style, layers, tokens, seed=3)
    layer_rope_table = _tables_of(layers, tables)
    if tables:
        arrays = _with_tables(config, arrays)
    expected = _reference(config, arrays, grads, v_multiplier, layer_rope_table)
    kv, weight, multiplier = (torch.tensor(a, dtype=torch.float64, requires_grad=True)
                              for a in (arrays[0], arrays[1], v_multiplier))
    eps, cache = (torch.tensor(a, dtype=torch.float64) for a in arrays[2:4])
    outputs = _torch_forward(kv, weight, eps, cache, torch.tensor(arrays[4]).long(), multiplier, config,
                             None if layer_rope_table is None else torch.tensor(layer_rope_table).long())
    got = torch.autograd.grad(outputs, (kv, weight, multiplier), [torch.tensor(g) for g in grads])
    for name, got_grad, expected_grad in zip(("grad_kv", "grad_k_norm_weight", "grad_v_multiplier"), got, expected):
        np.testing.assert_allclose(got_grad.numpy(), expected_grad, rtol=1e-10, atol=1e-12, err_msg=name)


def _k_part(grad_kv, config):
    total_ctx, n_layers, _ = grad_kv.shape
    return grad_kv[:, :, :config.kv_size].reshape(total_ctx, n_layers, config.num_kv_heads, config.head_dim)


def test_reference_backward_position_outside_table_gives_nan_k_grad_and_no_weight_grad():
    config, arrays, grads, v_multiplier = _case(2, 16, 16, "neox", 2, 3)
    arrays[4] = arrays[4].copy()
    arrays[4][1] = MAX_POSITION
    grad_kv, grad_weight, grad_multiplier = _reference(config, arrays, grads, v_multiplier)
    assert np.isnan(_k_part(grad_kv, config)[1]).all()
    assert np.isfinite(_k_part(grad_kv, config)[[0, 2]]).all()
    # V of that token is copied as any other: its gradient is the incoming one, times the multiplier.
    np.testing.assert_array_equal(grad_kv[1, :, config.kv_size:].reshape(2, 2, 16),
                                  grads[1][:, 1] * v_multiplier.astype(np.float64)[:, None, None])
    kept = [0, 2]
    without = _reference(config, [arrays[0][kept], *arrays[1:4], arrays[4][kept]],
                         [g[:, kept] for g in grads], v_multiplier)
    np.testing.assert_allclose(grad_weight, without[1], rtol=1e-12)
    assert np.isfinite(grad_multiplier).all()


@pytest.mark.parametrize("outside", [2, -1])
def test_reference_backward_table_index_outside_the_tables_gives_that_layer_nan_k_grad_and_no_weight_grad(outside):
    config, arrays, grads, v_multiplier = _case(2, 16, 16, "gptj", 2, 3, seed=4)
    arrays = _with_tables(config, arrays)
    grad_kv, grad_weight, grad_multiplier = _reference(config, arrays, grads, v_multiplier,
                                                       np.array([1, outside], np.int32))
    assert np.isnan(_k_part(grad_kv, config)[:, 1]).all()
    named = _reference(config, arrays, grads, v_multiplier, np.array([1, 0], np.int32))
    np.testing.assert_array_equal(_k_part(grad_kv, config)[:, 0], _k_part(named[0], config)[:, 0])
    # V of that layer is copied as any other: its gradient is the incoming one, times the multiplier.
    np.testing.assert_array_equal(grad_kv[:, :, config.kv_size:], named[0][:, :, config.kv_size:])
    np.testing.assert_array_equal(grad_weight, [named[1][0], np.zeros(16)])
    np.testing.assert_array_equal(grad_multiplier, named[2])


def test_reference_backward_head_without_scale_gives_zero_k_grad_and_no_weight_grad():
    config, arrays, grads, _ = _case(2, 16, 16, "neox", 1, 2)
    kv, eps = arrays[0].copy(), np.zeros_like(arrays[2])
    kv[0, 0, :16] = np.float32(1e-40)  # a denormal head: fp32 mean(k*k) + 0 underflows
    arrays[0], arrays[2] = kv, eps
    grad_kv, grad_weight, _ = _reference(config, arrays, grads)
    np.testing.assert_array_equal(_k_part(grad_kv, config)[0, 0, 0], 0.0)
    assert np.isfinite(grad_kv).all()
    silenced = [grads[0].copy(), grads[1]]
    silenced[0][0, 0, 0] = 0.0
    np.testing.assert_allclose(grad_weight, _reference(config, arrays, silenced)[1], rtol=1e-12)


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e30], ids=["nan", "inf", "overflowing"])
def test_reference_backward_poisoned_head_gives_nan_k_grad_that_head_only(value):
    config, arrays, grads, _ = _case(2, 16, 16, "gptj", 1, 2)
    kv = arrays[0].copy()
    kv[1, 0, 16 + 3] = np.float32(value)  # token 1, head 1
    arrays[0] = kv
    grad_kv, grad_weight, _ = _reference(config, arrays, grads)
    k = _k_part(grad_kv, config)
    assert np.isnan(k[1, 0, 1]).all()
    assert np.isfinite(k[1, 0, 0]).all() and np.isfinite(k[0]).all()
    assert np.isfinite(grad_kv[:, :, config.kv_size:]).all()
    silenced = [grads[0].copy(), grads[1]]
    silenced[0][0, 1, 1] = 0.0
    clean = kv.copy()
    clean[1, 0, 16:32] = 0.0
    np.testing.assert_allclose(grad_weight, _reference(config, [clean, *arrays[1:]], silenced)[1], rtol=1e-12)


def test_reference_backward_refuses_grad_of_another_shape():
    config, arrays, grads, _ = _case(2, 16, 16, "neox", 2, 3)
    with pytest.raises(ValueError, match=r"Invalid grad_v shape for fused KV materialization: "
                                         r"got \(2, 2, 2, 16\), expected \(2, 3, 2, 16\)\."):
        _reference(config, arrays, (grads[0], grads[1][:, :2]))
