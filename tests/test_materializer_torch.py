"""What only the torch materializer has: per-layer cache views of one pool, given outputs,
its reused workspace, and on a GPU real sizes and CUDA graphs.

What both materializers must do alike is ``test_contract_materializer.py``'s; as there,
the op's exactness is checked on the materializer's own GEMM output (``project``) and
the whole path against the fp32 NumPy path under END_TO_END_TOLERANCE. On a machine
without a GPU the Triton kernel runs in interpret mode (conftest.py).
"""

import dataclasses
import re

import numpy as np
import pytest
import torch

from fusedkv_torch.materializer import FusedKVMaterializer
from interop.core.arrays import as_numpy
from interop.exchange import to_torch
from interop.core.materializer import stacked_op_arrays
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_into_cache_reference
from interop.core.spec import FusedKVConfig
from interop.testing import assert_bit_exact, assert_close

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


def test_one_buffer_as_both_outputs_or_as_both_per_layer_lists_is_refused_untouched():
    setup = _setup(total_ctx=4)
    out = torch.full((3, 4, OP.num_kv_heads, OP.head_dim), POISON, dtype=torch.bfloat16, device=DEVICE)
    overlap = ("Invalid v_{} for fused KV materialization: got a buffer overlapping k_{}, expected outputs "
               "that overlap neither each other nor kv.")
    with pytest.raises(ValueError, match=f"^{re.escape(overlap.format('out', 'out'))}$"):
        setup.materializer.materialize(setup.ctx_hidden, setup.positions, k_out=out, v_out=out)
    cache = _poisoned_caches(setup)[0]
    layers = [cache[layer] for layer in range(3)]  # one pool given as both per-layer lists
    with pytest.raises(ValueError, match=f"^{re.escape(overlap.format('cache', 'cache'))}$"):
        setup.materializer.materialize_into_cache(setup.ctx_hidden, setup.positions, _slots(0, 1, 2, 3),
                                                  layers, layers)
    assert bool((out == POISON).all()) and bool((cache == POISON).all())


@pytest.mark.parametrize("max_tokens, error, message", [
    (-1, ValueError, "got -1, expected a non-negative int."),
    (True, TypeError, "got True (bool), expected a non-negative int."),
    (2.5, TypeError, "got 2.5 (float), expected a non-negative int."),
    ("4", TypeError, "got '4' (str), expected a non-negative int."),
    (None, TypeError, "got None (NoneType), expected a non-negative int."),
], ids=["negative", "bool", "float", "str", "None"])
def test_reserve_refuses_a_token_bound_that_is_not_a_non_negative_int_and_allocates_nothing(
        max_tokens, error, message):
    setup = _setup(total_ctx=4)
    workspace = setup.materializer.project(setup.ctx_hidden).data_ptr()
    with pytest.raises(error, match=f"^{re.escape('Invalid max_tokens for fused KV materialization: ' + message)}$"):
        setup.materializer.reserve(max_tokens, staging=True)
    assert setup.materializer.project(setup.ctx_hidden).data_ptr() == workspace


def test_reserve_of_zero_tokens_is_the_empty_context_bound_and_keeps_the_workspace():
    setup = _setup(total_ctx=4)
    workspace = setup.materializer.project(setup.ctx_hidden).data_ptr()
    setup.materializer.reserve(0)
    assert setup.materializer.project(setup.ctx_hidden).data_ptr() == workspace
    k, v = setup.materializer.materialize(setup.ctx_hidden[:0], setup.positions[:0])
    assert k.shape == v.shape == (3, 0, OP.num_kv_heads, OP.head_dim)


@pytest.mark.parametrize("field", ["kv_proj_weight", "k_norm_weight"])
def test_a_layer_on_the_meta_device_is_refused_naming_it(field):
    case = random_case(OP, n_layers=2, hidden=64, total_ctx=0, max_position=256)
    layers = [dataclasses.replace(layer, kv_proj_weight=_device(layer.kv_proj_weight),
                                  k_norm_weight=_device(layer.k_norm_weight)) for layer in case.layers]
    layers[1] = dataclasses.replace(layers[1], **{field: getattr(layers[1], field).to("meta")})
    with pytest.raises(ValueError, match="^" + re.escape(
            f"Invalid layers[1].{field} for fused KV materialization: got a tensor on the meta device (a "
            "shape without data), expected one holding the layer's weights.") + "$"):
        FusedKVMaterializer(layers)


# --- on a GPU: CUDA graphs (real sizes on every path: the contract suite) ---------------------

REAL_OP = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128)


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
