"""The Triton kernel against interop's NumPy reference (interpret mode on CPU, real on GPU).

K is compared under interop's tolerance table, V bit for bit. Every rejected call must
raise validation's own message and leave the caller's buffers as they were.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from interop.arrays import as_numpy, numpy_dtype
from interop.exchange import to_torch
from interop.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop import spec as spec_module
from interop.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, assert_fp8_close, compare, random_inputs
from fusedkv_torch import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_torch import kernel as kernel_module
from fusedkv_torch.kernel import launch
from fusedkv_torch.launcher import expected_attributes, specialization_key

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DEVICE_NAME = "cuda:0" if ON_GPU else "cpu"  # as validation messages name it
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

CASES = [
    # (heads, head_dim, rotary_dim, style)
    (2, 128, 128, "neox"),
    (2, 128, 128, "gptj"),
    (2, 128, 64, "neox"),
    (2, 128, 64, "gptj"),
    (1, 192, 64, "neox"),
    (1, 192, 192, "gptj"),
    (3, 96, 96, "neox"),
    (3, 96, 32, "gptj"),
    (2, 64, 64, "neox"),
]


def static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim, rope_style=config.rope_style)


def on_device(inputs, device=DEVICE):
    return [to_torch(array).to(device) for array in inputs.arrays()]


def poisoned(shape, dtype, device=DEVICE):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_matches_reference(inputs, config, k, v):
    expected_k, expected_v = fused_kv_norm_rope_reference(*inputs.arrays(), **static(config))
    assert_close(k, expected_k)
    assert_bit_exact(v, expected_v)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("heads, head_dim, rotary_dim, style", CASES)
def test_matches_reference_for_every_dtype_style_and_head_shape(dtype, heads, head_dim, rotary_dim, style):
    config = FusedKVConfig(heads, head_dim, rotary_dim, style)
    inputs = random_inputs(config, n_layers=2, total_ctx=3, dtype=dtype, max_position=64, seed=heads)
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert k.shape == v.shape == (2, 3, heads, head_dim)
    assert k.dtype == v.dtype == getattr(torch, dtype)
    assert_matches_reference(inputs, config, k, v)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_one_token_of_one_layer(style):
    config = FusedKVConfig(1, 64, 64, style)
    inputs = random_inputs(config, n_layers=1, total_ctx=1, max_position=8, seed=1)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(*on_device(inputs), **static(config)))


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("block_tokens, block_heads", [(8, 2), (4, 4), (16, 1)])
def test_token_tiles_and_head_groups_cover_a_ragged_context(style, block_tokens, block_heads):
    config = FusedKVConfig(4, 96, 64, style)
    inputs = random_inputs(config, n_layers=2, total_ctx=19, max_position=64, seed=2)
    kv, *rest = on_device(inputs)
    k, v = poisoned((2, 19, 4, 96), kv.dtype), poisoned((2, 19, 4, 96), kv.dtype)
    launch(kv, *rest, k, v, config=config, block_tokens=block_tokens,
           block_heads=block_heads, num_warps=2)
    assert_matches_reference(inputs, config, k, v)


@pytest.mark.parametrize("total_ctx, tile", [(127, (2, 1)), (130, (2, 4)), (257, (8, 4))])
def test_decode_and_mid_size_contexts_on_their_default_tiles(total_ctx, tile):
    # Below 128 tokens two-token one-head tiles; from 256 to 384 four-token tiles of every
    # head (4 heads: 2 rows of tokens each); between and beyond, one-token rows of every head.
    # The GPU's tiles, launched by name: interpreted, a call's default is a few large tiles.
    config = FusedKVConfig(4, 64, 64, "gptj")
    block_tokens, block_heads, num_warps = kernel_module.default_tile(total_ctx, 4, 64)
    assert (block_tokens, block_heads) == tile
    inputs = random_inputs(config, n_layers=2, total_ctx=total_ctx, max_position=512, seed=4)
    kv, *rest = on_device(inputs)
    k, v = poisoned((2, total_ctx, 4, 64), kv.dtype), poisoned((2, total_ctx, 4, 64), kv.dtype)
    launch(kv, *rest, k, v, config=config, block_tokens=block_tokens,
           block_heads=block_heads, num_warps=num_warps)
    assert_matches_reference(inputs, config, k, v)


def test_long_ragged_context_of_one_head_takes_multi_token_tiles():
    config = FusedKVConfig(1, 64, 32, "neox")
    inputs = random_inputs(config, n_layers=1, total_ctx=2085, max_position=4096, seed=3)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(*on_device(inputs), **static(config)))


@pytest.mark.parametrize("heads, block_heads", [(3, 2), (6, 3)])
def test_block_heads_must_be_a_power_of_two_dividing_the_heads(heads, block_heads):
    config = FusedKVConfig(heads, 64, 64)
    inputs = random_inputs(config, n_layers=1, total_ctx=2, max_position=8)
    kv, *rest = on_device(inputs)
    k = poisoned((1, 2, heads, 64), kv.dtype)
    with pytest.raises(ValueError, match=re.escape(
            f"Invalid block_heads for fused KV materialization: got {block_heads}, "
            f"expected a power of two that divides {heads}.")):
        launch(kv, *rest, k, k, config=config, block_heads=block_heads)
    assert torch.isnan(k).all()


def _tritons_binder():
    """Triton's own argument binder for the kernel, as ``kernel[grid]`` uses it on an H100-class GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = kernel_module._fused_kv_norm_rope_kernel
    if not isinstance(kernel, JITFunction):  # the interpreter's wrapper keeps the jit arguments
        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))


def test_direct_launch_key_splits_calls_wherever_triton_specializes_them():
    # DirectLauncher reuses a compiled kernel for every call of the same key, so two calls
    # Triton would compile differently must never share a key; and the attributes it checks
    # on a new key must be the binder's.
    binder = _tritons_binder()
    rng = np.random.default_rng(0)
    buffer = torch.zeros(4096, dtype=torch.bfloat16)
    values = [0, 1, 2, 8, 15, 16, 17, 32, 48, 1024, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32]
    _, constexprs, _, _ = kernel_module._plan(REAL, 64, 5, True, True, True, None, None, None, False)
    specializations = {}
    for _ in range(400):
        tensors = [None if rng.random() < 0.2 else buffer[int(rng.integers(0, 24)):] for _ in range(10)]
        plain_ints = [int(v) for v in rng.integers(1, 2**31, 3)]
        ints = [values[i] for i in rng.integers(0, len(values), 20)]
        addresses = [None if tensor is None else tensor.data_ptr() for tensor in tensors]
        _, specialization, _ = binder(*tensors, *plain_ints, *ints, *constexprs, num_warps=4)
        runtime = tuple(specialization[:33])
        key = specialization_key(addresses, ints)
        assert specializations.setdefault(key, runtime) == runtime
        assert [attribute for _, attribute in runtime] == expected_attributes(addresses, plain_ints, ints)
    assert len(specializations) > 100


def test_registered_ops_write_their_mutated_arguments():
    config = FusedKVConfig(2, 96, 64, "gptj")
    inputs = random_inputs(config, n_layers=2, total_ctx=3, max_position=64, seed=13)
    kv, *rest = on_device(inputs)
    k_out, v_out = poisoned((2, 3, 2, 96), kv.dtype), poisoned((2, 3, 2, 96), kv.dtype)
    assert torch.ops.fusedkv.write_fused_kv_norm_rope(kv, *rest, k_out, v_out, *static(config).values()) is None
    assert_matches_reference(inputs, config, k_out, v_out)
    slots = np.array([2, -1, 0])
    poison = np.full((2, 4, 2, 96), np.nan, np.float32).astype(inputs.kv.dtype)
    k_cache, v_cache = (to_torch(poison.copy()).to(DEVICE) for _ in range(2))
    torch.ops.fusedkv.write_fused_kv_norm_rope_into_cache(
        kv, *rest, to_torch(slots).to(DEVICE), k_cache, v_cache, *static(config).values(), None, None)
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), slots, poison, poison, **static(config))
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)


def workspace_slice(kv_host, device=DEVICE):
    """``kv`` as a view of a wider GEMM workspace whose token rows are also sliced."""
    total_ctx, n_layers, width = kv_host.shape
    kv = to_torch(kv_host).to(device)
    workspace = torch.zeros((total_ctx + 3, n_layers, width + 40), dtype=kv.dtype, device=device)
    view = workspace[2:2 + total_ctx, :, :width]
    view.copy_(kv)
    return view


def test_reads_kv_as_a_slice_of_a_wider_workspace_in_place():
    config = FusedKVConfig(2, 96, 96, "gptj")
    inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, seed=4)
    kv = workspace_slice(inputs.kv)
    assert not kv.is_contiguous()
    _, *rest = on_device(inputs)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(kv, *rest, **static(config)))


def test_reads_a_layer_major_kv_through_its_strides():
    config = FusedKVConfig(2, 64, 32, "neox")
    inputs = random_inputs(config, n_layers=3, total_ctx=4, max_position=64, seed=5)
    layer_major = to_torch(np.ascontiguousarray(inputs.kv.transpose(1, 0, 2))).to(DEVICE)
    kv = layer_major.transpose(0, 1)
    _, *rest = on_device(inputs)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(kv, *rest, **static(config)))


def test_writes_given_outputs_in_place_through_their_strides():
    config = FusedKVConfig(2, 128, 64, "gptj")
    inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=64, seed=6)
    kv, *rest = on_device(inputs)
    # K goes into a token window of a bigger cache; V into a token-major buffer.
    k_cache = poisoned((2, 11, 2, 128), kv.dtype)
    k_out = k_cache[:, 3:8]
    v_out = poisoned((5, 2, 2, 128), kv.dtype).transpose(0, 1)
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config), k_out=k_out, v_out=v_out)
    assert k is k_out and v is v_out
    assert_matches_reference(inputs, config, k_out, v_out)
    assert torch.isnan(k_cache[:, :3]).all() and torch.isnan(k_cache[:, 8:]).all()


@pytest.mark.parametrize("position_dtype", ["int32", "int64"])
def test_positions_on_the_host_are_moved_to_kv_device(position_dtype):
    config = FusedKVConfig(2, 64, 64)
    inputs = random_inputs(config, n_layers=2, total_ctx=4, max_position=64,
                           position_dtype=position_dtype, seed=7)
    kv, weight, eps, cos_sin, _ = on_device(inputs)
    positions = to_torch(inputs.positions)
    assert positions.device.type == "cpu"
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(
        kv, weight, eps, cos_sin, positions, **static(config)))


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float16", "float64"])
def test_k_norm_weight_of_any_float_dtype(weight_dtype):
    config = FusedKVConfig(2, 64, 64, "gptj")
    inputs = random_inputs(config, n_layers=2, total_ctx=3, max_position=64,
                           weight_dtype=weight_dtype, seed=8)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(*on_device(inputs), **static(config)))


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_positions_outside_the_cache_give_all_nan_k_rows_and_exact_v(style):
    config = FusedKVConfig(2, 96, 64, style)
    inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=16, seed=9)
    inputs.positions[[0, 2, 4]] = [-1, 16, 2**31 - 1]
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert torch.isnan(k[:, [0, 2, 4]]).all()
    assert not torch.isnan(k[:, [1, 3]]).any()
    assert_matches_reference(inputs, config, k, v)


# Edge values (README, "Edge values"): each against the reference and the rule itself.

# NaN with a payload, negative NaN, signaling NaN, +Inf, -Inf: bit patterns per kv dtype.
SPECIAL_BITS = {
    "float32": (np.uint32, [0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000]),
    "bfloat16": (np.uint16, [0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80]),
    "float16": (np.uint16, [0x7E01, 0xFE00, 0x7C01, 0x7C00, 0xFC00]),
}


# The interpreter computes in NumPy, which warns about the Inf and NaN these tests are about.
ieee_edge = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def special_values(dtype):
    width, bits = SPECIAL_BITS[dtype]
    return np.array(bits, width).view(numpy_dtype(dtype))


def edge_inputs(config, dtype, *, total_ctx=4, seed=50):
    return random_inputs(config, n_layers=1, total_ctx=total_ctx, dtype=dtype, max_position=64, seed=seed)


def k_head(kv, config, token, head):
    """The K elements of one head of layer 0, as a writable view."""
    return kv[token, 0, head * config.head_dim:(head + 1) * config.head_dim]


def all_nan(k, token, head):
    return bool(torch.isnan(k[0, token, head]).all())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_nan_and_inf_in_v_pass_through_bit_for_bit(dtype):
    config = FusedKVConfig(2, 64, 64, "neox")
    inputs = edge_inputs(config, dtype, total_ctx=2)
    inputs.kv[0, 0, config.kv_size:config.kv_size + 5] = special_values(dtype)
    inputs.kv[1, 0, -5:] = special_values(dtype)
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert_matches_reference(inputs, config, k, v)
    assert_bit_exact(v[0, 0, 0, :5], special_values(dtype))
    assert not torch.isnan(k).any()


@ieee_edge
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_nan_or_inf_in_a_k_head_gives_that_head_all_nan(style):
    config = FusedKVConfig(2, 128, 64, style)
    inputs = edge_inputs(config, "bfloat16")
    k_head(inputs.kv, config, 0, 0)[3] = np.nan
    k_head(inputs.kv, config, 1, 1)[100] = np.inf  # in the unrotated tail
    k_head(inputs.kv, config, 2, 0)[40] = -np.inf
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    poisoned_heads = {(0, 0), (1, 1), (2, 0)}
    for token in range(4):
        for head in range(2):
            assert all_nan(k, token, head) == ((token, head) in poisoned_heads)
    assert not torch.isnan(k[:, 3]).any()
    assert_matches_reference(inputs, config, k, v)


@ieee_edge
def test_k_squares_overflowing_fp32_give_that_head_all_nan():
    config = FusedKVConfig(2, 96, 32, "gptj")
    inputs = edge_inputs(config, "float32")
    k_head(inputs.kv, config, 1, 0)[7] = 1e20  # finite, but its square is not
    k_head(inputs.kv, config, 2, 1)[:] = -2e19
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert all_nan(k, 1, 0) and all_nan(k, 2, 1)
    assert not torch.isnan(k[0, 1, 1]).any() and not torch.isnan(k[0, 2, 0]).any()
    assert_matches_reference(inputs, config, k, v)


@ieee_edge
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eps_zero_with_zero_or_denormal_k_gives_zeros(dtype):
    config = FusedKVConfig(2, 64, 32, "neox")
    inputs = edge_inputs(config, dtype)
    inputs.eps[:] = 0.0
    k_head(inputs.kv, config, 0, 0)[:] = 0.0
    # Denormal in fp32 and bf16 alike; their squares underflow to zero.
    k_head(inputs.kv, config, 2, 1)[:] = 2.0 ** -130 * np.sign(np.arange(64) - 31.5)
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert bool((k[0, 0, 0] == 0).all()) and bool((k[0, 2, 1] == 0).all())
    assert bool((k[0, 0, 1] != 0).any()) and not torch.isnan(k).any()
    assert_matches_reference(inputs, config, k, v)


@ieee_edge
def test_fp16_output_beyond_its_range_is_inf():
    config = FusedKVConfig(2, 64, 64, "gptj")
    inputs = edge_inputs(config, "float16")
    inputs.k_norm_weight[:] = 1e6
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert bool(torch.isinf(k).any()) and not torch.isnan(k).any()
    assert_matches_reference(inputs, config, k, v)


@ieee_edge
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_huge_weights_in_the_unrotated_tail_give_inf_not_nan(style):
    config = FusedKVConfig(2, 128, 64, style)
    inputs = edge_inputs(config, "float32")
    inputs.k_norm_weight[:, 64:] = 3e38  # kn overflows fp32 wherever |k * inv_rms| > 1.14
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config))
    assert bool(torch.isinf(k[..., 64:]).any()) and not torch.isnan(k).any()
    assert bool(torch.isfinite(k[..., :64]).all())
    assert_matches_reference(inputs, config, k, v)


def test_check_positions_raises_before_writing():
    config = FusedKVConfig(2, 64, 64)
    inputs = random_inputs(config, n_layers=2, total_ctx=4, max_position=16, seed=10)
    inputs.positions[1] = 16
    kv, *rest = on_device(inputs)
    k_out, v_out = poisoned((2, 4, 2, 64), kv.dtype), poisoned((2, 4, 2, 64), kv.dtype)
    message = ("Invalid positions for fused KV materialization: got values outside [0, 16) "
               f"(min {inputs.positions.min()}, max 16), expected every position in [0, 16).")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(kv, *rest, **static(config), k_out=k_out, v_out=v_out, check_positions=True)
    assert torch.isnan(k_out).all() and torch.isnan(v_out).all()


def test_check_positions_passes_positions_in_range():
    config = FusedKVConfig(2, 64, 64)
    inputs = random_inputs(config, n_layers=1, total_ctx=3, max_position=16, seed=11)
    assert_matches_reference(inputs, config, *fused_kv_norm_rope(
        *on_device(inputs), **static(config), check_positions=True))


def test_empty_context_returns_empty_outputs():
    config = FusedKVConfig(2, 64, 32)
    inputs = random_inputs(config, n_layers=3, total_ctx=0, max_position=16)
    k, v = fused_kv_norm_rope(*on_device(inputs), **static(config), check_positions=True)
    assert k.shape == v.shape == (3, 0, 2, 64)
    assert k.device.type == DEVICE


def test_empty_context_is_still_validated():
    config = FusedKVConfig(2, 64, 32)
    inputs = random_inputs(config, n_layers=3, total_ctx=0, max_position=16)
    kv, weight, *rest = on_device(inputs)
    with pytest.raises(ValueError, match=re.escape("Invalid stacked k_norm_weight shape")):
        fused_kv_norm_rope(kv, weight[:2], *rest, **static(config))


CONFIG = FusedKVConfig(2, 64, 32)
# name: (the change to a good call of 3 tokens and 2 layers, the message word for word).
BAD_CALLS = {
    "kv_not_3d": (dict(kv=lambda a: a["kv"][:, 0]),
                  "Invalid stacked fused KV projection shape: got (3, 256), expected 3D "
                  "[total_ctx, n_layers, kv_size*2]."),
    "kv_trailing_dim": (dict(kv=lambda a: a["kv"][:, :, :-2]),
                        "Invalid fused KV projection shape: got (3, 2, 254), expected trailing dim 256."),
    "rotary_dim_odd": (dict(static=dict(rotary_dim=31)),
                       "Invalid fused KV rotary/head dim pair: rotary_dim=31, head_dim=64."),
    "rotary_dim_too_large": (dict(static=dict(rotary_dim=66)),
                             "Invalid fused KV rotary/head dim pair: rotary_dim=66, head_dim=64."),
    "k_norm_weight_shape": (dict(k_norm_weight=lambda a: a["k_norm_weight"][:, :32]),
                            "Invalid stacked k_norm_weight shape for fused KV materialization: got (2, 32), "
                            "expected (2, 64)."),
    "eps_shape": (dict(eps=lambda a: a["eps"][:1]),
                  "Invalid stacked eps shape for fused KV materialization: got (1,), expected (2,)."),
    "rope_style": (dict(static=dict(rope_style="llama")),
                   "Invalid rope_style for fused KV materialization: got 'llama', expected one of "
                   "('neox', 'gptj')."),
    "kv_dtype": (dict(kv=lambda a: a["kv"].to(torch.int32)),
                 "Invalid kv dtype for fused KV materialization: got int32, expected one of "
                 "('bfloat16', 'float16', 'float32')."),
    "eps_dtype": (dict(eps=lambda a: a["eps"].double()),
                  "Invalid eps dtype for fused KV materialization: got float64, expected one of ('float32',)."),
    "cos_sin_cache_width": (dict(cos_sin_cache=lambda a: a["cos_sin_cache"][:, :16]),
                            "Invalid cos_sin_cache shape for fused KV materialization: got (16, 16), "
                            "expected (max_pos, 32) with max_pos > 0."),
    "positions_length": (dict(positions=lambda a: a["positions"][:2]),
                         "Invalid positions shape for fused KV materialization: got (2,), expected (3,)."),
    "positions_dtype": (dict(positions=lambda a: a["positions"].float()),
                        "Invalid positions dtype for fused KV materialization: got float32, expected one of "
                        "('int32', 'int64')."),
    "k_out_shape": (dict(k_out=lambda a: a["k_out"][:, :2]),
                    "Invalid k_out shape for fused KV materialization: got (2, 2, 2, 64), expected (2, 3, 2, 64)."),
    "v_out_dtype": (dict(v_out=lambda a: a["v_out"].float()),
                    f"Invalid v_out device/dtype for fused KV materialization: got device={DEVICE_NAME}, "
                    f"dtype=float32, expected device={DEVICE_NAME}, dtype=bfloat16."),
}


def _bad_call(name):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=12)
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), on_device(inputs)))
    args["k_out"] = poisoned((2, 3, 2, 64), args["kv"].dtype)
    args["v_out"] = poisoned((2, 3, 2, 64), args["kv"].dtype)
    untouched = (args["k_out"], args["v_out"])
    change, _ = BAD_CALLS[name]
    settings = {**static(CONFIG), **change.get("static", {})}
    for key, edit in change.items():
        if key != "static":
            args[key] = edit(args)
    return args, settings, untouched


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_call_raises_validation_message_and_writes_nothing(name):
    args, settings, untouched = _bad_call(name)
    with pytest.raises(ValueError, match=f"^{re.escape(BAD_CALLS[name][1])}$"):
        fused_kv_norm_rope(**args, **settings)
    for buffer in untouched:
        assert torch.isnan(buffer).all()


def test_a_rejected_call_is_rejected_again_after_good_calls():
    # Validation is remembered per metadata for accepted calls only.
    args, settings, untouched = _bad_call("k_out_shape")
    good = {**args, "k_out": untouched[0]}
    for _ in range(2):
        fused_kv_norm_rope(**good, **settings)
        with pytest.raises(ValueError, match="^Invalid k_out shape"):
            fused_kv_norm_rope(**args, **settings)


SHAPE = CONFIG.output_shape(2, 3)


def bits(tensor):
    return as_numpy(tensor).tobytes()


@pytest.mark.parametrize("total_ctx", [3, 64])  # from 64 tokens the tile choice divides by the heads
@pytest.mark.parametrize("sizes, error, message", [
    (dict(num_kv_heads=2.5), TypeError,
     "Invalid num_kv_heads for fused KV materialization: got 2.5 (float), expected a positive int."),
    (dict(num_kv_heads=True), TypeError,
     "Invalid num_kv_heads for fused KV materialization: got True (bool), expected a positive int."),
    (dict(num_kv_heads=0), ValueError,
     "Invalid num_kv_heads for fused KV materialization: got 0, expected a positive int."),
    (dict(head_dim="64"), TypeError,
     "Invalid head_dim for fused KV materialization: got '64' (str), expected a positive int."),
    (dict(rotary_dim=32.0), TypeError,
     "Invalid rotary_dim for fused KV materialization: got 32.0 (float), expected an even int in [2, 64]."),
], ids=["heads-2.5", "heads-True", "heads-0", "head_dim-str", "rotary-float"])
def test_sizes_that_are_not_positive_ints_are_refused_before_any_work(sizes, error, message, total_ctx):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=total_ctx, max_position=16, seed=14)
    kv, *rest = on_device(inputs)
    shape = CONFIG.output_shape(2, total_ctx)
    k_out, v_out = poisoned(shape, kv.dtype), poisoned(shape, kv.dtype)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(kv, *rest, **{**static(CONFIG), **sizes}, k_out=k_out, v_out=v_out)
    assert torch.isnan(k_out).all() and torch.isnan(v_out).all()


def test_a_float_size_is_refused_after_the_same_call_with_ints_passed():
    # The accepted call is remembered by its metadata, in which 2.0 == 2.
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=15)
    kv, *rest = on_device(inputs)
    fused_kv_norm_rope(kv, *rest, **static(CONFIG))
    k_out = poisoned(SHAPE, kv.dtype)
    with pytest.raises(TypeError, match=re.escape("Invalid num_kv_heads for fused KV materialization: got 2.0 "
                                                  "(float), expected a positive int.")):
        fused_kv_norm_rope(kv, *rest, **{**static(CONFIG), "num_kv_heads": 2.0}, k_out=k_out)
    assert torch.isnan(k_out).all()


@pytest.mark.parametrize("foreign, got", [("kv", "numpy.ndarray"), ("positions", "list"), ("v_out", "numpy.ndarray")])
def test_arrays_of_another_framework_are_refused_with_a_pointer_to_interop(foreign, got):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=16)
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), on_device(inputs)))
    k_out = poisoned(SHAPE, args["kv"].dtype)
    args["v_out"] = poisoned(SHAPE, args["kv"].dtype)
    args[foreign] = {"kv": inputs.kv, "positions": inputs.positions.tolist(),
                     "v_out": np.zeros(SHAPE, inputs.kv.dtype)}[foreign]
    message = (f"Invalid {foreign} for fused KV materialization: got {got}, expected a torch.Tensor "
               "(fusedkv_torch takes torch tensors; interop.fused_kv_norm_rope takes arrays of any framework).")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope(**args, **static(CONFIG), k_out=k_out)
    assert torch.isnan(k_out).all()


OVERLAP_MESSAGE = "got a buffer overlapping {}, expected outputs that overlap neither each other nor kv."


def overlapping_outputs(case, kv):
    """``(k_out, v_out, message)``: outputs of the right shape, dtype and device that
    the kernel would write wrongly, and the error they must get."""
    n = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
    if case == "one tensor as both":
        k_out = poisoned(SHAPE, kv.dtype)
        return k_out, k_out, "Invalid v_out for fused KV materialization: " + OVERLAP_MESSAGE.format("k_out")
    if case == "partly shared":
        pool = poisoned((2 * n - 64,), kv.dtype)
        return (pool[:n].view(SHAPE), pool[n - 64:].view(SHAPE),
                "Invalid v_out for fused KV materialization: " + OVERLAP_MESSAGE.format("k_out"))
    if case == "one buffer in two storages":  # as DLPack imports make them
        k_out = poisoned(SHAPE, kv.dtype)
        return (k_out, torch.utils.dlpack.from_dlpack(k_out.__dlpack__()),
                "Invalid v_out for fused KV materialization: " + OVERLAP_MESSAGE.format("k_out"))
    if case == "k_out over kv":
        return (kv.reshape(-1)[n:].view(SHAPE), poisoned(SHAPE, kv.dtype),
                "Invalid k_out for fused KV materialization: " + OVERLAP_MESSAGE.format("kv"))
    assert case == "expanded"
    return (poisoned((1, *SHAPE[1:]), kv.dtype).expand(SHAPE), poisoned(SHAPE, kv.dtype),
            "Invalid k_out for fused KV materialization: got strides (0, 128, 64, 1) with a zero stride, "
            "expected no zero strides.")


@pytest.mark.parametrize("case", ["one tensor as both", "partly shared", "one buffer in two storages",
                                  "k_out over kv", "expanded"])
def test_overlapping_outputs_are_refused_on_every_call_and_nothing_is_written(case):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=17)
    kv, *rest = on_device(inputs)
    # The same metadata with separate outputs first: accepted, and remembered.
    fused_kv_norm_rope(kv, *rest, **static(CONFIG), k_out=poisoned(SHAPE, kv.dtype),
                       v_out=poisoned(SHAPE, kv.dtype))
    k_out, v_out, message = overlapping_outputs(case, kv)
    before = [bits(buffer) for buffer in (kv, k_out, v_out)]
    for _ in range(2):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fused_kv_norm_rope(kv, *rest, **static(CONFIG), k_out=k_out, v_out=v_out)
    assert [bits(buffer) for buffer in (kv, k_out, v_out)] == before


def test_k_and_v_side_by_side_in_one_pool_share_no_element_and_are_written():
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=18)
    kv, *rest = on_device(inputs)
    pool = poisoned((2, 2, *SHAPE[1:]), kv.dtype)  # [n_layers, K or V, total_ctx, heads, head_dim]
    k, v = fused_kv_norm_rope(kv, *rest, **static(CONFIG), k_out=pool[:, 0], v_out=pool[:, 1])
    assert_matches_reference(inputs, CONFIG, k, v)


@pytest.mark.parametrize("override, error, message", [
    (dict(block_tokens=2.0), TypeError,
     "Invalid block_tokens for fused KV materialization: got 2.0 (float), expected a power of two (an int)."),
    (dict(block_tokens=0), ValueError,
     "Invalid block_tokens for fused KV materialization: got 0, expected a power of two."),
    (dict(num_warps=3), ValueError,
     "Invalid num_warps for fused KV materialization: got 3, expected a power of two."),
    (dict(block_heads=0), ValueError,
     "Invalid block_heads for fused KV materialization: got 0, expected a positive int."),
], ids=["block_tokens-float", "block_tokens-0", "num_warps-3", "block_heads-0"])
def test_launch_tile_overrides_are_checked_before_launching(override, error, message):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=19)
    kv, *rest = on_device(inputs)
    k_out, v_out = poisoned(SHAPE, kv.dtype), poisoned(SHAPE, kv.dtype)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        launch(kv, *rest, k_out, v_out, config=CONFIG, **override)
    assert torch.isnan(k_out).all() and torch.isnan(v_out).all()


def test_without_a_gpu_or_the_interpreter_the_error_says_to_set_triton_interpret():
    # conftest sets TRITON_INTERPRET for this process; a fresh one without it compiles for
    # a GPU, which CPU tensors (and, here, a machine without one) cannot run.
    script = textwrap.dedent("""
        import torch
        from fusedkv_torch import fused_kv_norm_rope
        from interop.exchange import to_torch
        from interop.testing import random_inputs
        from interop.spec import FusedKVConfig

        inputs = random_inputs(FusedKVConfig(2, 64, 32), n_layers=2, total_ctx=3, max_position=16)
        args = [to_torch(array) for array in inputs.arrays()]
        k_out = torch.full((2, 3, 2, 64), float("nan"), dtype=args[0].dtype)
        try:
            fused_kv_norm_rope(*args, num_kv_heads=2, head_dim=64, rotary_dim=32, k_out=k_out)
        except ValueError as error:
            print(error)
        print(bool(torch.isnan(k_out).all()))
    """)
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=pathlib.Path(__file__).parents[1], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-2:] == [
        "Invalid kv device for fused KV materialization: got device=cpu, expected a CUDA device (to run "
        "the Triton kernel on the CPU, set TRITON_INTERPRET=1 before fusedkv_torch is imported).",
        "True",
    ]


# The paged-cache path.

def cache_call(config, *, n_layers=2, total_ctx=6, num_slots=9, cache_dtype=None, seed=20,
               slot_dtype="int64"):
    """Host inputs, slots with padding (-1) and one slot past the cache, a poisoned cache."""
    inputs = random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=64, seed=seed)
    rng = np.random.default_rng(seed)
    slots = rng.permutation(num_slots)[:total_ctx].astype(numpy_dtype(slot_dtype))
    slots[1:2] = -1
    slots[3:4] = num_slots
    cache_dtype = cache_dtype or inputs.kv.dtype
    shape = (n_layers, num_slots, config.num_kv_heads, config.head_dim)
    poison = np.full(shape, np.nan, np.float32).astype(cache_dtype)
    scales = None
    if cache_dtype == numpy_dtype("float8_e4m3fn"):
        scales = rng.uniform(0.02, 0.05, size=(2, n_layers)).astype(np.float32)
        # Finite poison: Triton's interpreter turns fp8 NaN into 384, ruining the comparison.
        poison = np.full(shape, -3.0, np.float32).astype(cache_dtype)
    return inputs, slots, poison, scales


def run_cache_call(inputs, slots, poison, scales, config, *, k_cache=None, v_cache=None):
    k_cache = to_torch(poison.copy()).to(DEVICE) if k_cache is None else k_cache
    v_cache = to_torch(poison.copy()).to(DEVICE) if v_cache is None else v_cache
    scale_args = {} if scales is None else dict(k_scale=to_torch(scales[0]).to(DEVICE),
                                                v_scale=to_torch(scales[1]).to(DEVICE))
    result = fused_kv_norm_rope_into_cache(*on_device(inputs), to_torch(slots).to(DEVICE),
                                           k_cache, v_cache, **static(config), **scale_args)
    assert result[0] is k_cache and result[1] is v_cache
    host_scales = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    expected = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), slots, poison, poison, **static(config), **host_scales)
    return k_cache, v_cache, expected


def untouched_slots(slots, num_slots):
    return sorted(set(range(num_slots)) - set(int(s) for s in slots))


@pytest.mark.parametrize("slot_dtype", ["int32", "int64"])
@pytest.mark.parametrize("heads, head_dim, rotary_dim, style", [CASES[1], CASES[6], CASES[4]])
def test_cache_rows_are_written_at_their_slots_and_padding_is_skipped(
        slot_dtype, heads, head_dim, rotary_dim, style):
    config = FusedKVConfig(heads, head_dim, rotary_dim, style)
    inputs, slots, poison, scales = cache_call(config, slot_dtype=slot_dtype)
    k_cache, v_cache, (expected_k, expected_v) = run_cache_call(inputs, slots, poison, scales, config)
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)
    untouched = untouched_slots(slots, poison.shape[1])
    assert_bit_exact(as_numpy(k_cache)[:, untouched], poison[:, untouched], name="k untouched")


def test_cache_written_through_its_strides():
    config = FusedKVConfig(2, 64, 64, "neox")
    inputs, slots, poison, scales = cache_call(config, total_ctx=5, num_slots=7)
    # A slot-major buffer seen layer-major, as an allocator holding all layers per slot would.
    slot_major = to_torch(np.ascontiguousarray(poison.transpose(1, 0, 2, 3))).to(DEVICE)
    k_cache = slot_major.transpose(0, 1)
    k_cache, v_cache, (expected_k, expected_v) = run_cache_call(
        inputs, slots, poison, scales, config, k_cache=k_cache)
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_fp8_cache_holds_scaled_values_rounded_once(style):
    config = FusedKVConfig(2, 96, 64, style)
    inputs, slots, poison, scales = cache_call(config, cache_dtype=numpy_dtype("float8_e4m3fn"))
    # Some values past the fp8 range (the scales are at most 0.05): they must saturate to
    # +-448, not turn into NaN.
    inputs.kv[0, 0, config.kv_size:config.kv_size + 4] = [30.0, -30.0, 1.0, -1.0]
    k_cache, v_cache, (expected_k, expected_v) = run_cache_call(inputs, slots, poison, scales, config)
    assert as_numpy(v_cache).astype(np.float32).max() == 448.0
    assert_fp8_close(k_cache, expected_k, triton_interpreter=not ON_GPU)
    assert_fp8_close(v_cache, expected_v, name="v", triton_interpreter=not ON_GPU)
    # The comparison catches a cache quantized with scales 5% off.
    k_off, v_off, _ = run_cache_call(inputs, slots, poison, scales * np.float32(1.05), config)
    for name, got, expected in (("k", k_off, expected_k), ("v", v_off, expected_v)):
        assert not compare(got, expected, name=name, triton_interpreter=not ON_GPU).ok


@ieee_edge
def test_fp8_cache_saturates_inf_and_big_values_and_keeps_nan():
    config = FusedKVConfig(2, 64, 32, "neox")
    inputs, slots, poison, scales = cache_call(config, n_layers=1, total_ctx=4, num_slots=6,
                                               cache_dtype=numpy_dtype("float8_e4m3fn"))
    inputs.kv[0, 0, config.kv_size:config.kv_size + 5] = [np.inf, -np.inf, 1e4, -1e4, np.nan]
    inputs.kv[0, 0, 5] = np.inf  # K head 0 of token 0: all NaN
    inputs.k_norm_weight[:, 32:] = 3e38  # the unrotated tail overflows to +-Inf: +-448
    k_cache, v_cache, (expected_k, expected_v) = run_cache_call(inputs, slots, poison, scales, config)
    assert np.isnan(expected_k[0, slots[0], 0].astype(np.float32)).all()
    assert as_numpy(v_cache)[0, slots[0], 0, :4].astype(np.float32).tolist() == [448, -448, 448, -448]
    assert np.abs(as_numpy(k_cache)[0, slots[2], :, 32:].astype(np.float32)).max() == 448  # token 2's tail
    got = {"k": as_numpy(k_cache), "v": as_numpy(v_cache)}
    expected = {"k": expected_k, "v": expected_v}
    if not ON_GPU:  # the interpreter writes fp8 NaN as 384; the GPU checks those codes too
        for name in got:
            kept = ~np.isnan(expected[name].astype(np.float32))
            got[name], expected[name] = got[name][kept], expected[name][kept]
    for name in got:
        assert_fp8_close(got[name], expected[name], name=name, triton_interpreter=not ON_GPU)


@pytest.mark.parametrize("k_dtype, v_dtype", [("float8_e4m3fn", "bfloat16"), ("bfloat16", "float8_e4m3fn")],
                         ids=["fp8-k-bf16-v", "bf16-k-fp8-v"])
def test_mixed_caches_quantize_the_fp8_one_with_its_own_scale(k_dtype, v_dtype):
    config = FusedKVConfig(2, 96, 64, "gptj")
    inputs = random_inputs(config, n_layers=2, total_ctx=5, max_position=64, seed=22)
    slots = np.array([4, -1, 0, 7, 2])
    # Finite poison (the interpreter writes fp8 NaN as 384); scales with random mantissas
    # (a round one makes exact ties, which the interpreter rounds away from zero).
    before = {name: np.full((2, 8, 2, 96), -3.0, np.float32).astype(numpy_dtype(dtype))
              for name, dtype in (("k", k_dtype), ("v", v_dtype))}
    scales = {f"{name}_scale": np.random.default_rng(23).uniform(0.02, 0.05, 2).astype(np.float32)
              for name, dtype in (("k", k_dtype), ("v", v_dtype)) if dtype == "float8_e4m3fn"}
    k_cache, v_cache = (to_torch(before[name].copy()).to(DEVICE) for name in ("k", "v"))
    # Scales on the host: each is moved to the device on its own.
    fused_kv_norm_rope_into_cache(*on_device(inputs), to_torch(slots).to(DEVICE), k_cache, v_cache,
                                  **static(config), **{name: to_torch(s) for name, s in scales.items()})
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), slots, before["k"], before["v"], **static(config), **scales)
    if k_dtype == "float8_e4m3fn":
        assert_fp8_close(k_cache, expected_k, triton_interpreter=not ON_GPU)
        assert_bit_exact(v_cache, expected_v, name="v")
    else:
        assert_close(k_cache, expected_k)
        assert_fp8_close(v_cache, expected_v, name="v", triton_interpreter=not ON_GPU)


def test_empty_context_leaves_the_cache_untouched():
    config = FusedKVConfig(2, 64, 64)
    inputs, slots, poison, scales = cache_call(config, total_ctx=0)
    k_cache, v_cache, _ = run_cache_call(inputs, slots, poison, scales, config)
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


# name: (the change to a good call of 3 tokens, 2 layers and 5 slots, the message word for word).
BAD_CACHE_CALLS = {
    "kv_trailing_dim": (dict(kv=lambda a: a["kv"][:, :, :-2]),
                        "Invalid fused KV projection shape: got (3, 2, 254), expected trailing dim 256."),
    "cache_loc_dtype": (dict(cache_loc=lambda a: a["cache_loc"].float()),
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
    "cache_dtype": (dict(v_cache=lambda a: a["v_cache"].float()),
                    f"Invalid v_cache device/dtype for fused KV materialization: got device={DEVICE_NAME}, "
                    f"dtype=float32, expected device={DEVICE_NAME}, dtype one of ('bfloat16', 'float8_e4m3fn')."),
    "scale_for_a_bf16_cache": (dict(k_scale=lambda a: torch.ones(2, device=DEVICE)),
                               "Invalid k_scale for fused KV materialization: got a scale, expected None for a "
                               "cache that is not float8_e4m3fn."),
    "fp8_cache_without_scale": (dict(k_cache=lambda a: a["k_cache"].to(torch.float8_e4m3fn)),
                                "Invalid k_scale for fused KV materialization: got None, expected float32(2,) "
                                "for a float8_e4m3fn cache."),
}


@pytest.mark.parametrize("name", BAD_CACHE_CALLS)
def test_bad_cache_call_raises_validation_message_and_writes_nothing(name):
    inputs, slots, poison, _ = cache_call(CONFIG, total_ctx=3, num_slots=5, seed=21)
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), on_device(inputs)))
    args.update(cache_loc=to_torch(slots).to(DEVICE), k_cache=to_torch(poison.copy()).to(DEVICE),
                v_cache=to_torch(poison.copy()).to(DEVICE))
    caches = (args["k_cache"], args["v_cache"])
    change, message = BAD_CACHE_CALLS[name]
    for key, edit in change.items():
        args[key] = edit(args)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope_into_cache(**args, **static(CONFIG))
    for cache in caches:
        assert torch.isnan(cache).all()


@pytest.mark.parametrize("case", ["one tensor as both caches", "v_cache over kv"])
def test_overlapping_caches_are_refused_on_every_call_and_nothing_is_written(case):
    inputs, slots, poison, _ = cache_call(CONFIG, total_ctx=3, num_slots=5, seed=22)
    kv, *rest = on_device(inputs)
    cache_loc = to_torch(slots).to(DEVICE)
    # The same metadata with separate caches first: accepted, and remembered.
    fused_kv_norm_rope_into_cache(kv, *rest, cache_loc, *(to_torch(poison.copy()).to(DEVICE) for _ in range(2)),
                                  **static(CONFIG))
    k_cache = to_torch(poison.copy()).to(DEVICE)
    if case == "one tensor as both caches":
        v_cache, message = k_cache, "Invalid v_cache for fused KV materialization: " + OVERLAP_MESSAGE.format("k_cache")
    else:
        v_cache = kv.reshape(-1)[:poison.size].view(poison.shape)
        message = "Invalid v_cache for fused KV materialization: " + OVERLAP_MESSAGE.format("kv")
    before = [bits(buffer) for buffer in (kv, k_cache, v_cache)]
    for _ in range(2):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fused_kv_norm_rope_into_cache(kv, *rest, cache_loc, k_cache, v_cache, **static(CONFIG))
    assert [bits(buffer) for buffer in (kv, k_cache, v_cache)] == before


def test_a_cache_call_refuses_another_frameworks_cache():
    inputs, slots, poison, _ = cache_call(CONFIG, total_ctx=3, num_slots=5, seed=23)
    k_cache = to_torch(poison.copy()).to(DEVICE)
    message = ("Invalid v_cache for fused KV materialization: got numpy.ndarray, expected a torch.Tensor "
               "(fusedkv_torch takes torch tensors; interop.fused_kv_norm_rope takes arrays of any framework).")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        fused_kv_norm_rope_into_cache(*on_device(inputs), to_torch(slots).to(DEVICE), k_cache, poison.copy(),
                                      **static(CONFIG))
    assert torch.isnan(k_cache).all()


# GPU only: real sizes, compilation, CUDA graphs, 64-bit offsets.

REAL = FusedKVConfig(8, 128, 128, "neox")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, config, n_layers, total_ctx", [
    ("bfloat16", REAL, 5, 4096),
    ("bfloat16", REAL, 5, 16),
    ("bfloat16", FusedKVConfig(8, 128, 64, "gptj"), 5, 4099),
    ("float16", FusedKVConfig(4, 256, 256, "neox"), 8, 1000),
    ("float32", FusedKVConfig(3, 96, 32, "gptj"), 1, 777),
])
def test_real_sizes_fill_poisoned_outputs(dtype, config, n_layers, total_ctx):
    inputs = random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, dtype=dtype, seed=30)
    inputs.positions[::97] = -5
    kv, *rest = on_device(inputs)
    shape = config.output_shape(n_layers, total_ctx)
    k, v = fused_kv_norm_rope(kv, *rest, **static(config),
                              k_out=poisoned(shape, kv.dtype), v_out=poisoned(shape, kv.dtype))
    assert_matches_reference(inputs, config, k, v)


@gpu
@pytest.mark.gpu
def test_fp8_cache_keeps_nan_rows_and_rounds_like_the_reference():
    config = FusedKVConfig(8, 128, 128, "neox")
    inputs, slots, poison, scales = cache_call(config, n_layers=5, total_ctx=300, num_slots=512,
                                               cache_dtype=numpy_dtype("float8_e4m3fn"))
    inputs.positions[::7] = 10**6
    k_cache, v_cache, (expected_k, expected_v) = run_cache_call(inputs, slots, poison, scales, config)
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)


@gpu
@pytest.mark.gpu
def test_compiles_fullgraph_with_and_without_given_outputs():
    inputs = random_inputs(REAL, n_layers=5, total_ctx=256, seed=31)
    kv, *rest = on_device(inputs)

    @torch.compile(fullgraph=True)
    def allocate(*args):
        return fused_kv_norm_rope(*args, **static(REAL))

    @torch.compile(fullgraph=True)
    def into(*args, k_out, v_out):
        fused_kv_norm_rope(*args, **static(REAL), k_out=k_out, v_out=v_out)
        return k_out.float().sum()

    assert_matches_reference(inputs, REAL, *allocate(kv, *rest))
    shape = REAL.output_shape(5, 256)
    k_out, v_out = poisoned(shape, kv.dtype), poisoned(shape, kv.dtype)
    into(kv, *rest, k_out=k_out, v_out=v_out)
    assert_matches_reference(inputs, REAL, k_out, v_out)


@gpu
@pytest.mark.gpu
def test_cache_variant_compiles_fullgraph():
    inputs, slots, poison, scales = cache_call(REAL, n_layers=5, total_ctx=200, num_slots=300,
                                               cache_dtype=numpy_dtype("float8_e4m3fn"))
    k_cache, v_cache = (to_torch(poison.copy()).to(DEVICE) for _ in range(2))
    k_scale, v_scale = (to_torch(s).to(DEVICE) for s in scales)

    @torch.compile(fullgraph=True)
    def write(*args):
        return fused_kv_norm_rope_into_cache(*args, k_cache, v_cache, **static(REAL),
                                             k_scale=k_scale, v_scale=v_scale)

    write(*on_device(inputs), to_torch(slots).to(DEVICE))
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), slots, poison, poison, **static(REAL), k_scale=scales[0], v_scale=scales[1])
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("total_ctx", [16, 256])
def test_cuda_graph_replay_reads_new_positions(total_ctx):
    inputs = random_inputs(REAL, n_layers=5, total_ctx=total_ctx, seed=32)
    kv, weight, eps, cos_sin, positions = on_device(inputs)
    k_out, v_out = fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **static(REAL))  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **static(REAL), k_out=k_out, v_out=v_out)
    for seed in (33, 34):
        fresh = random_inputs(REAL, n_layers=5, total_ctx=total_ctx, seed=seed)
        fresh.positions[0] = -1
        positions.copy_(to_torch(fresh.positions))
        kv.copy_(to_torch(fresh.kv))
        k_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = dataclasses.replace(inputs, kv=fresh.kv, positions=fresh.positions)
        assert_matches_reference(replayed, REAL, k_out, v_out)


@gpu
@pytest.mark.gpu
def test_cuda_graph_replay_writes_new_cache_slots():
    inputs, slots, poison, scales = cache_call(REAL, n_layers=5, total_ctx=16, num_slots=64)
    args = on_device(inputs)
    cache_loc = to_torch(slots).to(DEVICE)
    k_cache, v_cache = (to_torch(poison.copy()).to(DEVICE) for _ in range(2))
    fused_kv_norm_rope_into_cache(*args, cache_loc, k_cache, v_cache, **static(REAL))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_kv_norm_rope_into_cache(*args, cache_loc, k_cache, v_cache, **static(REAL))
    new_slots = slots.copy()
    new_slots[new_slots >= 0] += 32
    new_slots[new_slots >= 64] = -1
    cache_loc.copy_(to_torch(new_slots))
    k_cache.copy_(to_torch(poison))
    v_cache.copy_(to_torch(poison))
    graph.replay()
    torch.cuda.synchronize()
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *inputs.arrays(), new_slots, poison, poison, **static(REAL))
    assert_close(k_cache, expected_k)
    assert_bit_exact(v_cache, expected_v)


@gpu
@pytest.mark.gpu
def test_repeated_eager_calls_launch_directly_for_every_alignment():
    # One metadata, three address alignments of kv and k_out (0, 2 and 8 bytes past 16):
    # the first round compiles each through kernel[grid], the second launches directly.
    total_ctx, numel = 37, 37 * 5 * 2 * REAL.kv_size
    shape = REAL.output_shape(5, total_ctx)

    def compiled_launches():
        return sum(len(accepted.prepared["torch"].compiled) for accepted in spec_module._ACCEPTED_CALLS.values()
                   if "torch" in accepted.prepared)

    before, counts = compiled_launches(), []
    for round_ in range(2):
        for offset in (0, 1, 4):
            inputs = random_inputs(REAL, n_layers=5, total_ctx=total_ctx, seed=40 + offset + 10 * round_)
            _, *rest = on_device(inputs)
            kv_space = torch.zeros(numel + 16, dtype=torch.bfloat16, device=DEVICE)
            kv = kv_space[offset:offset + numel].view(inputs.kv.shape)
            kv.copy_(to_torch(inputs.kv))
            k_out = poisoned((numel // 2 + 16,), kv.dtype)[offset:offset + numel // 2].view(shape)
            k, v = fused_kv_norm_rope(kv, *rest, **static(REAL), k_out=k_out, v_out=poisoned(shape, kv.dtype))
            assert_matches_reference(inputs, REAL, k, v)
        counts.append(compiled_launches())
    assert kernel_module._launcher.direct
    assert counts == [before + 3, before + 3]


@gpu
@pytest.mark.gpu
def test_offsets_past_two_to_the_31_elements():
    # kv holds 2**32 + 2**21 elements and each output 2**31 + 2**20: int32 offsets would wrap.
    # Inputs are made on the device (17 GB of host fp32 otherwise); a sample of rows is checked.
    config = FusedKVConfig(8, 128, 128, "neox")
    total_ctx = 2**21 + 1024
    shared = random_inputs(config, n_layers=1, total_ctx=0, max_position=4096, seed=35)
    _, weight, eps, cos_sin, _ = on_device(shared)
    kv = torch.randn((total_ctx, 1, 2 * config.kv_size), dtype=torch.bfloat16, device=DEVICE)
    positions = torch.randint(0, 4096, (total_ctx,), dtype=torch.int32, device=DEVICE)
    k, v = fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **static(config))
    rows = torch.as_tensor(np.concatenate([np.arange(4), np.random.default_rng(0).integers(0, total_ctx, 60),
                                           np.arange(total_ctx - 4, total_ctx)]), device=DEVICE)
    sample = dataclasses.replace(shared, kv=as_numpy(kv[rows]), positions=as_numpy(positions[rows]))
    assert_matches_reference(sample, config, k[:, rows], v[:, rows])


def test_no_dependent_launch_on_the_cpu_or_in_the_interpreter():
    assert not kernel_module.supports_dependent_launch(torch.device("cpu"))
    if kernel_module._launcher.interpreted:
        assert not kernel_module.supports_dependent_launch(torch.device("cuda"))


@gpu
@pytest.mark.gpu
def test_dependent_launch_on_the_h200():
    # The H200 is a Hopper GPU, where the launches measured in BENCHMARKS.md used PDL.
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("pinned on the project's H200")
    assert kernel_module.supports_dependent_launch(torch.device("cuda"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
def test_dependent_launch_reads_what_the_kernel_ahead_of_it_wrote(captured):
    # The second call's kv is the first call's V output, launched right behind it: with
    # programmatic dependent launch the second may start while the first still writes
    # (a 32768-token first call runs ~0.3 ms), so a read before its wait would see NaN.
    n_layers, total_ctx = 5, 32768
    first = random_inputs(REAL, n_layers=n_layers, total_ctx=total_ctx, seed=36)
    kv, weight, eps, cos_sin, positions = on_device(first)
    second_positions_host = np.random.default_rng(37).integers(0, cos_sin.shape[0], total_ctx // 2, dtype=np.int32)
    second_positions = to_torch(second_positions_host).to(DEVICE)
    shape = REAL.output_shape(n_layers, total_ctx)
    k1, v1 = poisoned(shape, kv.dtype), poisoned(shape, kv.dtype)
    second_kv = v1.view(total_ctx // 2, n_layers, kv.shape[2])
    k2, v2 = (poisoned(REAL.output_shape(n_layers, total_ctx // 2), kv.dtype) for _ in range(2))

    def both():
        fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **static(REAL), k_out=k1, v_out=v1)
        fused_kv_norm_rope(second_kv, weight, eps, cos_sin, second_positions, **static(REAL), k_out=k2, v_out=v2)

    if captured:
        both()  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            both()
        for buffer in (k1, v1, k2, v2):
            buffer.fill_(float("nan"))
        graph.replay()
    else:
        both()
    torch.cuda.synchronize()
    assert not torch.isnan(v1).any()
    chained = dataclasses.replace(first, kv=as_numpy(second_kv), positions=second_positions_host)
    assert_matches_reference(chained, REAL, k2, v2)
