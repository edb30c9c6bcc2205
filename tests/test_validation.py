"""Every validation message of CONTRACT.md (Validation), word for word, in its order."""

import re

import numpy as np
import pytest

from interop.core.reference import fused_kv_norm_rope_reference
from interop.core.arrays import numpy_dtype
from interop.core import spec
from interop.core.spec import FusedKVConfig, check_arrays, validate_cache_call, validate_call
from interop.testing import random_inputs

CONFIG = FusedKVConfig(num_kv_heads=2, head_dim=8, rotary_dim=8)
STATIC = dict(num_kv_heads=2, head_dim=8, rotary_dim=8)


def _args(total_ctx=3, n_layers=2, **overrides):
    inputs = random_inputs(CONFIG, n_layers=n_layers, total_ctx=total_ctx, max_position=64, seed=1)
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), inputs.arrays()))
    args.update(overrides)
    return args


def _expect(message, **kwargs):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_call(**kwargs)


def test_kv_must_be_3d():
    _expect("Invalid stacked fused KV projection shape: got (3, 64), expected 3D "
            "[total_ctx, n_layers, kv_size*2].",
            **_args(kv=np.zeros((3, 64), np.float32)), **STATIC)


def test_kv_trailing_dim_must_be_twice_kv_size():
    _expect("Invalid fused KV projection shape: got (3, 2, 30), expected trailing dim 32.",
            **_args(kv=np.zeros((3, 2, 30), np.float32)), **STATIC)


@pytest.mark.parametrize("rotary_dim", [0, -2, 7, 10])
def test_rotary_dim_must_be_positive_even_and_at_most_head_dim(rotary_dim):
    _expect(f"Invalid fused KV rotary/head dim pair: rotary_dim={rotary_dim}, head_dim=8.",
            **_args(), num_kv_heads=2, head_dim=8, rotary_dim=rotary_dim)


def test_k_norm_weight_must_be_layers_by_head_dim():
    _expect("Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 4), "
            "expected (2, 8).", **_args(k_norm_weight=np.ones((2, 4), np.float32)), **STATIC)


def test_eps_must_have_one_value_per_layer():
    _expect("Invalid stacked eps shape for fused KV materialization: got (3,), expected (2,).",
            **_args(eps=np.ones(3, np.float32)), **STATIC)


def test_k_out_shape_is_checked():
    _expect("Invalid k_out shape for fused KV materialization: got (2, 3, 2, 4), "
            "expected (2, 3, 2, 8).",
            **_args(), **STATIC, k_out=np.zeros((2, 3, 2, 4), np.float32))


def test_v_out_shape_is_checked():
    good = np.zeros((2, 3, 2, 8), np.float32)
    _expect("Invalid v_out shape for fused KV materialization: got (3, 2, 2, 8), "
            "expected (2, 3, 2, 8).",
            **_args(kv=np.zeros((3, 2, 32), np.float32)), **STATIC,
            k_out=good, v_out=np.zeros((3, 2, 2, 8), np.float32))


def test_out_dtype_must_match_kv():
    _expect("Invalid k_out device/dtype for fused KV materialization: got device=cpu, "
            "dtype=float16, expected device=cpu, dtype=bfloat16.",
            **_args(), **STATIC, k_out=np.zeros((2, 3, 2, 8), np.float16))


def test_checks_run_in_documented_order():
    # Both the rotary pair and k_norm_weight are wrong: the rotary check comes first.
    _expect("Invalid fused KV rotary/head dim pair: rotary_dim=9, head_dim=8.",
            **_args(k_norm_weight=np.ones((1, 1), np.float32)),
            num_kv_heads=2, head_dim=8, rotary_dim=9)


def test_empty_context_is_still_validated():
    _expect("Invalid stacked eps shape for fused KV materialization: got (5,), expected (2,).",
            **_args(total_ctx=0, eps=np.ones(5, np.float32)), **STATIC)


@pytest.mark.parametrize("field, bad, message", [
    ("kv", np.zeros((3, 2, 32), np.float64),
     "Invalid kv dtype for fused KV materialization: got float64, expected one of "
     "('bfloat16', 'float16', 'float32')."),
    ("eps", np.ones(2, np.float64),
     "Invalid eps dtype for fused KV materialization: got float64, expected one of ('float32',)."),
    ("cos_sin_cache", np.zeros((64, 8), np.float64),
     "Invalid cos_sin_cache dtype for fused KV materialization: got float64, expected one of "
     "('float32', 'bfloat16', 'float16')."),
    ("cos_sin_cache", np.zeros((2, 64, 6), np.float32),
     "Invalid cos_sin_cache shape for fused KV materialization: got (2, 64, 6), expected "
     "(n_tables, max_pos, 8) with n_tables > 0 and max_pos > 0."),
    ("cos_sin_cache", np.zeros((0, 64, 8), np.float32),
     "Invalid cos_sin_cache shape for fused KV materialization: got (0, 64, 8), expected "
     "(n_tables, max_pos, 8) with n_tables > 0 and max_pos > 0."),
    ("cos_sin_cache", np.zeros((2, 2, 64, 8), np.float32),
     "Invalid cos_sin_cache shape for fused KV materialization: got (2, 2, 64, 8), expected "
     "(max_pos, 8) with max_pos > 0."),
    ("cos_sin_cache", np.zeros((64, 6), np.float32),
     "Invalid cos_sin_cache shape for fused KV materialization: got (64, 6), expected "
     "(max_pos, 8) with max_pos > 0."),
    ("positions", np.zeros(3, np.float32),
     "Invalid positions dtype for fused KV materialization: got float32, expected one of "
     "('int32', 'int64')."),
    ("positions", np.zeros(4, np.int32),
     "Invalid positions shape for fused KV materialization: got (4,), expected (3,)."),
])
def test_inputs_beyond_the_seeds_get_what_was_got_and_expected(field, bad, message):
    _expect(message, **_args(**{field: bad}), **STATIC)


TABLES = np.zeros((3, 64, 8), np.float32)


@pytest.mark.parametrize("tables, layer_rope_table, message", [
    (None, np.zeros(2, np.int32),
     "Invalid layer_rope_table for fused KV materialization: got an array with a 2-D cos_sin_cache, expected "
     "None (one table serves every layer; a 3-D cos_sin_cache [n_tables, max_pos, rotary_dim] takes a table "
     "index per layer)."),
    (TABLES, None,
     "Invalid layer_rope_table for fused KV materialization: got None with a 3-D cos_sin_cache of 3 tables, "
     "expected int32(2,) naming each layer's table."),
    (TABLES, np.zeros(2, np.int64),
     "Invalid layer_rope_table for fused KV materialization: got int64(2,), expected int32(2,) (each layer's "
     "table in cos_sin_cache)."),
    (TABLES, np.zeros(3, np.int32),
     "Invalid layer_rope_table for fused KV materialization: got int32(3,), expected int32(2,) (each layer's "
     "table in cos_sin_cache)."),
])
def test_layer_rope_table_is_given_exactly_with_a_3d_table(tables, layer_rope_table, message):
    overrides = {} if tables is None else dict(cos_sin_cache=tables)
    _expect(message, **_args(**overrides), **STATIC, layer_rope_table=layer_rope_table)


def test_a_3d_table_gives_the_rows_of_one_table_as_max_position():
    call = validate_call(**_args(cos_sin_cache=np.zeros((3, 40, 8), np.float16)), **STATIC,
                         layer_rope_table=np.array([2, 0], np.int32))
    assert call.max_position == 40


def test_rope_style_must_be_known():
    _expect("Invalid rope_style for fused KV materialization: got 'llama', expected one of "
            "('neox', 'gptj').", **_args(), **STATIC, rope_style="llama")


def test_reference_validates_too():
    with pytest.raises(ValueError, match="^Invalid fused KV projection shape"):
        fused_kv_norm_rope_reference(**_args(kv=np.zeros((3, 2, 30), np.float32)), **STATIC)


def test_validation_reports_the_sizes_launchers_need():
    call = validate_call(**_args(total_ctx=5, n_layers=3), **STATIC)
    assert (call.total_ctx, call.n_layers, call.max_position) == (5, 3, 64)
    assert call.output_shape == (3, 5, 2, 8)


def _cache_args(num_slots=10, cache_dtype=None, **overrides):
    args = _args()
    dtype = cache_dtype or args["kv"].dtype
    args.update(cache_loc=np.array([4, -1, 9], np.int64),
                k_cache=np.zeros((2, num_slots, 2, 8), dtype),
                v_cache=np.zeros((2, num_slots, 2, 8), dtype))
    args.update(overrides)
    return args


def _expect_cache(message, **kwargs):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_cache_call(**kwargs)


def test_cache_shape_names_the_expected_layout():
    _expect_cache("Invalid k_cache shape for fused KV materialization: got (2, 10, 8), expected "
                  "(n_layers, num_slots, num_kv_heads, head_dim) = (2, num_slots, 2, 8).",
                  **_cache_args(k_cache=np.zeros((2, 10, 8))), **STATIC)


def test_v_cache_must_match_k_cache():
    _expect_cache("Invalid v_cache shape for fused KV materialization: got (2, 11, 2, 8), "
                  "expected the shape of k_cache (2, 10, 2, 8).",
                  **_cache_args(v_cache=np.zeros((2, 11, 2, 8), numpy_dtype("bfloat16"))), **STATIC)


def test_cache_loc_must_have_one_slot_per_token():
    _expect_cache("Invalid cache_loc shape for fused KV materialization: got (2,), expected (3,).",
                  **_cache_args(cache_loc=np.zeros(2, np.int32)), **STATIC)


def test_cache_dtype_is_kv_dtype_or_fp8():
    _expect_cache("Invalid k_cache device/dtype for fused KV materialization: got device=cpu, "
                  "dtype=float32, expected device=cpu, dtype one of ('bfloat16', 'float8_e4m3fn').",
                  **_cache_args(cache_dtype=np.float32), **STATIC)


def test_fp8_cache_needs_per_layer_fp32_scales():
    _expect_cache("Invalid k_scale for fused KV materialization: got None, expected "
                  "float32(2,) for a float8_e4m3fn cache.",
                  **_cache_args(cache_dtype=numpy_dtype("float8_e4m3fn")), **STATIC)
    _expect_cache("Invalid v_scale for fused KV materialization: got float32(3,), expected "
                  "float32(2,) for a float8_e4m3fn cache.",
                  **_cache_args(cache_dtype=numpy_dtype("float8_e4m3fn")), **STATIC,
                  k_scale=np.ones(2, np.float32), v_scale=np.ones(3, np.float32))


def test_scales_are_refused_for_a_cache_that_is_not_fp8():
    _expect_cache("Invalid k_scale for fused KV materialization: got a scale, expected None for "
                  "a cache that is not float8_e4m3fn.",
                  **_cache_args(), **STATIC, k_scale=np.ones(2, np.float32))


def test_importing_interop_imports_neither_torch_nor_jax():
    import subprocess
    import sys

    probe = ("import sys, interop, interop.command.cli, interop.dispatch, interop.core.materializer; "
             "print(sorted(m for m in ('torch', 'jax', 'triton') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


# Sizes: positive ints, refused (never truncated) otherwise, before anything else is checked.

NOT_INTS = [(True, "True (bool)"), (2.0, "2.0 (float)"), (2.5, "2.5 (float)"), ("2", "'2' (str)"),
            (None, "None (NoneType)"), (np.float64(8.0), "np.float64(8.0) (numpy.float64)")]


@pytest.mark.parametrize("bad, shown", NOT_INTS, ids=[shown for _, shown in NOT_INTS])
@pytest.mark.parametrize("name, expected", [("num_kv_heads", "a positive int"), ("head_dim", "a positive int"),
                                            ("rotary_dim", "an even int in [2, 8]")])
def test_a_size_that_is_not_an_int_is_a_type_error_naming_it(name, expected, bad, shown):
    message = f"Invalid {name} for fused KV materialization: got {shown}, expected {expected}."
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        validate_call(**_args(), **{**STATIC, name: bad})


@pytest.mark.parametrize("name", ["num_kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -2])
def test_a_size_below_one_is_a_value_error_naming_it(name, bad):
    _expect(f"Invalid {name} for fused KV materialization: got {bad}, expected a positive int.",
            **_args(), **{**STATIC, name: bad})


def test_sizes_are_checked_before_the_arrays():
    with pytest.raises(TypeError, match=r"^Invalid head_dim for fused KV materialization: got 8\.0"):
        validate_call(**_args(kv=np.zeros((3, 64), np.float32)), num_kv_heads=2, head_dim=8.0, rotary_dim=8)


def test_numpy_integer_sizes_are_taken_as_ints():
    call = validate_call(**_args(), num_kv_heads=np.int64(2), head_dim=np.int32(8), rotary_dim=np.int16(8))
    assert call.config == CONFIG
    assert all(type(size) is int for size in (call.config.num_kv_heads, call.config.head_dim,
                                              call.config.rotary_dim))


# Arguments: arrays of the entry point's framework.

def test_a_list_is_not_an_array():
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid kv for fused KV materialization: got list, expected an array with __dlpack__ "
            "(NumPy, torch, jax, CuPy).") + "$"):
        check_arrays([("kv", [[[1.0]]])], "any")


@pytest.mark.parametrize("accepted, expected", [
    ("torch", "a torch.Tensor (fusedkv_torch takes torch tensors; interop.fused_kv_norm_rope takes "
              "arrays of any framework)"),
    ("jax", "a jax or NumPy array (fusedkv_jax takes jax and NumPy arrays; interop.fused_kv_norm_rope "
            "takes arrays of any framework)"),
])
def test_a_backend_points_other_arrays_to_interop(accepted, expected):
    arrays = {"torch": np.zeros(3, np.int32), "jax": [0, 1, 2]}
    got = {"torch": "numpy.ndarray", "jax": "list"}
    with pytest.raises(TypeError, match="^" + re.escape(
            f"Invalid positions for fused KV materialization: got {got[accepted]}, expected {expected}.") + "$"):
        check_arrays([("kv", None), ("positions", arrays[accepted])], accepted)


def test_a_negative_stride_names_the_fix():
    kv = _args()["kv"][::-1]
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid kv for fused KV materialization: got strides (-128, 64, 2) with a negative stride, "
            "expected non-negative strides (pass np.ascontiguousarray(kv)).") + "$"):
        check_arrays([("kv", kv)], "any")


@pytest.mark.parametrize("accepted", ["any", "jax"])
@pytest.mark.parametrize("name, dtype", [("eps", ">f4"), ("positions", ">i8")])
def test_a_big_endian_array_is_refused_naming_the_fix(accepted, name, dtype):
    array = np.zeros(3, np.dtype(dtype))
    with pytest.raises(ValueError, match="^" + re.escape(
            f"Invalid {name} for fused KV materialization: got a big-endian array (dtype {dtype}), expected "
            f"native byte order (pass {name}.astype({name}.dtype.newbyteorder('='))).") + "$"):
        check_arrays([("kv", None), (name, array)], accepted)


# Outputs: writable, no zero strides, sharing memory neither with each other nor with kv.

def _out(fill=7.0):
    return np.full((2, 3, 2, 8), fill, np.float32).astype(numpy_dtype("bfloat16"))


def _expect_buffers(message, **outputs):
    args = _args()
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_call(**args, **STATIC, **outputs)


def test_one_array_as_both_outputs_is_refused():
    out = _out()
    _expect_buffers("Invalid v_out for fused KV materialization: got a buffer overlapping k_out, expected "
                    "outputs that overlap neither each other nor kv.", k_out=out, v_out=out)


def test_outputs_that_share_some_memory_are_refused():
    pool = np.concatenate([_out().reshape(-1), _out().reshape(-1)])
    k_out, v_out = pool[:96].reshape(2, 3, 2, 8), pool[95:191].reshape(2, 3, 2, 8)  # one element shared
    _expect_buffers("Invalid v_out for fused KV materialization: got a buffer overlapping k_out, expected "
                    "outputs that overlap neither each other nor kv.", k_out=k_out, v_out=v_out)


def test_an_output_over_kv_is_refused():
    args = _args()
    k_out = args["kv"].reshape(-1)[96:].reshape(2, 3, 2, 8)
    with pytest.raises(ValueError, match="^" + re.escape(
            "Invalid k_out for fused KV materialization: got a buffer overlapping kv, expected outputs "
            "that overlap neither each other nor kv.") + "$"):
        validate_call(**args, **STATIC, k_out=k_out)


def test_a_zero_stride_output_is_refused():
    expanded = np.lib.stride_tricks.as_strided(_out(), strides=(0, 32, 16, 2), writeable=True)
    _expect_buffers("Invalid k_out for fused KV materialization: got strides (0, 32, 16, 2) with a zero "
                    "stride, expected no zero strides.", k_out=expanded)


def test_a_read_only_output_is_refused():
    read_only = _out()
    read_only.flags.writeable = False
    _expect_buffers("Invalid v_out for fused KV materialization: got a read-only array, expected a "
                    "writable one (pass a copy: np.array(v_out)).", k_out=_out(), v_out=read_only)


def test_k_and_v_side_by_side_in_one_pool_share_no_element_and_pass():
    pool = np.stack([_out(1.0), _out(2.0)], axis=1)  # [n_layers, 2, total_ctx, heads, head_dim]
    validate_call(**_args(), **STATIC, k_out=pool[:, 0], v_out=pool[:, 1])
    _expect_buffers("Invalid v_out for fused KV materialization: got a buffer overlapping k_out, expected "
                    "outputs that overlap neither each other nor kv.", k_out=pool[:, 0], v_out=pool[:, 0][:])


def test_an_overlap_too_costly_to_decide_is_refused(monkeypatch):
    monkeypatch.setattr(spec, "_OVERLAP_WORK_LIMIT", 0)
    monkeypatch.setattr(spec, "_SHARED_BY_RELATIVE_LAYOUT", {})
    pool = np.stack([_out(1.0), _out(2.0)], axis=1)
    _expect_buffers("Invalid v_out for fused KV materialization: got a buffer whose overlap with k_out "
                    "could not be ruled out, expected outputs that overlap neither each other nor kv.",
                    k_out=pool[:, 0], v_out=pool[:, 1])


def test_buffers_are_checked_after_shapes_and_dtypes_and_only_when_asked():
    out = _out()
    _expect_buffers("Invalid v_out device/dtype for fused KV materialization: got device=cpu, "
                    "dtype=float32, expected device=cpu, dtype=bfloat16.",
                    k_out=out, v_out=np.zeros((2, 3, 2, 8), np.float32))
    validate_call(**_args(), **STATIC, k_out=out, v_out=out, check_buffers=False)


def test_one_array_as_both_caches_is_refused():
    args = _cache_args()
    _expect_cache("Invalid v_cache for fused KV materialization: got a buffer overlapping k_cache, "
                  "expected outputs that overlap neither each other nor kv.",
                  **{**args, "v_cache": args["k_cache"]}, **STATIC)
