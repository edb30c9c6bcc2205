"""What only the jax backend has: x64, jit with donated outputs and caches, vmap, tile
overrides, NumPy outputs, the Triton and Mosaic GPU lowerings, and on a GPU real sizes.

What both backends must do alike (the reference, edge values, the cache, refusals) is
``test_contract_op.py``'s. Here too: interpret mode on the CPU, compiled on a GPU; fresh
random inputs (interop.testing.random_inputs), K under the tolerance table, V bit for
bit. CPU cases stay small: Pallas interpret time grows steeply with array size.
"""

import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fusedkv_jax import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_jax import devices
from fusedkv_jax import kernel as jax_kernel
from fusedkv_jax.ops import default_lowering
from interop.core.arrays import numpy_dtype
from interop.core.reference import (fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference,
                                    rope_cos_sin_cache)
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, random_inputs

ON_GPU = jax.default_backend() == "gpu"
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim, rope_style=config.rope_style)


def _inputs(config, *, n_layers, total_ctx, max_position=64, seed, **options):
    return random_inputs(config, n_layers=n_layers, total_ctx=total_ctx,
                         max_position=max_position, seed=seed, **options).arrays()


def _assert_matches_reference(k, v, host_inputs, config):
    k_expected, v_expected = fused_kv_norm_rope_reference(*host_inputs, **_static(config))
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)


def _poisoned(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)


def test_numpy_arrays_jax_would_hold_in_another_dtype_are_refused_with_the_dtype_given():
    config = FusedKVConfig(2, 16, 16)
    kv, weight, eps, table, positions = _inputs(config, n_layers=2, total_ctx=3, seed=40)
    shape = (2, 3, 2, 16)
    with pytest.raises(ValueError, match=re.escape(
            "Invalid kv dtype for fused KV materialization: got float64, expected one of "
            "('bfloat16', 'float16', 'float32').")):
        fused_kv_norm_rope(kv.astype(np.float64), weight, eps, table, positions, **_static(config))
    out = np.zeros(shape, np.float64)
    with pytest.raises(ValueError, match=r"Invalid k_out device/dtype for fused KV materialization: got "
                                         r"device=cpu, dtype=float64, expected device=\S+, dtype=bfloat16\."):
        fused_kv_norm_rope(kv, weight, eps, table, positions, **_static(config), k_out=out)
    for dtype in (np.float64, np.int64):
        cache = np.zeros((2, 4, 2, 16), dtype)
        with pytest.raises(ValueError, match=rf"Invalid k_cache device/dtype for fused KV materialization: got "
                                             rf"device=cpu, dtype={np.dtype(dtype).name}, "):
            fused_kv_norm_rope_into_cache(kv, weight, eps, table, positions, np.arange(3), cache,
                                          np.zeros((2, 4, 2, 16), kv.dtype), **_static(config))
    assert not out.any()


def test_int64_positions_and_float64_weights_with_x64_enabled():
    config = FusedKVConfig(2, 16, 12, "gptj")
    host = _inputs(config, n_layers=2, total_ctx=4, position_dtype="int64", weight_dtype="float64", seed=18)
    host = host[:4] + (np.array([3, -2, 2 ** 40, 60], np.int64),)
    with jax.enable_x64(True):
        device = [jax.device_put(a) for a in host]
        assert device[4].dtype == jnp.int64
        k, v = fused_kv_norm_rope(*device, **_static(config))
    _assert_matches_reference(k, v, host, config)


@pytest.mark.parametrize("lowering, config, total_ctx", [
    ("triton", FusedKVConfig(2, 16, 8, "neox"), 6),
    # Through refs its kernel aliases; its interpreter takes multiples of 64 tokens.
    ("mosaic_gpu", FusedKVConfig(2, 64, 32, "neox"), 64),
    ("mosaic_gpu", FusedKVConfig(2, 64, 32, "gptj"), 64),  # through views of its outputs as words
], ids=["triton", "mosaic_gpu", "mosaic_gpu-gptj"])
def test_inside_jit_with_donated_outputs_reuses_their_buffers(lowering, config, total_ctx):
    host = _inputs(config, n_layers=2, total_ctx=total_ctx, seed=13)
    shape = config.output_shape(2, total_ctx)
    k_out, v_out = _poisoned(shape, jnp.bfloat16), _poisoned(shape, jnp.bfloat16)
    pointers = k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()
    step = jax.jit(functools.partial(fused_kv_norm_rope, **_static(config), lowering=lowering),
                   donate_argnames=("k_out", "v_out"))
    k, v = step(*(jax.device_put(a) for a in host), k_out=k_out, v_out=v_out)
    assert k_out.is_deleted() and v_out.is_deleted()
    assert (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) == pointers
    _assert_matches_reference(k, v, host, config)


def _traced_launches(monkeypatch, module) -> list:
    """A list that grows by one each time ``module``'s ``_launch`` is traced (called in Python),
    from no trace kept: jax's caches are cleared first."""
    traced, launch = [], module._launch
    monkeypatch.setattr(module, "_launch", lambda *args, **kwargs: traced.append(1) or launch(*args, **kwargs))
    jax.clear_caches()
    return traced


def test_eager_calls_of_one_shape_trace_the_launch_once(monkeypatch):
    from fusedkv_jax import backward

    traced = _traced_launches(monkeypatch, backward)
    config = FusedKVConfig(3, 16, 8, "gptj")
    for seed in (61, 62, 63):
        host = _inputs(config, n_layers=2, total_ctx=5, seed=seed)
        k, v = fused_kv_norm_rope(*(jax.device_put(a) for a in host), **_static(config))
        _assert_matches_reference(k, v, host, config)
    assert len(traced) == 1


def test_vmap_over_kv_and_positions_matches_each_member():
    config = FusedKVConfig(2, 16, 16, "gptj")
    members = [_inputs(config, n_layers=2, total_ctx=4, seed=14 + i) for i in range(2)]
    _, weight, eps, cos_sin, _ = members[0]
    kv = jnp.stack([m[0] for m in members])
    positions = jnp.stack([m[4] for m in members])
    batched = jax.vmap(lambda kv, positions: fused_kv_norm_rope(
        kv, weight, eps, cos_sin, positions, **_static(config)))
    k, v = batched(kv, positions)
    for i, (member_kv, _, _, _, member_positions) in enumerate(members):
        _assert_matches_reference(k[i], v[i], (member_kv, weight, eps, cos_sin, member_positions), config)


def test_tile_overrides_cover_ragged_heads_and_tokens():
    config = FusedKVConfig(3, 24, 16, "neox")
    host = _inputs(config, n_layers=2, total_ctx=5, seed=16)
    k, v = fused_kv_norm_rope(*host, **_static(config), block_tokens=2, block_heads=2, num_warps=1)
    _assert_matches_reference(k, v, host, config)


LOOPED_CASES = [  # config, n_layers: K in runs and as rows, one layer, more layers than in flight
    (FusedKVConfig(2, 8, 8, "neox"), 3), (FusedKVConfig(3, 96, 64, "neox"), 2),
    (FusedKVConfig(2, 16, 8, "gptj"), 5), (FusedKVConfig(1, 32, 32, "neox"), 1),
]


@pytest.mark.parametrize("config, n_layers", LOOPED_CASES,
                         ids=lambda value: f"{value.rope_style}-d{value.head_dim}r{value.rotary_dim}"
                         if isinstance(value, FusedKVConfig) else f"{value}layers")
def test_programs_that_take_every_layer_match_the_reference(monkeypatch, config, n_layers):
    # Interpret mode never loops over layers by default (loops_over_layers), a GPU at long
    # contexts does: forced here so the CPU suite runs the looped kernel.
    monkeypatch.setattr(jax_kernel, "loops_over_layers", lambda *args, **kwargs: True)
    host = list(_inputs(config, n_layers=n_layers, total_ctx=5, seed=30 + n_layers))
    host[4][1], host[4][3] = -1, 64  # out of range: all-NaN K rows, V kept
    k, v = fused_kv_norm_rope(*host, **_static(config), block_tokens=2)
    _assert_matches_reference(k, v, host, config)
    slots = np.array([4, -1, 0, 9, 2])
    host, slots, k_cache, v_cache, scales = _cache_case(
        config, n_layers=n_layers, total_ctx=5, num_slots=6, slots=slots, k_dtype=FP8,
        v_dtype=numpy_dtype("bfloat16"), seed=40 + n_layers)
    k, v = fused_kv_norm_rope_into_cache(*host, slots, k_cache, v_cache, **_static(config), **scales,
                                         block_tokens=2)
    _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, scales, config)


@pytest.mark.parametrize("layer_rope_table", [[1, 0, 1, 1, 0], [1, -1, 0, 2, 1], [2, 0, 1]],
                         ids=["each-table-once", "indices-outside", "more-tables-than-layers"])
def test_programs_that_take_every_layer_rotate_each_by_its_own_table(monkeypatch, layer_rope_table):
    # A looped program loads each table's rows once where it has no fewer layers than tables,
    # else each layer's; an index outside the tables gives that layer all-NaN K.
    monkeypatch.setattr(jax_kernel, "loops_over_layers", lambda *args, **kwargs: True)
    config = FusedKVConfig(2, 16, 16, "neox")
    layer_rope_table = np.array(layer_rope_table, np.int32)
    n_tables = 3 if len(layer_rope_table) == 3 else 2
    tables = np.stack([rope_cos_sin_cache(64, 16, base) for base in (1e6, 1e4, 5e5)[:n_tables]])
    host = list(_inputs(config, n_layers=len(layer_rope_table), total_ctx=5, seed=50 + n_tables))
    host[3] = tables
    k, v = fused_kv_norm_rope(*host, **_static(config), layer_rope_table=layer_rope_table, block_tokens=2)
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config), layer_rope_table=layer_rope_table)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    outside = (layer_rope_table < 0) | (layer_rope_table >= n_tables)
    assert np.isnan(np.asarray(k, np.float32)[outside]).all()
    assert not np.isnan(np.asarray(k, np.float32)[~outside]).any()


@pytest.mark.parametrize("total_ctx, n_layers, config, looped, tile", [
    # The tiles of a GPU of 132 multiprocessors: one wave of one-layer
    # programs at 256 tokens on 2 warps; looped programs of one token, 1 warp for head_dim
    # 256 in runs (halves of 128), 4 for the draft shape (halves of 64) and for rotary 64
    # of 128 as rows.
    (256, 5, FusedKVConfig(8, 128, 128, "neox"), False, (1, 8, 2)),
    (4096, 5, FusedKVConfig(2, 256, 256, "neox"), True, (1, 2, 1)),
    (32768, 5, FusedKVConfig(8, 128, 128, "neox"), True, (1, 8, 4)),
    (32768, 8, FusedKVConfig(4, 128, 64, "neox"), True, (1, 4, 4)),
    (2048, 5, FusedKVConfig(2, 256, 256, "neox"), False, None),  # looped, it would be less than a wave
    (32768, 1, FusedKVConfig(8, 128, 128, "neox"), False, None),  # one layer: nothing to loop over
])
def test_programs_take_every_layer_when_a_wave_of_them_fills_the_gpu(monkeypatch, total_ctx, n_layers, config,
                                                                     looped, tile):
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    shape = (total_ctx, n_layers, config.num_kv_heads, config.head_dim)
    assert jax_kernel.loops_over_layers(*shape) is looped
    assert jax_kernel.loops_over_layers(*shape, interpret=True) is False
    if tile is not None:
        assert jax_kernel.default_tile(*shape, rotary_dim=config.rotary_dim) == tile


def _kernel_memory_accesses(call, args):
    """``(kind, operand)`` of each load and store of the Pallas kernel traced by ``call``, in
    program order: kind ``"load"`` or ``"store"``, operand the index of the kernel's ref."""
    def pallas_call(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn
            for inner in (getattr(param, "jaxpr", None) for param in eqn.params.values()):
                found = inner is not None and pallas_call(getattr(inner, "jaxpr", inner))
                if found:
                    return found
        return None

    kernel = pallas_call(jax.make_jaxpr(call)(*args).jaxpr).params["jaxpr"]
    kinds = {"masked_load": "load", "masked_swap": "store"}
    return [(kinds[eqn.primitive.name], kernel.invars.index(eqn.invars[0]))
            for eqn in kernel.eqns if eqn.primitive.name in kinds]


@pytest.mark.parametrize("looped", [True, False], ids=["every-layer", "one-layer"])
@pytest.mark.parametrize("config", [FusedKVConfig(2, 16, 16, "neox"), FusedKVConfig(2, 16, 8, "gptj")],
                         ids=["k-in-halves", "k-as-rows"])
def test_a_program_issues_its_loads_before_the_stores_that_could_hold_them_up(monkeypatch, config, looped):
    # The compiler keeps a load after a store (the outputs might alias kv), so the kernel's
    # speed rests on this order: positions first (the cos/sin rows wait on them), then the
    # loads of the first layers, the cos/sin rows, and before each layer's stores the loads
    # of the layers LAYERS_IN_FLIGHT after it.
    monkeypatch.setattr(jax_kernel, "loops_over_layers", lambda *args, **kwargs: looped)
    n_layers = 5
    kv, cos_sin, positions, k_dest, v_dest = 0, 1, 2, 5, 6  # the kernel's refs with a K-norm
    args = (jax.ShapeDtypeStruct((4, n_layers, 2 * config.kv_size), jnp.bfloat16),
            jax.ShapeDtypeStruct((n_layers, config.head_dim), jnp.float32),
            jax.ShapeDtypeStruct((n_layers,), jnp.float32),
            jax.ShapeDtypeStruct((8, config.rotary_dim), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32))
    accesses = _kernel_memory_accesses(
        functools.partial(fused_kv_norm_rope, **_static(config), interpret=False), args)
    stores = [i for i, (kind, _) in enumerate(accesses) if kind == "store"]
    kv_loads = [i for i, access in enumerate(accesses) if access == ("load", kv)]
    cos_sin_loads = [i for i, access in enumerate(accesses) if access == ("load", cos_sin)]
    assert accesses[0] == ("load", positions)
    assert len(cos_sin_loads) == 2 and 0 < min(cos_sin_loads) and max(cos_sin_loads) < stores[0]
    assert {accesses[i][1] for i in stores} == {k_dest, v_dest}
    program_layers = n_layers if looped else 1
    kv_loads_per_layer, stores_per_layer = len(kv_loads) // program_layers, len(stores) // program_layers
    assert (kv_loads_per_layer * program_layers, stores_per_layer * program_layers) == (len(kv_loads), len(stores))
    for j, store in enumerate(stores):
        loaded_layers = min(program_layers, j // stores_per_layer + jax_kernel.LAYERS_IN_FLIGHT + 1)
        assert sum(load < store for load in kv_loads) >= loaded_layers * kv_loads_per_layer
    assert sum(load < cos_sin_loads[0] for load in kv_loads) == (
        min(program_layers, jax_kernel.LAYERS_IN_FLIGHT) * kv_loads_per_layer)


SMALL = FusedKVConfig(2, 8, 8, "neox")


def _bad_call_args(**overrides):
    kv, weight, eps, cos_sin, positions = _inputs(SMALL, n_layers=2, total_ctx=3, seed=17)
    args = dict(kv=kv, k_norm_weight=weight, eps=eps, cos_sin_cache=cos_sin, positions=positions)
    args.update(overrides)
    return args


def test_rejected_call_under_jit_leaves_donated_outputs_untouched():
    step = jax.jit(functools.partial(fused_kv_norm_rope, **_static(SMALL)),
                   donate_argnames=("k_out", "v_out"))
    args = _bad_call_args(eps=np.ones(3, np.float32))
    poison = np.full(SMALL.output_shape(2, 3), np.nan, numpy_dtype("bfloat16"))
    k_out, v_out = jax.device_put(poison), jax.device_put(poison)
    with pytest.raises(ValueError, match="^Invalid stacked eps shape"):
        step(**args, k_out=k_out, v_out=v_out)
    assert not k_out.is_deleted() and not v_out.is_deleted()
    assert_bit_exact(k_out, poison, name="k_out")
    assert_bit_exact(v_out, poison, name="v_out")


@pytest.mark.parametrize("overrides, error, message", [
    (dict(block_tokens=2.0), TypeError,
     "Invalid block_tokens for fused KV materialization: got 2.0 (float), expected a power of two (an int)."),
    (dict(block_tokens=3), ValueError,
     "Invalid block_tokens for fused KV materialization: got 3, expected a power of two."),
], ids=["block_tokens-float", "block_tokens-3"])
def test_tile_overrides_that_are_not_powers_of_two_are_refused(overrides, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(**_bad_call_args(), **_static(SMALL), **overrides)


@pytest.mark.parametrize("name", ["eps", "positions", "cache_loc"])
def test_a_big_endian_numpy_array_is_refused_naming_it(name):
    arrays = _bad_call_args()
    into_cache = name == "cache_loc"
    if into_cache:
        cache = np.zeros((2, 4, SMALL.num_kv_heads, SMALL.head_dim), arrays["kv"].dtype)
        arrays.update(cache_loc=np.array([0, 2, -1], np.int32), k_cache=cache, v_cache=cache.copy())
    arrays[name] = arrays[name].astype(arrays[name].dtype.newbyteorder(">"))
    message = (f"Invalid {name} for fused KV materialization: got a big-endian array (dtype "
               f"{arrays[name].dtype.str}), expected native byte order (pass "
               f"{name}.astype({name}.dtype.newbyteorder('='))).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        (fused_kv_norm_rope_into_cache if into_cache else fused_kv_norm_rope)(**arrays, **_static(SMALL))


OVERLAP = "got a buffer overlapping {}, expected outputs that overlap neither each other nor kv."


def test_one_array_as_both_outputs_is_refused_under_jit():
    poison = _poisoned(SMALL.output_shape(2, 3), jnp.bfloat16)
    message = "Invalid v_out for fused KV materialization: " + OVERLAP.format("k_out")
    step = jax.jit(lambda out, **args: fused_kv_norm_rope(**args, **_static(SMALL), k_out=out, v_out=out))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):  # jax appends a note on its traceback
        step(poison, **_bad_call_args())


def test_check_positions_is_refused_under_jit_where_positions_have_no_values():
    step = jax.jit(lambda positions, **args: fused_kv_norm_rope(**args, positions=positions, **_static(SMALL),
                                                               check_positions=True))
    args = _bad_call_args()
    positions = args.pop("positions")
    message = ("Invalid check_positions for fused KV materialization: got True on traced positions (inside "
               "jax.jit or another transformation), expected False there (the values are not known until the "
               "call runs; out-of-range positions give all-NaN K rows).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):  # jax appends a note on its traceback
        step(positions, **args)


def test_numpy_outputs_are_checked_as_the_callers_own_buffers():
    args = _bad_call_args()
    read_only = np.full(SMALL.output_shape(2, 3), np.nan, np.float32).astype(numpy_dtype("bfloat16"))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid k_out for fused KV materialization: got a read-only array, expected a writable one "
            "(pass a copy: np.array(k_out)).") + "$"):
        fused_kv_norm_rope(**args, **_static(SMALL), k_out=read_only)
    over_kv = args["kv"].reshape(-1)[:96].reshape(SMALL.output_shape(2, 3))
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid v_out for fused KV materialization: " + OVERLAP.format("kv")) + "$"):
        fused_kv_norm_rope(**args, **_static(SMALL), v_out=over_kv)


# The paged-cache entry point.

def _cache_case(config, *, n_layers, total_ctx, num_slots, slots, k_dtype, v_dtype, seed):
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, seed=seed)
    rng = np.random.default_rng(seed + 100)
    shape = (n_layers, num_slots, config.num_kv_heads, config.head_dim)
    # Poisoned caches: what is not written must come back bit for bit (NaN included).
    k_cache = (8.0 * rng.standard_normal(shape)).astype(np.dtype(k_dtype))
    v_cache = (8.0 * rng.standard_normal(shape)).astype(np.dtype(v_dtype))
    k_cache[:, ::3] = np.nan
    v_cache[:, 1::3] = np.nan
    scales = {}
    if np.dtype(k_dtype) == FP8:
        scales["k_scale"] = rng.uniform(0.01, 0.5, n_layers).astype(np.float32)
    if np.dtype(v_dtype) == FP8:
        scales["v_scale"] = rng.uniform(0.01, 0.5, n_layers).astype(np.float32)
    return host, np.asarray(slots), k_cache, v_cache, scales


def _assert_cache_matches_reference(k_cache, v_cache, host, slots, k_before, v_before, scales, config):
    k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(
        *host, slots, k_before, v_before, **_static(config), **scales)
    assert_close(k_cache, k_expected, name="k_cache")
    if "v_scale" in scales:
        assert_close(v_cache, v_expected, name="v_cache")
    else:
        assert_bit_exact(v_cache, v_expected, name="v_cache")
    written = np.zeros(k_before.shape[1], bool)
    written[[s for s in slots.tolist() if 0 <= s < k_before.shape[1]]] = True
    assert_bit_exact(np.asarray(k_cache)[:, ~written], k_before[:, ~written], name="k_cache untouched")
    assert_bit_exact(np.asarray(v_cache)[:, ~written], v_before[:, ~written], name="v_cache untouched")


def test_cache_under_jit_with_donated_caches_updates_in_place():
    config = FusedKVConfig(2, 16, 16, "gptj")
    host, slots, k_cache, v_cache, _ = _cache_case(
        config, n_layers=2, total_ctx=4, num_slots=6, slots=[5, -1, 0, 2],
        k_dtype=numpy_dtype("bfloat16"), v_dtype=numpy_dtype("bfloat16"), seed=22)
    # Copies owned by jax: on the CPU, device_put may alias the NumPy buffer, which
    # donation cannot reuse.
    k_device, v_device = jnp.array(k_cache, copy=True), jnp.array(v_cache, copy=True)
    pointers = k_device.unsafe_buffer_pointer(), v_device.unsafe_buffer_pointer()
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(config)),
                   donate_argnums=(6, 7))
    k, v = step(*(jax.device_put(a) for a in host), jax.device_put(slots), k_device, v_device)
    assert k_device.is_deleted() and v_device.is_deleted()
    assert (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) == pointers
    _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, {}, config)


def test_eager_cache_calls_of_one_shape_trace_the_launch_once(monkeypatch):
    traced = _traced_launches(monkeypatch, jax_kernel)
    config = FusedKVConfig(3, 16, 8, "neox")
    for seed in (64, 65, 66):
        host, slots, k_cache, v_cache, _ = _cache_case(
            config, n_layers=2, total_ctx=5, num_slots=7, slots=[6, 0, -1, 3, 2],
            k_dtype=numpy_dtype("bfloat16"), v_dtype=numpy_dtype("bfloat16"), seed=seed)
        k, v = fused_kv_norm_rope_into_cache(*(jax.device_put(a) for a in host), jax.device_put(slots),
                                             jax.device_put(k_cache), jax.device_put(v_cache), **_static(config))
        _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, {}, config)
    assert len(traced) == 1


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("options", ["plain", "no K-norm and v_multiplier"])
def test_mosaic_cache_writes_each_row_to_its_slot_and_leaves_every_other_slot(options, rope_style):
    config = FusedKVConfig(2, 64, 32, rope_style)
    slots = np.random.default_rng(40).permutation(300)[:128].astype(np.int32)
    slots[::5] = -1  # padding
    slots[[3, 7]] = [300, 2**31 - 1]  # past the cache: skipped, not wrapped
    host, slots, k_cache, v_cache, _ = _cache_case(
        config, n_layers=3, total_ctx=128, num_slots=300, slots=slots, k_dtype=numpy_dtype("bfloat16"),
        v_dtype=numpy_dtype("bfloat16"), seed=41)
    given = {}
    if options != "plain":
        host = (host[0], None, None, *host[3:])
        given = dict(v_multiplier=np.array([0.5, -1.0, 3.0], np.float32))
    k, v = fused_kv_norm_rope_into_cache(*host, slots, k_cache, v_cache, **_static(config), **given,
                                         lowering="mosaic_gpu")
    k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(*host, slots, k_cache, v_cache,
                                                                     **_static(config), **given)
    assert_close(k, k_expected, name="k_cache")
    (assert_close if given else assert_bit_exact)(v, v_expected, name="v_cache")
    written = np.zeros(300, bool)
    written[slots[(slots >= 0) & (slots < 300)]] = True
    assert_bit_exact(np.asarray(k)[:, ~written], k_cache[:, ~written], name="k_cache untouched")
    assert_bit_exact(np.asarray(v)[:, ~written], v_cache[:, ~written], name="v_cache untouched")


def test_mosaic_cache_under_jit_with_donated_caches_updates_in_place():
    config = FusedKVConfig(2, 64, 64, "neox")
    slots = np.arange(64, dtype=np.int32)[::-1] * 2
    host, slots, k_cache, v_cache, _ = _cache_case(
        config, n_layers=2, total_ctx=64, num_slots=130, slots=slots, k_dtype=numpy_dtype("bfloat16"),
        v_dtype=numpy_dtype("bfloat16"), seed=42)
    k_device, v_device = jnp.array(k_cache, copy=True), jnp.array(v_cache, copy=True)
    pointers = k_device.unsafe_buffer_pointer(), v_device.unsafe_buffer_pointer()
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(config), lowering="mosaic_gpu"),
                   donate_argnums=(6, 7))
    k, v = step(*(jax.device_put(a) for a in host), jax.device_put(slots), k_device, v_device)
    assert k_device.is_deleted() and v_device.is_deleted()
    assert (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) == pointers
    _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, {}, config)


def test_mosaic_cache_refuses_an_fp8_cache_before_anything_is_written():
    config = FusedKVConfig(2, 64, 64, "neox")
    host, slots, k_cache, v_cache, scales = _cache_case(
        config, n_layers=2, total_ctx=64, num_slots=70, slots=np.arange(64), k_dtype=FP8, v_dtype=FP8, seed=43)
    k_before = k_cache.copy()
    message = ("Invalid lowering for fused KV materialization: got 'mosaic_gpu' for a float8_e4m3fn cache, "
               "expected 'triton' (the Mosaic GPU kernel writes K and V in kv's dtype; an fp8 cache is "
               "quantized from their fp32 values by the Triton lowering).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope_into_cache(*host, slots.astype(np.int32), k_cache, v_cache, **_static(config), **scales,
                                      lowering="mosaic_gpu")
    assert_bit_exact(k_cache, k_before, name="k_cache")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile the kernel for real")
def test_both_entry_points_lower_to_triton_for_a_gpu():
    # Pallas lowers to Triton IR in Python, so a machine without a GPU still catches a
    # construct the Triton lowering rejects (shapes, primitives, fp8 casts, vmap).
    config = FusedKVConfig(8, 96, 64, "gptj")
    kv = jax.ShapeDtypeStruct((33, 5, 2 * config.kv_size), jnp.bfloat16)
    small = (jax.ShapeDtypeStruct((5, 96), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32),
             jax.ShapeDtypeStruct((100, 64), jnp.float32), jax.ShapeDtypeStruct((33,), jnp.int32))
    cache = jax.ShapeDtypeStruct((5, 50, 8, 96), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((5,), jnp.float32)
    static = dict(_static(config), interpret=False)
    calls = [
        (functools.partial(fused_kv_norm_rope, **static), (kv, *small)),
        (jax.vmap(functools.partial(fused_kv_norm_rope, **static), in_axes=(0, None, None, None, None)),
         (jax.ShapeDtypeStruct((2, *kv.shape), kv.dtype), *small)),
        (lambda *a: fused_kv_norm_rope_into_cache(*a[:8], **static, k_scale=a[8], v_scale=a[9]),
         (kv, *small, small[3], cache, cache, scale, scale)),
    ]
    for call, args in calls:
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "xla.gpu.triton" in text or "triton_kernel_call" in text


# On a GPU: real sizes, compiled by Triton.

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (jax.default_backend() == 'gpu')")
DRAFT = FusedKVConfig(8, 128, 128, "neox")


@pytest.mark.gpu
@gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config, total_ctx, dtype", [
    (DRAFT, 16, "bfloat16"), (DRAFT, 4096, "bfloat16"), (DRAFT, 4099, "float16"),
    (FusedKVConfig(8, 96, 64, "gptj"), 1000, "bfloat16"), (FusedKVConfig(4, 192, 128, "neox"), 777, "float32"),
    # Long enough for programs that take every layer (loops_over_layers), K in runs and as rows:
    (FusedKVConfig(2, 256, 256, "neox"), 4100, "bfloat16"), (FusedKVConfig(4, 128, 64, "neox"), 4100, "float16"),
    (FusedKVConfig(8, 96, 64, "gptj"), 4100, "bfloat16"),
])
def test_gpu_matches_reference_into_poisoned_donated_outputs(config, total_ctx, dtype):
    host = _inputs(config, n_layers=5, total_ctx=total_ctx, max_position=32768, dtype=dtype, seed=total_ctx)
    shape = config.output_shape(5, total_ctx)
    k_out, v_out = _poisoned(shape, jnp.dtype(dtype)), _poisoned(shape, jnp.dtype(dtype))
    pointer = k_out.unsafe_buffer_pointer()
    step = jax.jit(functools.partial(fused_kv_norm_rope, **_static(config)),
                   donate_argnames=("k_out", "v_out"))
    k, v = step(*(jax.device_put(a) for a in host), k_out=k_out, v_out=v_out)
    assert k.unsafe_buffer_pointer() == pointer
    _assert_matches_reference(k, v, host, config)
    k_fresh, v_fresh = fused_kv_norm_rope(*(jax.device_put(a) for a in host), **_static(config))
    _assert_matches_reference(k_fresh, v_fresh, host, config)


@pytest.mark.gpu
@gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("cache_dtype", ["bfloat16", FP8])
def test_gpu_cache_into_donated_paged_cache(cache_dtype):
    total_ctx, num_slots = 4096, 6000
    slots = np.random.default_rng(5).permutation(num_slots)[:total_ctx].astype(np.int32)
    slots[::7] = -1
    dtype = numpy_dtype("bfloat16") if cache_dtype == "bfloat16" else cache_dtype
    host, slots, k_cache, v_cache, scales = _cache_case(
        DRAFT, n_layers=5, total_ctx=total_ctx, num_slots=num_slots, slots=slots,
        k_dtype=dtype, v_dtype=dtype, seed=23)
    k_device, v_device = jax.device_put(k_cache), jax.device_put(v_cache)
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(DRAFT)),
                   donate_argnums=(6, 7))
    k, v = step(*(jax.device_put(a) for a in host), jax.device_put(slots), k_device, v_device,
                **{name: jax.device_put(s) for name, s in scales.items()})
    assert k_device.is_deleted()
    _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, scales, DRAFT)


@pytest.mark.gpu
@gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("block_tokens, block_heads, num_warps", [(1, 8, 1), (4, 4, 4), (16, 8, 8)])
def test_gpu_tile_overrides_agree(block_tokens, block_heads, num_warps):
    host = _inputs(DRAFT, n_layers=5, total_ctx=1023, max_position=32768, seed=24)
    k, v = fused_kv_norm_rope(*(jax.device_put(a) for a in host), **_static(DRAFT),
                              block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps)
    _assert_matches_reference(k, v, host, DRAFT)


@pytest.mark.gpu
@gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config, total_ctx", [(DRAFT, 16), (DRAFT, 4096), (FusedKVConfig(8, 96, 64, "gptj"), 1000)])
def test_in_a_jit_with_xla_pdl_each_call_reads_the_kv_written_just_before_it_and_is_read_just_after(config,
                                                                                                   total_ctx):
    # XLA's programmatic dependent launch starts a kernel while the one before it runs. Each
    # call's kv is a fusion's output, scaled from the last call's kv (by -2 or -1/2: exact)
    # once that call has written V, and a fusion reads each call's V.
    host = _inputs(config, n_layers=5, total_ctx=total_ctx, max_position=4096, seed=total_ctx + 7)
    factors = [-2.0, -0.5] * 4

    def run(kv, *rest):
        outputs, v = [], None
        for factor in factors:
            if v is not None:
                kv, v = jax.lax.optimization_barrier((kv, v))
            kv = kv * jnp.asarray(factor, kv.dtype)
            k, v = fused_kv_norm_rope(kv, *rest, **_static(config))
            outputs.append((k, v, v.astype(jnp.float32) * 2))
        return outputs

    outputs = jax.jit(run, compiler_options={"xla_gpu_enable_pdl": True})(*(jax.device_put(a) for a in host))
    kv = host[0]
    for factor, (k, v, doubled) in zip(factors, outputs):
        kv = kv * np.asarray(factor, kv.dtype)
        _assert_matches_reference(k, v, (kv, *host[1:]), config)
        np.testing.assert_array_equal(np.asarray(doubled), np.asarray(v, np.float32) * 2)


def test_a_traced_call_asks_no_tracer_for_its_devices_or_sharding(monkeypatch):
    # Either raises an error describing where the tracer came from, built by walking the
    # whole program traced so far: a jit of many calls would trace in quadratic time.
    def asked(self, *args):
        raise AssertionError("a tracer was asked for its devices or sharding")

    monkeypatch.setattr(jax.core.Tracer, "devices", asked)
    monkeypatch.setattr(jax.core.Tracer, "sharding", property(asked))
    host = _inputs(DRAFT, n_layers=2, total_ctx=5, max_position=64, seed=9)
    k, v = jax.jit(functools.partial(fused_kv_norm_rope, **_static(DRAFT)))(*host)
    _assert_matches_reference(k, v, host, DRAFT)
    # The cache entry point and the gradient, traced alone.
    cache = np.zeros((2, 8, DRAFT.num_kv_heads, DRAFT.head_dim), host[0].dtype)
    slots = np.arange(5, dtype=np.int32)
    jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(DRAFT))).trace(*host, slots, cache, cache)
    jax.jit(jax.grad(lambda kv: fused_kv_norm_rope(kv, *host[1:], **_static(DRAFT))[0].astype(jnp.float32).sum())
            ).trace(host[0])


@pytest.mark.parametrize("total_ctx, n_layers, config, itemsize, tile", [
    # A GPU of 132 multiprocessors wants 264 programs: one token of 32 heads of 256 bf16
    # in 3 layers (16 KiB of K a tile) gives 96 with one head a tile, 16 tokens 384 with four.
    (1, 3, FusedKVConfig(32, 256, 256, "neox"), 2, (1, 1, 2)),
    (16, 3, FusedKVConfig(32, 256, 256, "neox"), 2, (1, 4, 2)),
    (1, 8, FusedKVConfig(16, 128, 128, "neox"), 2, (1, 1, 1)),
    (1, 3, FusedKVConfig(16, 256, 128, "neox"), 4, (1, 1, 4)),  # K as rows: four heads of fp32, 4 KiB
    (16, 3, FusedKVConfig(16, 256, 128, "neox"), 4, (1, 2, 2)),
    (1, 3, FusedKVConfig(5, 128, 128, "neox"), 4, (1, 1, 1)),
    (1, 5, DRAFT, 4, (1, 1, 1)),
    # 2 KiB of K a tile or less: every head (or four, as rows), however few the programs.
    (1, 5, DRAFT, 2, (1, 8, 8)),
    (16, 5, DRAFT, 2, (1, 8, 8)),
    (1, 5, FusedKVConfig(16, 192, 192, "gptj"), 2, (1, 4, 4)),
    (64, 5, DRAFT, 4, (1, 8, 2)),  # 320 programs of one token and every head: enough
])
def test_short_calls_split_tiles_of_more_than_2_kib_of_k_over_their_heads_until_the_gpu_is_filled(
        monkeypatch, total_ctx, n_layers, config, itemsize, tile):
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    shape = (total_ctx, n_layers, config.num_kv_heads, config.head_dim)
    options = dict(rotary_dim=config.rotary_dim, rope_style=config.rope_style, itemsize=itemsize)
    assert jax_kernel.default_tile(*shape, **options) == tile
    block_tokens, block_heads, _ = tile
    programs = -(-total_ctx // block_tokens) * n_layers * -(-config.num_kv_heads // block_heads)
    tile_bytes = block_heads * (1 << (config.head_dim - 1).bit_length()) * itemsize
    assert programs >= 2 * 132 or block_heads == 1 or tile_bytes <= 2048
    # A caller's heads are kept, and the interpreter still takes every head.
    assert jax_kernel.default_tile(*shape, **options, block_heads=8)[1] == 8
    assert jax_kernel.default_tile(*shape, **options, interpret=True)[1] == 1 << (config.num_kv_heads - 1).bit_length()


@pytest.mark.parametrize("total_ctx, n_layers, config, tile", [
    # K as rows (gptj, or a partial neox rotary): at most 4 heads a tile, whatever head_dim,
    # the threads then as for any tile (looped programs of gptj rows on 2 warps).
    (4096, 5, FusedKVConfig(16, 192, 192, "gptj"), (1, 4, 2)),
    (256, 3, FusedKVConfig(16, 256, 128, "neox"), (1, 4, 8)),
    (4096, 3, FusedKVConfig(32, 80, 40, "neox"), (1, 4, 4)),
    (4096, 5, FusedKVConfig(6, 64, 64, "gptj"), (2, 4, 1)),  # 6 heads: tiles of 4 (the second ragged), 2 tokens
    (4096, 5, FusedKVConfig(2, 64, 64, "gptj"), None),  # 2 heads: all of them
    # K in its neox halves: every head in one tile, however many.
    (4096, 3, FusedKVConfig(32, 256, 256, "neox"), (1, 32, 8)),
])
def test_tiles_that_load_k_as_rows_take_at_most_four_heads(monkeypatch, total_ctx, n_layers, config, tile):
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    shape = (total_ctx, n_layers, config.num_kv_heads, config.head_dim)
    chosen = jax_kernel.default_tile(*shape, rotary_dim=config.rotary_dim, rope_style=config.rope_style)
    every_head = 1 << (config.num_kv_heads - 1).bit_length()
    assert chosen[1] == min(every_head, 4) if jax_kernel.loads_k_rows(config) else every_head
    if tile is not None:
        assert chosen == tile
    interpreted = jax_kernel.default_tile(*shape, rotary_dim=config.rotary_dim, rope_style=config.rope_style,
                                          interpret=True)
    assert interpreted[1] == every_head  # interpreted: few, large programs


def _triton_calls_lowered_for_a_gpu(call, *args) -> list[str]:
    """The Triton custom calls of ``call`` lowered for CUDA (jax's cross-platform lowering:
    the Pallas kernel becomes Triton IR on any machine, no GPU needed)."""
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [target for target in re.findall(r"custom_call @([\w$.]+)", text) if "triton" in target]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config, kv_dtype, head_blocks", [
    (FusedKVConfig(32, 256, 256, "neox"), ml_dtypes.bfloat16, 32),
    (DRAFT, ml_dtypes.bfloat16, 1),  # 2 KiB of K: every head in one program
    (DRAFT, np.float32, 8),
], ids=str)
def test_a_one_token_call_lowered_for_a_gpu_splits_its_heads_by_the_bytes_of_its_kv(monkeypatch, config, kv_dtype,
                                                                                    head_blocks):
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # the tiles of an H200
    host = _inputs(config, n_layers=3, total_ctx=1, max_position=64, seed=5)
    call = functools.partial(fused_kv_norm_rope, **_static(config), interpret=False)
    text = jax.jit(call).trace(host[0].astype(kv_dtype), *host[1:]).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+)", text) == [
        ("1", "3", str(head_blocks))]


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config, n_layers, total_ctx", [
    (FusedKVConfig(8, 128, 128, "neox"), 5, 4096),  # K in halves, programs of every layer
    (FusedKVConfig(4, 128, 64, "neox"), 3, 256),  # K as rows beside an unrotated tail
    (FusedKVConfig(16, 192, 192, "gptj"), 5, 1000),  # gptj, tiles of 4 of the 16 heads
    (FusedKVConfig(1, 80, 40, "gptj"), 1, 7),
], ids=lambda value: f"h{value.num_kv_heads}d{value.head_dim}r{value.rotary_dim}{value.rope_style}"
   if isinstance(value, FusedKVConfig) else str(value))
def test_every_form_of_the_kernel_lowers_to_one_triton_call_without_a_gpu(monkeypatch, config, n_layers, total_ctx):
    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # the tiles of an H200
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=4096, seed=3)
    plain = functools.partial(fused_kv_norm_rope, **_static(config), interpret=False)
    assert len(_triton_calls_lowered_for_a_gpu(plain, *host)) == 1
    kv = host[0]
    with_options = functools.partial(plain, v_multiplier=np.full(n_layers, 0.5, np.float32),
                                     layer_rope_table=np.arange(n_layers, dtype=np.int32) % 2)
    assert len(_triton_calls_lowered_for_a_gpu(with_options, kv, host[1], host[2],
                                               np.stack([host[3], host[3]]), host[4])) == 1
    slots = np.arange(total_ctx, dtype=np.int32)[::-1].copy()
    cache = np.zeros((n_layers, total_ctx + 3, config.num_kv_heads, config.head_dim), ml_dtypes.float8_e4m3fn)
    scales = np.ones(n_layers, np.float32)
    into_cache = functools.partial(fused_kv_norm_rope_into_cache, **_static(config), interpret=False)
    assert len(_triton_calls_lowered_for_a_gpu(
        lambda *args: into_cache(*args, k_scale=scales, v_scale=scales), *host, slots, cache, cache)) == 1


@pytest.mark.gpu
@gpu
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config, n_layers, total_ctx", [
    (FusedKVConfig(16, 192, 192, "gptj"), 5, 1000),
    (FusedKVConfig(6, 80, 40, "neox"), 3, 517),  # ragged heads: tiles of 4
    (FusedKVConfig(16, 256, 128, "neox"), 3, 3),
], ids=lambda value: f"h{value.num_kv_heads}d{value.head_dim}r{value.rotary_dim}{value.rope_style}"
   if isinstance(value, FusedKVConfig) else str(value))
def test_gpu_tiles_of_fewer_heads_than_the_call_agree(config, n_layers, total_ctx):
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=4096, seed=27 + total_ctx)
    k, v = fused_kv_norm_rope(*(jax.device_put(a) for a in host), **_static(config))
    _assert_matches_reference(k, v, host, config)


# The Mosaic GPU lowering (lowering="mosaic_gpu"): interpret mode on the CPU (jax 0.10.2's
# Mosaic GPU interpreter copies whole 64-token blocks only), odd contexts on a GPU.

MOSAIC_CASES = [  # config, n_layers, total_ctx, kv dtype, position dtype
    (FusedKVConfig(2, 64, 64, "neox"), 2, 64, "bfloat16", "int32"),
    (FusedKVConfig(1, 96, 32, "neox"), 1, 64, "float16", "int64"),
    (FusedKVConfig(1, 64, 32, "neox"), 1, 128, "bfloat16", "int32"),
    # gptj as words of pairs: rotated whole, with a tail of pairs, fp16.
    (FusedKVConfig(2, 64, 64, "gptj"), 2, 64, "bfloat16", "int32"),
    (FusedKVConfig(1, 96, 32, "gptj"), 1, 128, "float16", "int64"),
]


@pytest.mark.parametrize("config, n_layers, total_ctx, dtype, position_dtype", MOSAIC_CASES,
                         ids=lambda value: str(value) if not isinstance(value, FusedKVConfig) else
                         f"h{value.num_kv_heads}d{value.head_dim}r{value.rotary_dim}{value.rope_style}")
def test_mosaic_matches_reference(config, n_layers, total_ctx, dtype, position_dtype):
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, dtype=dtype,
                   position_dtype=position_dtype, seed=30 + total_ctx)
    result = fused_kv_norm_rope(*host, **_static(config), lowering="mosaic_gpu")
    assert type(result) is tuple  # as the Triton lowering's (jax.vjp's cotangents take its structure)
    k, v = result
    assert k.shape == v.shape == config.output_shape(n_layers, total_ctx)
    assert k.dtype == v.dtype == host[0].dtype
    _assert_matches_reference(k, v, host, config)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("n_layers, total_ctx, heads", [(1, 64, 1), (1, 256, 2), (3, 192, 4)])
def test_mosaic_programs_of_one_head_a_group_of_heads_and_every_head_match_the_reference(n_layers, total_ctx, heads,
                                                                                         rope_style, monkeypatch):
    from fusedkv_jax import mosaic_kernel

    monkeypatch.setattr(devices, "multiprocessors", lambda: 4)
    config = FusedKVConfig(4, 64, 32, rope_style)  # four heads, a rotary tail
    assert mosaic_kernel.heads_per_program(config, total_ctx, n_layers, jnp.bfloat16) == heads
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, seed=39 + total_ctx)
    host = host[:4] + (np.where(np.arange(total_ctx) % 5 == 2, -1, host[4]).astype(host[4].dtype),)
    k, v = fused_kv_norm_rope(*host, **_static(config), lowering="mosaic_gpu")
    _assert_matches_reference(k, v, host, config)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("options", ["no K-norm", "v_multiplier", "layer_rope_table", "all three"])
@pytest.mark.parametrize("n_layers, total_ctx, heads", [(1, 64, 1), (1, 256, 2), (3, 192, 4)])
def test_mosaic_takes_every_option_of_the_op_in_programs_of_one_head_and_of_several(options, n_layers, total_ctx,
                                                                                   heads, rope_style, monkeypatch):
    from fusedkv_jax import mosaic_kernel

    monkeypatch.setattr(devices, "multiprocessors", lambda: 4)
    config = FusedKVConfig(4, 64, 32, rope_style)
    assert mosaic_kernel.heads_per_program(config, total_ctx, n_layers, jnp.bfloat16) == heads
    kv, weight, eps, cos_sin, positions = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, seed=60 + heads)
    positions = np.where(np.arange(total_ctx) % 7 == 4, 64, positions).astype(positions.dtype)  # out of range
    given = {}
    if options in ("no K-norm", "all three"):
        weight = eps = None
    if options in ("v_multiplier", "all three"):
        given["v_multiplier"] = np.linspace(-1.5, 3.0, n_layers).astype(np.float32)
    if options in ("layer_rope_table", "all three"):
        cos_sin = np.stack([cos_sin, rope_cos_sin_cache(64, config.rotary_dim, base=500.0)])
        # A layer of table 1, and with three layers one whose table is out of range (its K all NaN).
        given["layer_rope_table"] = np.array([1, -1, 0][:n_layers], np.int32)
    host = (kv, weight, eps, cos_sin, positions)
    k, v = fused_kv_norm_rope(*host, **_static(config), **given, lowering="mosaic_gpu")
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config), **given)
    assert_close(k, k_expected)
    if "v_multiplier" in given:
        assert_close(v, v_expected)
    else:
        assert_bit_exact(v, v_expected)


def _runs_of_positions(total_ctx: int, max_position: int) -> np.ndarray:
    """Blocks of 64 positions: a run; a run but for one token; a run into the end of the
    table (its last tokens out of range); a run up to the end of the table; then runs
    again from 3 (a sequence's context counting up)."""
    blocks = [np.arange(64) + 7, np.arange(64) + 130, np.arange(64) + max_position - 40,
              np.arange(64) + max_position - 64]
    blocks[1][17] = 5
    positions = np.concatenate(blocks + [np.arange(total_ctx) + 3])[:total_ctx]
    return positions.astype(np.int32)


@pytest.mark.parametrize("options", ["plain", "layer_rope_table"])
@pytest.mark.parametrize("n_layers, total_ctx, heads", [(1, 256, 1), (1, 256, 2), (3, 320, 4)])
def test_mosaic_blocks_of_consecutive_positions_match_the_reference_as_other_blocks_do(
        options, n_layers, total_ctx, heads, monkeypatch):
    from fusedkv_jax import mosaic_kernel

    monkeypatch.setattr(devices, "multiprocessors", lambda: 4 if heads > 1 else 64)
    config = FusedKVConfig(4, 64, 32, "neox")
    assert mosaic_kernel.heads_per_program(config, total_ctx, n_layers, jnp.bfloat16) == heads
    max_position = 512
    kv, weight, eps, cos_sin, _ = _inputs(config, n_layers=n_layers, total_ctx=total_ctx,
                                          max_position=max_position, seed=80 + heads)
    positions = _runs_of_positions(total_ctx, max_position)
    given = {}
    if options == "layer_rope_table":
        cos_sin = np.stack([cos_sin, rope_cos_sin_cache(max_position, config.rotary_dim, base=500.0)])
        # With three layers, one whose table is out of range: its runs are no runs (K all NaN).
        given["layer_rope_table"] = np.array([1, 0, 2][:n_layers], np.int32)
    host = (kv, weight, eps, cos_sin, positions)
    k, v = fused_kv_norm_rope(*host, **_static(config), **given, lowering="mosaic_gpu")
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config), **given)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    rows_nan = np.isnan(np.asarray(k, np.float32)).all(axis=(2, 3))
    assert rows_nan[0].nonzero()[0].tolist() == list(range(128 + 40, 192))


@pytest.mark.parametrize("config, total_ctx, n_layers, dtype, heads", [
    (DRAFT, 4096, 5, jnp.bfloat16, 8),  # 320 (block, layer) programs for 132 multiprocessors
    (DRAFT, 256, 5, jnp.bfloat16, 1),  # 20 (block, layer): even 80 programs of 2 heads are too few
    (DRAFT, 4100, 5, jnp.bfloat16, 1),  # not a multiple of 8: untiled copies
    (FusedKVConfig(8, 128, 128, "neox"), 16896, 1, jnp.float16, 8),  # 264 programs: two a multiprocessor
    (FusedKVConfig(8, 128, 128, "neox"), 16832, 1, jnp.float16, 4),  # 263: programs of half the heads
    (FusedKVConfig(8, 64, 32, "neox"), 4096, 3, jnp.bfloat16, 4),
    (FusedKVConfig(8, 192, 192, "neox"), 4096, 1, jnp.bfloat16, 1),  # 256 programs of 2 heads: too few
    (FusedKVConfig(6, 64, 64, "neox"), 6400, 1, jnp.bfloat16, 2),  # 100 (block, layer): heads not a power of 2
    (FusedKVConfig(4, 192, 96, "neox"), 32768, 8, jnp.bfloat16, 4),
    (FusedKVConfig(2, 256, 256, "neox"), 32768, 5, jnp.bfloat16, 1),  # two K and two V tiles do not fit
], ids=lambda value: f"h{value.num_kv_heads}d{value.head_dim}r{value.rotary_dim}"
   if isinstance(value, FusedKVConfig) else str(value))
def test_mosaic_programs_take_the_most_heads_that_leave_each_multiprocessor_two_programs(
        config, total_ctx, n_layers, dtype, heads, monkeypatch):
    from fusedkv_jax import mosaic_kernel

    monkeypatch.setattr(devices, "multiprocessors", lambda: 132)  # an H200's
    assert mosaic_kernel.heads_per_program(config, total_ctx, n_layers, dtype) == heads


@pytest.mark.parametrize("head_dim, rotary_dim, dtype, taken", [
    (128, 128, jnp.bfloat16, True), (64, 32, jnp.float16, True), (192, 192, jnp.bfloat16, True),
    (96, 32, jnp.float16, True),  # 16 words rotated, 32 past them
    (96, 48, jnp.bfloat16, False),  # a token's cos/sin row of 192 bytes, not a multiple of 128
    (64, 16, jnp.bfloat16, False),  # a row of 64 bytes
    (96, 24, jnp.bfloat16, False),
    (80, 80, jnp.bfloat16, False),  # the weight's row of 320 bytes
    (128, 32, jnp.float32, False),  # fp32 kv stays on the Triton lowering
    (256, 256, jnp.float16, True),
])
def test_mosaic_takes_gptj_where_head_dim_and_rotary_dim_are_multiples_of_32(head_dim, rotary_dim, dtype, taken):
    from fusedkv_jax import mosaic_kernel

    assert mosaic_kernel.supports(FusedKVConfig(4, head_dim, rotary_dim, "gptj"), dtype) == taken


@pytest.mark.parametrize("table_dtype", ["bfloat16", "float16"])
def test_mosaic_reads_a_table_in_the_model_dtype_as_fp32(table_dtype):
    config = FusedKVConfig(1, 32, 32, "neox")
    host = _inputs(config, n_layers=1, total_ctx=64, seed=35, table_dtype=table_dtype)
    k, v = fused_kv_norm_rope(*host, **_static(config), lowering="mosaic_gpu")
    _assert_matches_reference(k, v, host, config)


def test_mosaic_out_of_range_positions_give_nan_rows_and_keep_v():
    config = FusedKVConfig(1, 32, 32, "neox")
    kv, weight, eps, cos_sin, _ = _inputs(config, n_layers=1, total_ctx=64, seed=31)
    positions = np.arange(64, dtype=np.int64)
    positions[[0, 5, 9, 63]] = [-1, 64, 2 ** 32 + 3, 2 ** 31 + 5]  # 2**32 + 3 wraps to 3 if narrowed carelessly
    k, v = fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **_static(config), lowering="mosaic_gpu")
    _assert_matches_reference(k, v, (kv, weight, eps, cos_sin, positions), config)
    rows_nan = np.isnan(np.asarray(k, np.float32)).all(axis=(0, 2, 3))
    assert rows_nan.nonzero()[0].tolist() == [0, 5, 9, 63]


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
@pytest.mark.parametrize("given", ["k_out", "v_out"])
def test_mosaic_with_one_output_given_writes_it_and_allocates_the_other(given, rope_style):
    config = FusedKVConfig(1, 64, 32, rope_style)
    host = _inputs(config, n_layers=3, total_ctx=64, seed=37)
    k, v = jax.jit(functools.partial(fused_kv_norm_rope, **_static(config), lowering="mosaic_gpu"))(
        *host, **{given: _poisoned(config.output_shape(3, 64), jnp.bfloat16)})
    _assert_matches_reference(k, v, host, config)


@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_mosaic_under_vmap_without_given_outputs_matches_each_call(rope_style):
    config = FusedKVConfig(1, 64, 32, rope_style)
    contexts = [_inputs(config, n_layers=2, total_ctx=64, seed=38 + i) for i in range(3)]
    kv = np.stack([host[0] for host in contexts])
    fixed, positions = contexts[0][1:4], contexts[0][4]
    k, v = jax.vmap(lambda x: fused_kv_norm_rope(x, *fixed, positions, **_static(config), lowering="mosaic_gpu"))(kv)
    for i, host in enumerate(contexts):
        _assert_matches_reference(k[i], v[i], (host[0], *fixed, positions), config)


def test_mosaic_given_outputs_without_donation_are_left_as_they_were():
    config = FusedKVConfig(1, 32, 32, "neox")
    host = _inputs(config, n_layers=1, total_ctx=64, seed=36)
    shape = config.output_shape(1, 64)
    k_out, v_out = _poisoned(shape, jnp.bfloat16), _poisoned(shape, jnp.bfloat16)
    k, v = fused_kv_norm_rope(*host, **_static(config), lowering="mosaic_gpu", k_out=k_out, v_out=v_out)
    _assert_matches_reference(k, v, host, config)
    assert np.isnan(np.asarray(k_out, np.float32)).all() and np.isnan(np.asarray(v_out, np.float32)).all()


@pytest.mark.parametrize("load, index", [
    (lambda src, idx, *, layout=None, optimized=True: None, ((),)),  # jax 0.10.2: the index required
    (lambda src, idx=None, *, layout=None, optimized=True: None, ()),  # optional, deprecated when given
    (lambda src, *, layout=None, optimized=True: None, ()),
], ids=["required", "optional", "gone"])
def test_mosaic_passes_plgpu_load_an_index_only_where_its_jax_requires_one(load, index, monkeypatch):
    from fusedkv_jax import mosaic_kernel

    monkeypatch.setattr(mosaic_kernel.plgpu, "load", load)
    assert mosaic_kernel._whole_ref_index() == index


def test_default_lowering_is_triton():
    assert default_lowering(FusedKVConfig(8, 128, 128, "neox"), jnp.bfloat16) == "triton"


BAD_LOWERINGS = [
    (dict(lowering="mosaic"),
     "Invalid lowering for fused KV materialization: got 'mosaic', expected one of "
     "('triton', 'mosaic_gpu') or None."),
    (dict(lowering="mosaic_gpu", rope_style="gptj", rotary_dim=8),
     "Invalid lowering for fused KV materialization: got 'mosaic_gpu' for rope_style='gptj', "
     "head_dim=32, rotary_dim=8, dtype=bfloat16, expected 'triton' (Mosaic GPU takes bf16/fp16 with "
     "head_dim <= 256, and head_dim and rotary_dim multiples of 32)."),
    (dict(lowering="mosaic_gpu", rotary_dim=16),
     "Invalid lowering for fused KV materialization: got 'mosaic_gpu' for rope_style='neox', "
     "head_dim=32, rotary_dim=16, dtype=bfloat16, expected 'triton' (Mosaic GPU takes bf16/fp16 with "
     "head_dim <= 256, and head_dim and rotary_dim multiples of 32)."),
    (dict(lowering="mosaic_gpu", dtype="float32"),
     "Invalid lowering for fused KV materialization: got 'mosaic_gpu' for rope_style='neox', "
     "head_dim=32, rotary_dim=32, dtype=float32, expected 'triton' (Mosaic GPU takes bf16/fp16 with "
     "head_dim <= 256, and head_dim and rotary_dim multiples of 32)."),
    (dict(lowering="mosaic_gpu", block_tokens=4),
     "Invalid tile override for fused KV materialization: got block_tokens/block_heads/num_warps "
     "with lowering='mosaic_gpu', expected them only with the Triton lowering."),
]


@pytest.mark.parametrize("overrides, message", BAD_LOWERINGS, ids=lambda v: v[:60] if isinstance(v, str) else "")
def test_bad_lowering_raises_its_message(overrides, message):
    overrides = dict(overrides)
    config = FusedKVConfig(2, 32, overrides.pop("rotary_dim", 32), overrides.pop("rope_style", "neox"))
    host = _inputs(config, n_layers=2, total_ctx=64, seed=33, dtype=overrides.pop("dtype", "bfloat16"))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(*host, **_static(config), **overrides)


@pytest.mark.skipif(ON_GPU, reason="interpret mode only")
def test_mosaic_interpret_mode_refuses_a_partial_block():
    config = FusedKVConfig(2, 32, 32, "neox")
    host = _inputs(config, n_layers=1, total_ctx=65, seed=34)
    message = ("Invalid total_ctx for fused KV materialization with lowering='mosaic_gpu': "
               "got 65, expected a multiple of 64 in interpret mode.")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(*host, **_static(config), lowering="mosaic_gpu")


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile the kernel for real")
@pytest.mark.parametrize("options", ["plain", "every option"])
@pytest.mark.parametrize("config, total_ctx", [(FusedKVConfig(8, 128, 64, "neox"), 104),
                                               (FusedKVConfig(2, 256, 256, "neox"), 4096),
                                               (FusedKVConfig(1, 96, 96, "neox"), 7),
                                               (FusedKVConfig(8, 128, 64, "gptj"), 104),
                                               (FusedKVConfig(1, 96, 32, "gptj"), 7)])
def test_mosaic_lowers_for_a_gpu(config, total_ctx, options):
    # Mosaic GPU builds its IR in Python: layouts, slices and copies are checked without a
    # GPU (by jax 0.10.2 here; 0.11.2 differs, see fusedkv_jax.mosaic_kernel). The three
    # contexts take programs of every head, of one (tiled) and of one (untiled, V in halves).
    n_layers = 5
    kv = jax.ShapeDtypeStruct((total_ctx, n_layers, 2 * config.kv_size), jnp.bfloat16)
    positions = jax.ShapeDtypeStruct((total_ctx,), jnp.int32)
    if options == "plain":
        args = (kv, jax.ShapeDtypeStruct((n_layers, config.head_dim), jnp.float32),
                jax.ShapeDtypeStruct((n_layers,), jnp.float32),
                jax.ShapeDtypeStruct((100, config.rotary_dim), jnp.float32), positions)
        call = functools.partial(fused_kv_norm_rope, **_static(config), interpret=False, lowering="mosaic_gpu")
    else:
        args = (kv, jax.ShapeDtypeStruct((2, 100, config.rotary_dim), jnp.float32), positions,
                jax.ShapeDtypeStruct((n_layers,), jnp.float32), jax.ShapeDtypeStruct((n_layers,), jnp.int32))

        def call(kv, tables, positions, multiplier, table_of_layer):
            return fused_kv_norm_rope(kv, None, None, tables, positions, **_static(config), v_multiplier=multiplier,
                                      layer_rope_table=table_of_layer, interpret=False, lowering="mosaic_gpu")
    assert "mosaic_gpu" in jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile the kernel for real")
def test_mosaic_cache_lowers_for_a_gpu_with_its_caches_aliased_to_its_results():
    config = FusedKVConfig(8, 128, 64, "neox")
    cache = jax.ShapeDtypeStruct((5, 500, 8, 128), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((104, 5, 2 * config.kv_size), jnp.bfloat16),
            jax.ShapeDtypeStruct((5, config.head_dim), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32),
            jax.ShapeDtypeStruct((100, config.rotary_dim), jnp.float32), jax.ShapeDtypeStruct((104,), jnp.int32),
            jax.ShapeDtypeStruct((104,), jnp.int32), cache, cache)
    call = functools.partial(fused_kv_norm_rope_into_cache, **_static(config), interpret=False, lowering="mosaic_gpu")
    text = jax.jit(call, donate_argnums=(6, 7)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "scatter" in text and "tf.aliasing_output" in text


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below compile the kernel for real")
@pytest.mark.parametrize("rope_style", ["neox", "gptj"])
def test_mosaic_lowers_for_a_gpu_with_given_outputs_aliased_to_its_results(rope_style):
    config = FusedKVConfig(8, 128, 64, rope_style)
    output = jax.ShapeDtypeStruct(config.output_shape(5, 104), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((104, 5, 2 * config.kv_size), jnp.bfloat16),
            jax.ShapeDtypeStruct((5, config.head_dim), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32),
            jax.ShapeDtypeStruct((100, config.rotary_dim), jnp.float32), jax.ShapeDtypeStruct((104,), jnp.int32),
            output, output)
    call = functools.partial(fused_kv_norm_rope, **_static(config), interpret=False, lowering="mosaic_gpu")
    step = jax.jit(lambda *a: call(*a[:5], k_out=a[5], v_out=a[6]), donate_argnums=(5, 6))
    text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config, n_layers, total_ctx, dtype", [
    (DRAFT, 5, 1, "bfloat16"), (DRAFT, 5, 4096, "bfloat16"), (FusedKVConfig(8, 128, 64, "neox"), 8, 72, "bfloat16"),
    (FusedKVConfig(1, 96, 96, "neox"), 1, 7, "bfloat16"), (FusedKVConfig(3, 128, 96, "neox"), 2, 200, "float16"),
    (FusedKVConfig(2, 256, 256, "neox"), 5, 136, "bfloat16"),
    (FusedKVConfig(4, 128, 64, "neox"), 8, 2104, "float16"),  # heads looped over, a partial last block
    (FusedKVConfig(8, 64, 32, "neox"), 3, 4096, "bfloat16"),  # programs of 4 of the 8 heads on 132 multiprocessors
    (FusedKVConfig(8, 192, 192, "neox"), 1, 4096, "bfloat16"),  # of one head, tiled
    (FusedKVConfig(1, 96, 96, "neox"), 2, 8, "bfloat16"),  # untiled, one block shorter than 64 tokens
    # gptj, as words of pairs: heads looped over, a tail of pairs, fp16; of one head, untiled.
    (FusedKVConfig(8, 128, 128, "gptj"), 5, 4096, "bfloat16"), (FusedKVConfig(4, 128, 32, "gptj"), 3, 2104, "float16"),
    (FusedKVConfig(16, 192, 192, "gptj"), 5, 136, "bfloat16"), (FusedKVConfig(1, 64, 32, "gptj"), 2, 7, "bfloat16"),
])
@pytest.mark.parametrize("positions", ["uniform, every 7th padding", "runs"])
def test_gpu_mosaic_matches_reference(config, n_layers, total_ctx, dtype, positions):
    max_position = 32768
    host = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=max_position, dtype=dtype,
                   seed=total_ctx)
    if positions == "runs":
        drawn = _runs_of_positions(total_ctx, max_position)
    else:
        drawn = np.where(np.arange(total_ctx) % 7 == 3, -1, host[4]).astype(host[4].dtype)
    host = host[:4] + (drawn,)
    k, v = fused_kv_norm_rope(*(jax.device_put(a) for a in host), **_static(config), lowering="mosaic_gpu")
    _assert_matches_reference(k, v, host, config)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config, n_layers, total_ctx", [
    (DRAFT, 5, 4096),  # programs of every head
    (FusedKVConfig(8, 128, 64, "neox"), 8, 72),  # of one head, tiled
    (FusedKVConfig(1, 96, 96, "neox"), 3, 7),  # of one head, untiled: V scaled in two halves
    (FusedKVConfig(8, 128, 64, "gptj"), 8, 72),  # words of pairs, V scaled as words
    (FusedKVConfig(1, 64, 32, "gptj"), 3, 7),
])
def test_gpu_mosaic_with_every_option_matches_reference(config, n_layers, total_ctx):
    kv, _, _, cos_sin, positions = _inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=32768,
                                           seed=70 + total_ctx)
    positions = np.where(np.arange(total_ctx) % 7 == 3, -1, positions).astype(positions.dtype)
    options = dict(v_multiplier=np.linspace(-2.0, 2.0, n_layers).astype(np.float32),
                   layer_rope_table=(np.arange(n_layers) % 3 - (np.arange(n_layers) == 1)).astype(np.int32))
    cos_sin = np.stack([cos_sin, rope_cos_sin_cache(32768, config.rotary_dim, base=1e6)])
    host = (kv, None, None, cos_sin, positions)
    k, v = fused_kv_norm_rope(*(None if a is None else jax.device_put(a) for a in host), **_static(config),
                              **options, lowering="mosaic_gpu")
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config), **options)
    assert_close(k, k_expected)
    assert_close(v, v_expected)


@pytest.mark.gpu
@gpu
def test_gpu_mosaic_cache_into_donated_paged_cache():
    total_ctx, num_slots = 4096, 6000
    slots = np.random.default_rng(6).permutation(num_slots)[:total_ctx].astype(np.int32)
    slots[::7] = -1
    host, slots, k_cache, v_cache, _ = _cache_case(
        DRAFT, n_layers=5, total_ctx=total_ctx, num_slots=num_slots, slots=slots, k_dtype=numpy_dtype("bfloat16"),
        v_dtype=numpy_dtype("bfloat16"), seed=44)
    k_device, v_device = jax.device_put(k_cache), jax.device_put(v_cache)
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **_static(DRAFT), lowering="mosaic_gpu"),
                   donate_argnums=(6, 7))
    k, v = step(*(jax.device_put(a) for a in host), jax.device_put(slots), k_device, v_device)
    assert k_device.is_deleted()
    _assert_cache_matches_reference(k, v, host, slots, k_cache, v_cache, {}, DRAFT)
