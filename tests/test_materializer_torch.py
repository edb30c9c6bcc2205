"""The torch materializer against the interop reference: three result paths, caches, workspace.

The op's exactness is checked on the materializer's own GEMM output (``project``),
since torch may round its bf16 GEMM differently from NumPy's fp32 one; the whole path
is checked against the fp32 NumPy path under the looser END_TO_END_TOLERANCE.
On a machine without a GPU the Triton kernel runs in interpret mode (conftest.py).
"""

import dataclasses
import re

import numpy as np
import pytest
import torch

from fusedkv_torch.materializer import FusedKVMaterializer
from interop.arrays import as_numpy
from interop.exchange import to_torch
from interop.materializer_spec import random_case, stacked_op_arrays
from interop.reference import (
    fused_kv_norm_rope_into_cache_reference,
    fused_kv_norm_rope_reference,
    rope_cos_sin_cache,
)
from interop.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, assert_bit_exact, assert_close, assert_fp8_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP = FusedKVConfig(num_kv_heads=2, head_dim=32, rotary_dim=32)
NUM_SLOTS = 12
POISON = -3.5  # exactly representable in bf16 and fp8, and not a value the op writes here

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _device(array) -> torch.Tensor:
    return to_torch(np.ascontiguousarray(array)).to(DEVICE, copy=True)


@dataclasses.dataclass
class Setup:
    case: object
    materializer: FusedKVMaterializer
    ctx_hidden: torch.Tensor
    positions: torch.Tensor

    @property
    def config(self):
        return self.materializer.config


def _setup(op=OP, *, n_layers=3, hidden=64, total_ctx=8, position_dtype="int32", seed=0,
           dtype="bfloat16", **materializer_options) -> Setup:
    case = random_case(op, n_layers=n_layers, hidden=hidden, total_ctx=total_ctx, max_position=256,
                       dtype=dtype, position_dtype=position_dtype, seed=seed)
    layers = [dataclasses.replace(layer, kv_proj_weight=_device(layer.kv_proj_weight),
                                  k_norm_weight=_device(layer.k_norm_weight))
              for layer in case.layers]
    return Setup(case, FusedKVMaterializer(layers, **materializer_options),
                 _device(case.ctx_hidden), _device(case.positions))


def _poisoned_caches(setup, dtype=None, num_slots=NUM_SLOTS):
    shape = (setup.config.n_layers, num_slots, setup.config.op.num_kv_heads, setup.config.op.head_dim)
    dtype = dtype or setup.materializer.kv_proj_weight.dtype
    return (torch.full(shape, POISON, device=DEVICE).to(dtype),
            torch.full(shape, POISON, device=DEVICE).to(dtype))


def _slots(*values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


CASES = [
    # (op, n_layers, total_ctx, position dtype): the common shape, then the odd ones.
    (OP, 3, 8, "int32"),
    (FusedKVConfig(num_kv_heads=1, head_dim=96, rotary_dim=32, rope_style="gptj"), 1, 1, "int64"),
    (FusedKVConfig(num_kv_heads=3, head_dim=16, rotary_dim=8), 2, 5, "int64"),
]


@pytest.mark.parametrize("op, n_layers, total_ctx, position_dtype", CASES)
def test_returned_kv_is_the_op_on_the_materializers_own_gemm(op, n_layers, total_ctx, position_dtype):
    setup = _setup(op, n_layers=n_layers, total_ctx=total_ctx, position_dtype=position_dtype)
    kv = setup.materializer.project(setup.ctx_hidden).clone()
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = setup.case.op_reference(kv)
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
        expected = setup.ctx_hidden @ _device(layer_kv.kv_proj_weight).t()
        assert_bit_exact(kv[:, layer], expected, name=f"kv of layer {layer}")


def test_callback_gets_every_layer_in_order_with_the_returned_values():
    setup = _setup(total_ctx=5, seed=1)
    received = []
    setup.materializer.materialize_layers(
        setup.ctx_hidden, setup.positions,
        lambda layer, k, v: received.append((layer, k.clone(), v.clone())))
    kv = setup.materializer.project(setup.ctx_hidden)
    k_expected, v_expected = setup.case.op_reference(kv)
    assert [layer for layer, _, _ in received] == [0, 1, 2]
    for layer, k, v in received:
        assert k.shape == v.shape == (5, OP.num_kv_heads, OP.head_dim)
        assert_close(k, k_expected[layer], name=f"k of layer {layer}")
        assert_bit_exact(v, v_expected[layer], name=f"v of layer {layer}")


def test_into_cache_writes_each_tokens_slot_and_leaves_every_other_slot_untouched():
    setup = _setup(total_ctx=6, seed=2)
    k_cache, v_cache = _poisoned_caches(setup)
    k_before, v_before = as_numpy(k_cache).copy(), as_numpy(v_cache).copy()
    # Two padding slots, one past the end; written slots are distinct.
    cache_loc = _slots(7, -1, 0, NUM_SLOTS, 11, -5)
    result = setup.materializer.materialize_into_cache(
        setup.ctx_hidden, setup.positions, cache_loc, k_cache, v_cache)
    assert result[0] is k_cache and result[1] is v_cache
    kv = setup.materializer.project(setup.ctx_hidden)
    k_expected, v_expected = setup.case.op_reference(
        kv, cache_loc=cache_loc, k_cache=k_before, v_cache=v_before)
    assert_close(k_cache, k_expected)
    assert_bit_exact(v_cache, v_expected)
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in (7, 0, 11)]
    assert_bit_exact(as_numpy(k_cache)[:, untouched], k_before[:, untouched], name="k padding")
    assert_bit_exact(as_numpy(v_cache)[:, untouched], v_before[:, untouched], name="v padding")
    assert (as_numpy(k_cache)[:, [7, 0, 11]].astype(np.float32) != POISON).any()


def test_per_layer_views_of_one_pool_are_written_in_place():
    setup = _setup(total_ctx=4, seed=4)
    # K and V of a layer side by side in one pool: the layer stride is twice a cache's size.
    pool = torch.full((3, 2, NUM_SLOTS, OP.num_kv_heads, OP.head_dim), POISON, device=DEVICE,
                      dtype=torch.bfloat16)
    before = as_numpy(pool).copy()
    cache_loc = _slots(3, 9, -1, 0)
    k_layers, v_layers = [pool[layer, 0] for layer in range(3)], [pool[layer, 1] for layer in range(3)]
    result = setup.materializer.materialize_into_cache(
        setup.ctx_hidden, setup.positions, cache_loc, k_layers, v_layers)
    assert result == (k_layers, v_layers)
    kv = setup.materializer.project(setup.ctx_hidden)
    k_expected, v_expected = setup.case.op_reference(
        kv, cache_loc=cache_loc, k_cache=before[:, 0], v_cache=before[:, 1])
    assert_close(pool[:, 0], k_expected)
    assert_bit_exact(pool[:, 1], v_expected)


@pytest.mark.parametrize("layout", ["separate allocations", "uneven layer stride", "no layers"])
def test_per_layer_caches_that_are_not_one_pool_are_refused_untouched(layout):
    setup = _setup(total_ctx=2)
    shape = (NUM_SLOTS, OP.num_kv_heads, OP.head_dim)
    if layout == "separate allocations":
        k_layers = [torch.full(shape, POISON, dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
    elif layout == "uneven layer stride":
        pool = torch.full((4, *shape), POISON, dtype=torch.bfloat16, device=DEVICE)
        k_layers = [pool[0], pool[1], pool[3]]
    else:
        k_layers = []
    v_cache = _poisoned_caches(setup)[1]
    with pytest.raises(ValueError, match=r"^Invalid k_cache for fused KV materialization: got "
                                         r"per-layer caches that are not views of one buffer"):
        setup.materializer.materialize_into_cache(
            setup.ctx_hidden, setup.positions, _slots(0, 1), k_layers, v_cache)
    for cache in (*k_layers, v_cache):
        assert bool((cache == POISON).all())


# Per-layer scales from 0.01 to 1 with random mantissas: a round scale (a power of two, or
# a short decimal) divides bf16 values into exact fp8 ties, which Triton's interpreter
# rounds away from zero (the GPU, like the reference, to even).
K_SCALE, V_SCALE = (2.0 ** np.random.default_rng(8).uniform(-6.6, 0, (2, 3))).astype(np.float32).tolist()


def test_fp8_cache_is_quantized_with_per_layer_scales():
    setup = _setup(total_ctx=5, seed=5)
    k_cache, v_cache = _poisoned_caches(setup, dtype=torch.float8_e4m3fn)
    k_before, v_before = as_numpy(k_cache).copy(), as_numpy(v_cache).copy()
    k_scale = torch.tensor(K_SCALE, device=DEVICE)
    v_scale = torch.tensor(V_SCALE, device=DEVICE)
    cache_loc = _slots(2, -1, 5, 8, 10)
    setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, cache_loc,
                                              k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
    kv = setup.materializer.project(setup.ctx_hidden)
    k_expected, v_expected = setup.case.op_reference(
        kv, cache_loc=cache_loc, k_cache=k_before, v_cache=v_before,
        k_scale=as_numpy(k_scale), v_scale=as_numpy(v_scale))
    assert_fp8_close(k_cache, k_expected, triton_interpreter=DEVICE == "cpu")
    assert_fp8_close(v_cache, v_expected, name="v", triton_interpreter=DEVICE == "cpu")


@pytest.mark.parametrize("fp8_cache", ["k", "v"])
def test_mixed_caches_quantize_only_the_fp8_one_with_its_scale(fp8_cache):
    setup = _setup(total_ctx=5, seed=6)
    bf16_k, bf16_v = _poisoned_caches(setup)
    fp8_k, fp8_v = _poisoned_caches(setup, dtype=torch.float8_e4m3fn)
    k_cache, v_cache = (fp8_k, bf16_v) if fp8_cache == "k" else (bf16_k, fp8_v)
    k_before, v_before = as_numpy(k_cache).copy(), as_numpy(v_cache).copy()
    scales = {f"{fp8_cache}_scale": torch.tensor(K_SCALE if fp8_cache == "k" else V_SCALE, device=DEVICE)}
    cache_loc = _slots(2, -1, 5, 8, 10)
    setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, cache_loc,
                                              k_cache, v_cache, **scales)
    kv = setup.materializer.project(setup.ctx_hidden)
    k_expected, v_expected = setup.case.op_reference(
        kv, cache_loc=cache_loc, k_cache=k_before, v_cache=v_before,
        **{name: as_numpy(scale) for name, scale in scales.items()})
    if fp8_cache == "k":
        assert_fp8_close(k_cache, k_expected, triton_interpreter=DEVICE == "cpu")
        assert_bit_exact(v_cache, v_expected, name="v")
    else:
        assert_close(k_cache, k_expected)
        assert_fp8_close(v_cache, v_expected, name="v", triton_interpreter=DEVICE == "cpu")


def test_a_layer_mismatch_is_refused_naming_the_layer():
    case = random_case(OP, n_layers=3, hidden=64, total_ctx=0)
    layers = [dataclasses.replace(layer, kv_proj_weight=_device(layer.kv_proj_weight),
                                  k_norm_weight=_device(layer.k_norm_weight)) for layer in case.layers]
    layers[1] = dataclasses.replace(layers[1], head_dim=64)
    with pytest.raises(ValueError, match=r"^Invalid fused KV materializer layer 1: head_dim got "
                                         r"64, expected 32 as in layer 0\.$"):
        FusedKVMaterializer(layers)


def test_workspace_is_reused_across_calls_and_grown_when_too_small():
    setup = _setup(total_ctx=8)
    materializer, hidden = setup.materializer, setup.ctx_hidden
    first = materializer.project(hidden[:6]).data_ptr()
    assert materializer.project(hidden).data_ptr() != first  # 8 tokens do not fit in 6
    grown = materializer.project(hidden).data_ptr()
    materializer.materialize(hidden[:3], setup.positions[:3])
    assert materializer.project(hidden[:5]).data_ptr() == grown
    materializer.reserve(32)
    reserved = materializer.project(hidden).data_ptr()
    assert reserved != grown
    materializer.materialize_into_cache(hidden, setup.positions, _slots(*range(8)),
                                        *_poisoned_caches(setup))
    assert materializer.project(hidden[:1]).data_ptr() == reserved


def test_a_rejected_call_leaves_the_caches_untouched():
    setup = _setup(total_ctx=4)
    k_cache, v_cache = _poisoned_caches(setup)
    bad_slots = torch.zeros(4, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match=r"^Invalid cache_loc dtype"):
        setup.materializer.materialize_into_cache(
            setup.ctx_hidden, setup.positions, bad_slots, k_cache, v_cache)
    with pytest.raises(ValueError, match=r"^Invalid ctx_hidden shape"):
        setup.materializer.materialize_into_cache(
            setup.ctx_hidden[:, :32], setup.positions, _slots(0, 1, 2, 3), k_cache, v_cache)
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())



def test_one_buffer_as_both_outputs_or_both_caches_is_refused_untouched():
    setup = _setup(total_ctx=4)
    out = torch.full((3, 4, OP.num_kv_heads, OP.head_dim), POISON, dtype=torch.bfloat16, device=DEVICE)
    overlap = ("Invalid v_{} for fused KV materialization: got a buffer overlapping k_{}, expected outputs "
               "that overlap neither each other nor kv.")
    with pytest.raises(ValueError, match=f"^{re.escape(overlap.format('out', 'out'))}$"):
        setup.materializer.materialize(setup.ctx_hidden, setup.positions, k_out=out, v_out=out)
    cache = _poisoned_caches(setup)[0]
    with pytest.raises(ValueError, match=f"^{re.escape(overlap.format('cache', 'cache'))}$"):
        setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, _slots(0, 1, 2, 3),
                                                  cache, cache)
    layers = [cache[layer] for layer in range(3)]  # one pool given as both per-layer lists
    with pytest.raises(ValueError, match=f"^{re.escape(overlap.format('cache', 'cache'))}$"):
        setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, _slots(0, 1, 2, 3),
                                                  layers, layers)
    assert bool((out == POISON).all()) and bool((cache == POISON).all())


@pytest.mark.parametrize("name", ["ctx_hidden", "positions"])
def test_numpy_arguments_are_refused_with_a_pointer_to_interop(name):
    setup = _setup(total_ctx=4)
    args = dict(ctx_hidden=setup.ctx_hidden, positions=setup.positions)
    args[name] = as_numpy(args[name])
    k_cache, v_cache = _poisoned_caches(setup)
    message = (f"Invalid {name} for fused KV materialization: got numpy.ndarray, expected a torch.Tensor "
               "(fusedkv_torch takes torch tensors; interop.fused_kv_norm_rope takes arrays of any framework).")
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        setup.materializer.materialize_into_cache(args["ctx_hidden"], args["positions"], _slots(0, 1, 2, 3),
                                                  k_cache, v_cache)
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())


def test_out_of_range_positions_give_nan_k_rows_and_a_too_high_bound_is_refused():
    setup = _setup(total_ctx=4)
    positions = torch.tensor([0, 256, -1, 255], dtype=torch.int32, device=DEVICE)
    k, _ = setup.materializer.materialize(setup.ctx_hidden, positions, max_position=256)
    k = as_numpy(k).astype(np.float32)
    assert np.isnan(k[:, [1, 2]]).all() and not np.isnan(k[:, [0, 3]]).any()
    with pytest.raises(ValueError, match=r"^Invalid max_position for fused KV materialization: "
                                         r"got 257, expected at most 256"):
        setup.materializer.materialize(setup.ctx_hidden, positions, max_position=257)


def test_an_empty_context_returns_empty_outputs_and_leaves_the_caches():
    setup = _setup(total_ctx=0)
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    assert k.shape == v.shape == (3, 0, OP.num_kv_heads, OP.head_dim)
    k_cache, v_cache = _poisoned_caches(setup)
    setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions,
                                              _slots(), k_cache, v_cache)
    assert bool((k_cache == POISON).all()) and bool((v_cache == POISON).all())


def test_hidden_states_are_cast_once_to_the_weight_dtype():
    setup = _setup(total_ctx=3)
    k_bf16, v_bf16 = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_fp32, v_fp32 = setup.materializer.materialize(setup.ctx_hidden.float(), setup.positions)
    assert k_fp32.dtype == torch.bfloat16
    assert_bit_exact(k_fp32, k_bf16, name="k")
    assert_bit_exact(v_fp32, v_bf16)


def test_a_given_cos_sin_cache_replaces_the_built_table_and_fp32_weights_work():
    table = rope_cos_sin_cache(256, OP.rotary_dim, base=500.0)
    setup = _setup(total_ctx=4, dtype="float32", cos_sin_cache=_device(table))
    kv = setup.materializer.project(setup.ctx_hidden).clone()
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = fused_kv_norm_rope_reference(
        kv, *stacked_op_arrays(setup.case.layers, table), setup.positions, **setup.config.op_kwargs())
    assert k.dtype == torch.float32
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)


# --- on the H200: real sizes, CUDA graphs ----------------------------------------------------

REAL_OP = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128)


@gpu
@needs_cuda
def test_gpu_real_sizes_match_the_reference_on_every_path():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=512, seed=7)
    kv = setup.materializer.project(setup.ctx_hidden).clone()
    k, v = setup.materializer.materialize(setup.ctx_hidden, setup.positions)
    k_expected, v_expected = setup.case.op_reference(kv)
    assert_close(k, k_expected)
    assert_bit_exact(v, v_expected)
    k_e2e, v_e2e = setup.case.end_to_end_reference()
    assert_close(k, k_e2e, tolerance=END_TO_END_TOLERANCE)
    assert_close(v, v_e2e, name="v", tolerance=END_TO_END_TOLERANCE)
    k_cache, v_cache = _poisoned_caches(setup, num_slots=4096)
    k_before, v_before = as_numpy(k_cache).copy(), as_numpy(v_cache).copy()
    cache_loc = torch.randperm(4096, device=DEVICE)[:512]
    cache_loc[::7] = -1
    setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, cache_loc,
                                              k_cache, v_cache)
    k_expected, v_expected = setup.case.op_reference(kv, cache_loc=cache_loc, k_cache=k_before,
                                                v_cache=v_before)
    assert_close(k_cache, k_expected)
    assert_bit_exact(v_cache, v_expected)


def _capture(call):
    """Warm ``call`` up on a side stream (Triton compiles, cuBLAS gets that stream's
    workspace), then capture it there; returns the graph and the allocations ``call``
    made while captured, each as its size and the innermost Python frames that asked
    for it. (Capture itself allocates the RNG state of the generators used before it;
    that is not the call's.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.memory._record_memory_history(stacks="python")
    try:
        with torch.cuda.graph(graph, stream=stream):
            count = torch.cuda.memory_stats()["allocation.all.allocated"]
            call()
            count = torch.cuda.memory_stats()["allocation.all.allocated"] - count
        traces = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocations = [
        f"{trace['size']} bytes from " + " < ".join(
            f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
            for frame in trace["frames"][:4])
        for trace in traces
        if trace["action"] == "alloc"
        and not any(frame["filename"].endswith("cuda/graphs.py") for frame in trace["frames"])
    ]
    if len(allocations) != count:
        allocations.append(f"({count} allocations counted by the allocator)")
    return graph, allocations


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay_scatters_new_inputs_into_the_cache():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=64, seed=8)
    other = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=64, seed=9)
    materializer = setup.materializer
    materializer.reserve(64)
    hidden, positions = setup.ctx_hidden.clone(), setup.positions.clone()
    cache_loc = torch.randperm(1024, device=DEVICE)[:64]
    k_cache, v_cache = _poisoned_caches(setup, num_slots=1024)
    graph, allocations = _capture(lambda: materializer.materialize_into_cache(
        hidden, positions, cache_loc, k_cache, v_cache))
    assert allocations == []
    k_cache.fill_(POISON)
    v_cache.fill_(POISON)
    k_before, v_before = as_numpy(k_cache).copy(), as_numpy(v_cache).copy()
    hidden.copy_(other.ctx_hidden)
    positions.copy_(other.positions)
    cache_loc[:8] = -1
    graph.replay()
    torch.cuda.synchronize()
    kv = materializer.project(hidden)
    k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(
        kv, *stacked_op_arrays(setup.case.layers), positions, cache_loc, k_before, v_before,
        **setup.config.op_kwargs())
    assert_close(k_cache, k_expected)
    assert_bit_exact(v_cache, v_expected)


@gpu
@needs_cuda
def test_gpu_cuda_graph_capture_of_the_callback_path_allocates_nothing():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=16, seed=10)
    materializer = setup.materializer
    materializer.reserve(16, staging=True)
    k_sink, v_sink = _poisoned_caches(setup, num_slots=16)

    def write_layer_kv(layer, k, v):
        k_sink[layer].copy_(k)
        v_sink[layer].copy_(v)

    graph, allocations = _capture(lambda: materializer.materialize_layers(
        setup.ctx_hidden, setup.positions, write_layer_kv))
    assert allocations == []
    k_sink.fill_(POISON)
    v_sink.fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    k_expected, v_expected = setup.case.op_reference(materializer.project(setup.ctx_hidden))
    assert_close(k_sink, k_expected)
    assert_bit_exact(v_sink, v_expected)


@gpu
@needs_cuda
def test_gpu_capture_refuses_to_grow_the_workspace():
    setup = _setup(REAL_OP, n_layers=5, hidden=4096, total_ctx=16, seed=11)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"call reserve\(\) with enough tokens before CUDA-graph"):
        with torch.cuda.graph(graph):
            setup.materializer.materialize(setup.ctx_hidden, setup.positions)
