"""What only the torch backend has: tiles and launches, registered ops, strided torch
views, the remembered validation of an accepted call, and on a GPU real
sizes, torch.compile, CUDA graphs, 64-bit offsets and dependent launches.

What both backends must do alike (the reference, edge values, the cache, refusals) is
``test_contract_op.py``'s. Here too: interpret mode on the CPU, compiled on a GPU; K
under interop's tolerance table, V bit for bit, rejected calls write nothing.
"""

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from interop.core.arrays import as_numpy, numpy_dtype
from interop.exchange import to_torch
from interop.core.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.core import spec as spec_module
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close, random_inputs
from fusedkv_torch import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_torch import kernel as kernel_module
from fusedkv_torch import ops as ops_module
from fusedkv_torch.kernel import launch
from fusedkv_torch.launcher import Launch, expected_attributes, specialization_key

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")

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


def test_only_a_gptj_row_whose_block_has_fewer_lanes_than_its_pieces_is_loaded_as_pairs_throughout():
    cases = {FusedKVConfig(2, 96, 24, "gptj"): (96, 64, 0, 128),  # a 128 block, not 32 and 128
             FusedKVConfig(2, 97, 24, "gptj"): (96, 64, 1, 128),  # the odd last dim its own tail
             FusedKVConfig(2, 80, 40, "gptj"): (40, 32, 64, 128),  # 128 lanes either way
             FusedKVConfig(2, 96, 24, "neox"): (24, 16, 128, 128),  # halves have no pairs past the rotary dims
             FusedKVConfig(2, 128, 128, "gptj"): (128, 64, 0, 128)}
    for config, blocks in cases.items():
        assert kernel_module.piece_blocks(config, whole_rows=True) == blocks
        assert kernel_module.piece_blocks(config)[0] == config.rotary_dim  # without whole rows: the rotary dims


@pytest.mark.parametrize("head_dim, rotary_dim, style, block_heads, num_warps, one_row", [
    (80, 40, "gptj", 2, 1, True),  # g07 at 64 tokens
    (80, 40, "neox", 2, 1, False),  # g26 at 64 tokens: neox halves in one warp
    (80, 40, "neox", 8, 2, True),  # g26 at 1024 tokens
    (192, 48, "neox", 8, 8, True),  # g33 at 256 tokens
    (96, 24, "gptj", 8, 2, True),  # g21 at 4096 tokens
    (97, 96, "neox", 2, 2, True),  # an odd head_dim with a partial rotary
    (80, 80, "gptj", 1, 2, False),  # g04: one head a tile, a full rotary
    (80, 80, "gptj", 2, 2, False),  # a full rotary
    (192, 48, "gptj", 1, 4, False),  # g30: one head a tile
    (192, 192, "neox", 8, 4, False),  # g31: a full rotary
    (128, 32, "gptj", 8, 2, False),  # every lane holds an element
    (64, 32, "neox", 2, 2, False),
    (256, 64, "neox", 8, 4, False),
])
def test_the_norm_weight_is_one_broadcast_row_only_for_partial_rotaries_of_masked_lanes_and_several_heads(
        head_dim, rotary_dim, style, block_heads, num_warps, one_row):
    config = FusedKVConfig(8, head_dim, rotary_dim, style)
    assert kernel_module.loads_one_weight_row(config, block_heads, num_warps) is one_row
    _, constexprs, _, _ = kernel_module.tuned_plan(config, 4096, 2, 2, (None, block_heads, num_warps), False)
    assert constexprs[-2] is one_row  # what the launch is compiled with


@pytest.mark.parametrize("config", [FusedKVConfig(2, 64, 32, "neox"), FusedKVConfig(2, 80, 40, "gptj"),
                                    FusedKVConfig(2, 96, 24, "neox")], ids=["hd64", "hd80-gptj", "hd96-neox"])
@pytest.mark.parametrize("one_row", [False, True], ids=["weight-at-k-shape", "weight-as-one-row"])
def test_the_norm_weight_at_k_shape_and_as_one_row_give_the_reference(monkeypatch, config, one_row):
    monkeypatch.setattr(kernel_module, "loads_one_weight_row", lambda config, block_heads, num_warps: one_row)
    kernel_module._plan.cache_clear()
    try:
        inputs = random_inputs(config, n_layers=3, total_ctx=7, max_position=64, seed=config.head_dim)
        kv, *rest = on_device(inputs)
        k, v = poisoned(config.output_shape(3, 7), kv.dtype), poisoned(config.output_shape(3, 7), kv.dtype)
        launch(kv, *rest, k, v, config=config, block_tokens=4, block_heads=2, num_warps=2)
        assert_matches_reference(inputs, config, k, v)
    finally:
        kernel_module._plan.cache_clear()  # no plan of the forced form outlives the test


@pytest.mark.parametrize("head_dim", [96, 97])
@pytest.mark.parametrize("block_tokens, whole_rows", [(1, True), (8, False)])
def test_a_gptj_row_with_a_tail_is_right_loaded_as_pairs_throughout_and_in_pieces(head_dim, block_tokens,
                                                                                  whole_rows):
    # One-token tiles of one head give every multiprocessor 8 programs (rows loaded as pairs
    # throughout); eight-token tiles about one (a rotary piece and a tail).
    config = FusedKVConfig(2, head_dim, 24, "gptj")
    total_ctx = 4 * kernel_module._multiprocessors() + 3
    inputs = random_inputs(config, n_layers=1, total_ctx=total_ctx, max_position=4096, seed=head_dim)
    kv, *rest = on_device(inputs)
    _, constexprs, _, _ = kernel_module.tuned_plan(config, total_ctx, 1, kv.element_size(), (block_tokens, 1, 1),
                                                   False)
    assert constexprs[7] == (96 if whole_rows else 24)
    k, v = poisoned((1, total_ctx, 2, head_dim), kv.dtype), poisoned((1, total_ctx, 2, head_dim), kv.dtype)
    launch(kv, *rest, k, v, config=config, block_tokens=block_tokens, block_heads=1, num_warps=1)
    assert_matches_reference(inputs, config, k, v)


@pytest.mark.parametrize("total_ctx, tile", [(127, (2, 1)), (130, (1, 4)), (257, (2, 4))])
def test_decode_and_mid_size_contexts_on_their_default_tiles(total_ctx, tile):
    # Below 128 tokens two-token one-head tiles; between and beyond, tiles of about 8 head rows
    # (4 heads: 2 tokens); from 256 to 384 four times their tokens (4 heads: 8 tokens), halved
    # at 257 tokens of 5 layers, whose 165 programs would not give 132 multiprocessors two each;
    # both then take half their rows, their 325 and 330 programs under four a multiprocessor.
    # The GPU's tiles, launched by name: interpreted, a call's default is a few large tiles.
    # One layer: layers are a grid axis of their own, and the interpreter pays per program.
    config = FusedKVConfig(4, 64, 64, "gptj")
    block_tokens, block_heads, num_warps = kernel_module.default_tile(total_ctx, 4, 64, n_layers=5,
                                                                      multiprocessors=132)
    assert (block_tokens, block_heads) == tile
    inputs = random_inputs(config, n_layers=1, total_ctx=total_ctx, max_position=512, seed=4)
    kv, *rest = on_device(inputs)
    k, v = poisoned((1, total_ctx, 4, 64), kv.dtype), poisoned((1, total_ctx, 4, 64), kv.dtype)
    launch(kv, *rest, k, v, config=config, block_tokens=block_tokens,
           block_heads=block_heads, num_warps=num_warps)
    assert_matches_reference(inputs, config, k, v)


@pytest.mark.parametrize("total_ctx, heads, n_layers, tile", [
    (256, 2, 3, (1, 2, 1)),    # 16-token tiles would give 48 programs: halved three times to 384, then 768
    (1024, 1, 1, (2, 1, 1)),   # 8-token tiles would give 128 programs: halved twice to 512 (two rows stay)
    (256, 16, 5, (4, 8, 8)),   # 640 programs: the tile of its regime
    (4096, 2, 3, (4, 2, 2)),
])
def test_a_call_with_fewer_than_two_programs_a_multiprocessor_takes_smaller_tiles(total_ctx, heads, n_layers, tile):
    assert kernel_module.default_tile(total_ctx, heads, 128, n_layers=n_layers, multiprocessors=132) == tile


@pytest.mark.parametrize("heads, n_layers, head_dim, tile", [
    (32, 8, 256, (1, 1, 1)),   # g11 of the shape grid: 256 programs, one a head and layer
    (2, 5, 256, (1, 1, 1)),
    (1, 1, 80, (1, 1, 1)),
])
def test_a_call_of_one_token_takes_tiles_of_one_token(heads, n_layers, head_dim, tile):
    assert kernel_module.default_tile(1, heads, head_dim, n_layers=n_layers, multiprocessors=132) == tile
    assert kernel_module.default_tile(2, heads, head_dim, n_layers=n_layers, multiprocessors=132)[0] == 2


def test_an_empty_context_takes_the_short_context_tile():
    # An empty call (a model's warm-up) is planned on a GPU too before it returns its empty outputs.
    assert kernel_module.default_tile(0, 8, 128, n_layers=5, itemsize=2, multiprocessors=132) == (2, 1, 1)


@pytest.mark.parametrize("total_ctx, heads, n_layers, head_dim, tile", [
    (64, 16, 8, 128, (2, 2, 1)),   # 4096 one-head programs would give 132 multiprocessors 31 each
    (96, 16, 8, 128, (2, 4, 1)),   # 6144: doubled twice
    (96, 32, 8, 256, (2, 8, 4)),   # at most 8 heads, a warp per 1024 elements of K
    (64, 6, 16, 64, (2, 2, 1)),    # at most 2 heads: the largest power of two dividing 6
    (64, 16, 4, 128, (2, 1, 1)),   # 2048 programs: at most 16 a multiprocessor already
])
def test_a_short_context_with_more_than_sixteen_programs_a_multiprocessor_takes_more_heads(
        total_ctx, heads, n_layers, head_dim, tile):
    assert kernel_module.default_tile(total_ctx, heads, head_dim, n_layers=n_layers, multiprocessors=132) == tile


@pytest.mark.parametrize("total_ctx, heads, n_layers, head_dim, itemsize, tile", [
    (1024, 2, 1, 80, 4, (1, 2, 1)),    # g27 of the shape grid: 2x2x1 would give 512 programs, under 4 each of 132
    (256, 1, 8, 192, 2, (2, 1, 2)),    # g30: 4x1x2, 512 programs; the warps stay
    (256, 8, 1, 192, 2, (1, 4, 4)),    # g31: one token of 8 heads, 256 programs, so half the heads
    (256, 8, 5, 256, 2, (2, 8, 8)),    # g25: four-token tiles, 320 programs
    (256, 2, 2, 128, 4, (1, 2, 1)),    # g09: two rows already
    (256, 16, 5, 192, 2, (4, 8, 8)),   # g03: 640 programs, 4 or more each
    (1024, 1, 8, 64, 2, (8, 1, 1)),    # g10: 1024 programs
])
def test_a_tile_that_leaves_a_multiprocessor_fewer_than_four_programs_takes_half_its_rows_and_keeps_its_warps(
        total_ctx, heads, n_layers, head_dim, itemsize, tile):
    assert kernel_module.default_tile(total_ctx, heads, head_dim, n_layers=n_layers, itemsize=itemsize,
                                      multiprocessors=132) == tile


@pytest.mark.parametrize("total_ctx, heads, head_dim, itemsize, tile", [
    (4096, 8, 64, 2, (2, 8, 2)),    # rows of 128 bytes: 16 rows a tile, 16 elements a thread
    (4096, 4, 64, 2, (4, 4, 2)),
    (4096, 1, 64, 2, (16, 1, 2)),
    (1024, 1, 64, 2, (8, 1, 1)),    # 16 rows would leave 320 programs, under 8 a multiprocessor
    (4096, 8, 64, 4, (1, 8, 1)),    # rows of 256 bytes: 8 rows
    (4096, 8, 80, 2, (1, 8, 2)),    # 160 bytes: 8 rows
])
def test_tiles_of_rows_of_128_bytes_or_less_take_twice_the_rows_where_programs_remain(
        total_ctx, heads, head_dim, itemsize, tile):
    assert kernel_module.default_tile(total_ctx, heads, head_dim, n_layers=5, itemsize=itemsize,
                                      multiprocessors=132) == tile


def test_every_default_tile_is_one_the_kernel_takes():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        total_ctx = int(rng.choice([0, 1, 2, 7, 64, 100, 127, 128, 255, 256, 383, 384, 1000, 4096, 32768, 100_000]))
        heads = int(rng.integers(1, 65))
        head_dim = int(rng.choice([8, 64, 80, 96, 128, 192, 256, 512, 1024, 4096]))
        n_layers, itemsize = int(rng.integers(1, 65)), int(rng.choice([1, 2, 4]))
        multiprocessors = int(rng.choice([1, 8, 78, 132, 148]))
        tile = kernel_module.default_tile(total_ctx, heads, head_dim, n_layers=n_layers, itemsize=itemsize,
                                          multiprocessors=multiprocessors)
        block_tokens, block_heads, num_warps = tile
        assert all(value >= 1 and value & (value - 1) == 0 for value in tile), tile
        assert heads % block_heads == 0 and block_heads <= 8 and num_warps <= 8, (heads, tile)


@pytest.mark.skipif(kernel_module._launcher.interpreted, reason="interpreted, a plan takes the interpreter's tiles")
def test_the_launch_plan_takes_its_tile_from_the_element_size_of_kv():
    config = FusedKVConfig(8, 64, 32, "gptj")
    for itemsize, block_tokens in ((2, 2), (4, 1)):
        grid, constexprs, num_warps, _ = kernel_module.tuned_plan(config, 4096, 5, itemsize, (None, None, None),
                                                                  False)
        assert grid == 4096 // block_tokens * 5 and constexprs[5] == block_tokens


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("tile", [(2, 4, 1), (2, 8, 4)])
def test_short_context_tiles_of_several_heads_cover_a_ragged_context(style, tile):
    config = FusedKVConfig(8, 80, 40, style)
    inputs = random_inputs(config, n_layers=2, total_ctx=7, max_position=64, seed=5)
    kv, *rest = on_device(inputs)
    k, v = poisoned((2, 7, 8, 80), kv.dtype), poisoned((2, 7, 8, 80), kv.dtype)
    block_tokens, block_heads, num_warps = tile
    launch(kv, *rest, k, v, config=config, block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps)
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
    _, constexprs, _, _ = kernel_module._plan(REAL, 64, 5, 2, None, None, None, False)
    specializations = {}
    for _ in range(400):
        tensors = [None if rng.random() < 0.2 else buffer[int(rng.integers(0, 24)):] for _ in range(12)]
        plain_ints = [int(v) for v in rng.integers(1, 2**31, 4)]
        ints = [values[i] for i in rng.integers(0, len(values), 23)]
        addresses = [None if tensor is None else tensor.data_ptr() for tensor in tensors]
        _, specialization, _ = binder(*tensors, *plain_ints, *ints, *constexprs, num_warps=4)
        runtime = tuple(specialization[:39])
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


CONFIG = FusedKVConfig(2, 64, 32)
SHAPE = CONFIG.output_shape(2, 3)


def test_a_rejected_call_is_rejected_again_after_good_calls():
    # Validation is remembered per metadata for accepted calls only.
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=12)
    kv, *rest = on_device(inputs)
    k_out, v_out = poisoned(SHAPE, kv.dtype), poisoned(SHAPE, kv.dtype)
    message = "Invalid k_out shape for fused KV materialization: got (2, 2, 2, 64), expected (2, 3, 2, 64)."
    for _ in range(2):
        fused_kv_norm_rope(kv, *rest, **static(CONFIG), k_out=k_out, v_out=v_out)
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fused_kv_norm_rope(kv, *rest, **static(CONFIG), k_out=k_out[:, :2], v_out=v_out)


def bits(tensor):
    return as_numpy(tensor).tobytes()


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


OVERLAP_MESSAGE = "got a buffer overlapping {}, expected outputs that overlap neither each other nor kv."


def overlapping_outputs(case, kv):
    """``(k_out, v_out, message)``: outputs of the right shape, dtype and device that
    the kernel would write wrongly, and the error they must get."""
    n = SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3]
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


@pytest.mark.parametrize("case", ["partly shared", "one buffer in two storages", "k_out over kv", "expanded"])
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


def test_outputs_without_elements_pass_inside_kv_and_given_twice():
    kv = torch.zeros(3, 2, 32, dtype=torch.bfloat16)
    inside = kv.reshape(-1)[:0].view(0, 3, 2, 8)  # an empty view of kv's own storage
    empty = torch.empty(0, 3, 2, 8, dtype=torch.bfloat16)
    for k_out, v_out in ((inside, empty), (empty, empty), (empty, inside), (inside, inside)):
        spec_module.check_output_buffers(kv, (("k_out", k_out), ("v_out", v_out)))
    with pytest.raises(ValueError, match=re.escape("Invalid v_out for fused KV materialization: "
                                                   + OVERLAP_MESSAGE.format("kv"))):
        spec_module.check_output_buffers(kv, (("k_out", empty), ("v_out", kv.view(3, 2, 2, 16)[:2])))


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
        from interop.core.spec import FusedKVConfig

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


def test_a_cache_over_kv_is_refused_on_every_call_and_nothing_is_written():
    inputs, slots, poison, _ = cache_call(CONFIG, total_ctx=3, num_slots=5, seed=22)
    kv, *rest = on_device(inputs)
    cache_loc = to_torch(slots).to(DEVICE)
    # The same metadata with separate caches first: accepted, and remembered.
    fused_kv_norm_rope_into_cache(kv, *rest, cache_loc, *(to_torch(poison.copy()).to(DEVICE) for _ in range(2)),
                                  **static(CONFIG))
    k_cache = to_torch(poison.copy()).to(DEVICE)
    v_cache = kv.reshape(-1)[:poison.size].view(poison.shape)
    message = "Invalid v_cache for fused KV materialization: " + OVERLAP_MESSAGE.format("kv")
    before = [bits(buffer) for buffer in (kv, k_cache, v_cache)]
    for _ in range(2):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            fused_kv_norm_rope_into_cache(kv, *rest, cache_loc, k_cache, v_cache, **static(CONFIG))
    assert [bits(buffer) for buffer in (kv, k_cache, v_cache)] == before


# Under torch's transforms: torch.compile, meta and fake tensors, torch.func.

def transformed_call(entry_point, kv, weight, eps, cos_sin, positions, buffers, sizes):
    """One entry point as a function to transform: ``'allocated'`` outputs, ``'into
    given outputs'`` or ``'into a cache'`` (``buffers``: the given outputs or caches)."""
    if entry_point == "into a cache":
        return fused_kv_norm_rope_into_cache(kv, weight, eps, cos_sin, positions,
                                             torch.tensor([4, -1, 0], device=kv.device), *buffers, **sizes)
    outputs = dict(k_out=buffers[0], v_out=buffers[1]) if entry_point == "into given outputs" else {}
    return fused_kv_norm_rope(kv, weight, eps, cos_sin, positions, **sizes, **outputs)


ENTRY_POINTS = ["allocated", "into given outputs", "into a cache"]
CACHE_SHAPE = (2, 5, CONFIG.num_kv_heads, CONFIG.head_dim)


def buffers_for(entry_point, dtype, device=DEVICE):
    shape = CACHE_SHAPE if entry_point == "into a cache" else SHAPE
    return [poisoned(shape, dtype, device) for _ in range(2)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_a_refused_call_under_fullgraph_compile_raises_the_contracts_error(backend, entry_point):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=40)
    kv, weight, eps, cos_sin, positions = on_device(inputs)
    buffers = buffers_for(entry_point, kv.dtype)
    torch._dynamo.reset()
    step = torch.compile(functools.partial(transformed_call, entry_point, sizes=static(CONFIG)), fullgraph=True,
                         backend=backend)
    message = "Invalid stacked eps shape for fused KV materialization: got (3,), expected (2,)."
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        step(kv, weight, torch.ones(3), cos_sin, positions, buffers)
    assert all(torch.isnan(buffer).all() for buffer in buffers)
    # The good call after it compiles, again without a graph break.
    result = step(kv, weight, eps, cos_sin, positions, buffers)
    if entry_point == "into a cache":
        slots = np.array([4, -1, 0])
        poison = as_numpy(poisoned(CACHE_SHAPE, kv.dtype, "cpu"))
        expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
            *inputs.arrays(), slots, poison, poison, **static(CONFIG))
        assert_close(buffers[0], expected_k)
        assert_bit_exact(buffers[1], expected_v)
    else:
        assert_matches_reference(inputs, CONFIG, *result)


def test_a_size_refused_under_fullgraph_compile_raises_the_contracts_type_error():
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=41)
    torch._dynamo.reset()
    step = torch.compile(functools.partial(transformed_call, "allocated", buffers=None,
                                           sizes={**static(CONFIG), "num_kv_heads": 2.0}), fullgraph=True)
    with pytest.raises(TypeError, match="^" + re.escape(
            "Invalid num_kv_heads for fused KV materialization: got 2.0 (float), expected a positive int.") + "$"):
        step(*on_device(inputs))


@pytest.mark.parametrize("no_memory", ["meta", "fake"])
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_meta_and_fake_tensors_give_the_results_shapes_without_a_launch(monkeypatch, no_memory, entry_point):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=42)
    real = on_device(inputs)
    transformed_call(entry_point, *real, buffers_for(entry_point, real[0].dtype), static(CONFIG))
    launches = []  # after a real call of the same shapes, remembered
    monkeypatch.setattr(ops_module, "_launch", lambda *args: launches.append("direct"))
    monkeypatch.setattr(ops_module, "launch", lambda *args, **kwargs: launches.append("registered op"))
    mode = FakeTensorMode() if no_memory == "fake" else contextlib.nullcontext()
    with mode:
        kv, weight, eps, cos_sin, positions = (
            mode.from_tensor(tensor) if no_memory == "fake" else tensor.to("meta") for tensor in real)
        buffers = buffers_for(entry_point, kv.dtype, kv.device)
        k, v = transformed_call(entry_point, kv, weight, eps, cos_sin, positions, buffers, static(CONFIG))
        with pytest.raises(ValueError, match="^" + re.escape(
                "Invalid stacked eps shape for fused KV materialization: got (3,), expected (2,).") + "$"):
            transformed_call(entry_point, kv, weight, eps[:1].expand(3), cos_sin, positions, buffers,
                             static(CONFIG))
    assert launches == []
    if entry_point == "allocated":
        assert k.shape == v.shape == SHAPE
    else:
        assert k is buffers[0] and v is buffers[1]
    assert k.dtype == v.dtype == real[0].dtype and k.device == v.device == kv.device
    assert type(k) is type(kv)


@pytest.mark.parametrize("no_memory", ["meta", "fake"])
def test_check_positions_on_positions_without_values_is_refused(no_memory):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=43)
    real = on_device(inputs)
    mode = FakeTensorMode() if no_memory == "fake" else contextlib.nullcontext()
    with mode, pytest.raises(ValueError, match="^" + re.escape(
            "Invalid check_positions for fused KV materialization: got True on positions without values (meta "
            "or fake tensors), expected False there (out-of-range positions give all-NaN K rows).") + "$"):
        fused_kv_norm_rope(*(mode.from_tensor(t) if no_memory == "fake" else t.to("meta") for t in real),
                           **static(CONFIG), check_positions=True)


@pytest.mark.parametrize("entry_point, name", [("fused_kv_norm_rope", "kv"), ("fused_kv_norm_rope", "positions"),
                                               ("fused_kv_norm_rope_into_cache", "cache_loc")])
def test_vmap_is_refused_naming_the_argument_and_the_function(entry_point, name):
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=44)
    args = dict(zip(("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions"), on_device(inputs)))
    if entry_point == "fused_kv_norm_rope_into_cache":
        args.update(zip(("k_cache", "v_cache"), buffers_for("into a cache", args["kv"].dtype)),
                    cache_loc=torch.tensor([4, -1, 0], device=DEVICE))
    function = getattr(ops_module, entry_point)
    member = functools.partial(lambda batched, **rest: function(**{name: batched}, **rest, **static(CONFIG)),
                               **{key: value for key, value in args.items() if key != name})
    with pytest.raises(TypeError, match="^" + re.escape(
            f"Invalid {name} for fused KV materialization: got a tensor batched by torch.func.vmap, expected a "
            f"plain tensor (fusedkv_torch.{entry_point} has no rule for torch.func transforms: call it once per "
            "batch member, or fold the batch into total_ctx).") + "$"):
        torch.func.vmap(member)(torch.stack([args[name]] * 2))
    for buffer in (args.get("k_cache"), args.get("v_cache")):
        assert buffer is None or torch.isnan(buffer).all()


def test_a_call_on_plain_tensors_inside_vmap_runs():
    inputs = random_inputs(CONFIG, n_layers=2, total_ctx=3, max_position=16, seed=45)
    args = on_device(inputs)
    ones = torch.ones(2, dtype=args[0].dtype, device=DEVICE)
    k = torch.func.vmap(lambda one: fused_kv_norm_rope(*args, **static(CONFIG))[0] * one)(ones)
    expected_k, _ = fused_kv_norm_rope_reference(*inputs.arrays(), **static(CONFIG))
    assert_close(k[1], expected_k)


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
    kept = [launch for accepted in spec_module._ACCEPTED_CALLS.values() if "torch" in accepted.prepared
            for launch in accepted.prepared["torch"].compiled.values()]
    assert kept and all(isinstance(launch, Launch) for launch in kept)  # Triton's launcher, not compiled[grid]


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
    # The H200 is a Hopper GPU: its launches must use PDL.
    if "H200" not in torch.cuda.get_device_name():
        pytest.skip("pinned on an H200")
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


def test_the_kernel_compiles_for_the_gpu_in_every_form_a_call_takes(tmp_path):
    # The interpreter runs what the compiler refuses (a helper whose returns differ in type,
    # even in a branch it never generates): compile for Hopper here, without one.
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(root),
           "TRITON_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, str(root / "tests" / "compile_triton_kernel.py")], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
