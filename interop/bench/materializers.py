"""The materializers' rows: the GEMM each one runs, alone, and the materializer end to end.

A materializer's time is read against its own GEMM ("x its GEMM"), so its GEMM row
times the very call the materializer makes, on the same arguments:
``FusedKVMaterializer.project``, which in torch is the ``torch.mm`` into the
materializer's own workspace that ``materialize`` fills, and in JAX the jitted
projection that ``materialize`` inlines. Every row of a framework's family rotates over
the same input sets (``ctx_hidden``, positions, cache slots: as many as the largest
working set of the family takes to pass the L2), and JAX's rows run as many calls a jit
and feed ``ctx_hidden`` to the GEMM the same way. A GEMM is compute-bound: these rows
get no bandwidth, only their time and its ratio to the GEMM's.

Rows, per framework:

* ``*-gemm``: the GEMM alone;
* ``*-materializer``: ``materialize`` (torch: into given outputs);
* ``*-materializer-cache``: ``materialize_into_cache``, every layer's K and V to
  distinct random slots of paged caches of twice the tokens;
* ``torch-reference-flow``: the flow the materializer replaces: the GEMM, the op into a
  temporary ``[n_layers, total_ctx, heads, head_dim]`` pair, then per layer
  ``k_cache[layer][slots] = k[layer]`` and the same for V.

With ``fp8=True`` (the ``*-gemm-fp8`` and ``*-materializer-fp8`` rows, of kind ``options``) the
materializer's weights are the workload's bf16 weights quantized per output row to
float8_e4m3fn (:func:`interop.testing.fp8_layers`), checked under
:data:`~interop.testing.FP8_GEMM_TOLERANCE`: on FP8 tensor cores the GEMM quantizes its
activations too.
"""

from __future__ import annotations

import dataclasses
import functools

from interop.bench.check import end_to_end_verdict, op_verdict, projection_verdict
from interop.bench.rows import Calls, NotApplicable, Steps, nan_pair
from interop.bench.shapes import MAX_POSITION, BenchShape
from interop.bench.workload import Workload
from interop.core.arrays import numpy_dtype
from interop.exchange import to_torch
from interop.testing import END_TO_END_TOLERANCE, FP8_GEMM_TOLERANCE, fp8_layers, random_case


@functools.cache
def materializer_case(shape: BenchShape, dtype: str):
    return random_case(shape.config, n_layers=shape.n_layers, hidden=shape.hidden, total_ctx=0,
                       max_position=MAX_POSITION, dtype=dtype)


@functools.cache
def host_layers(shape: BenchShape, dtype: str, fp8: bool = False) -> tuple:
    """The case's layers, their weights quantized per output row to FP8 with ``fp8``."""
    layers = materializer_case(shape, dtype).layers
    return fp8_layers(layers) if fp8 else tuple(layers)


@functools.cache
def torch_materializer(shape: BenchShape, dtype: str, device: str, fp8: bool = False):
    from fusedkv_torch.materializer import FusedKVMaterializer

    def on_device(array):
        return None if array is None else to_torch(array).to(device)

    layers = [dataclasses.replace(layer, kv_proj_weight=on_device(layer.kv_proj_weight),
                                  k_norm_weight=on_device(layer.k_norm_weight),
                                  weight_scale=on_device(layer.weight_scale))
              for layer in host_layers(shape, dtype, fp8)]
    return FusedKVMaterializer(layers)


@functools.cache
def jax_materializer(shape: BenchShape, dtype: str, fp8: bool = False):
    from fusedkv_jax.materializer import FusedKVMaterializer

    return FusedKVMaterializer(host_layers(shape, dtype, fp8))


def _layers(workload: Workload, fp8: bool = False):
    return host_layers(workload.shape, workload.dtype, fp8)


def _tolerance(fp8: bool):
    return FP8_GEMM_TOLERANCE if fp8 else END_TO_END_TOLERANCE


def _check_fp8(workload: Workload, fp8: bool) -> None:
    if fp8 and workload.dtype != "bfloat16":
        raise NotApplicable(f"FP8 weights give bfloat16 K and V, not {workload.dtype}")


def _bytes(workload: Workload) -> tuple[int, int]:
    """(GEMM, GEMM and op) bytes that no design of the two steps can avoid."""
    gemm = workload.shape.gemm_bytes(workload.total_ctx, workload.dtype)
    return gemm, gemm + workload.shape.op_bytes(workload.total_ctx, workload.dtype)


def family_sets(workload: Workload) -> int:
    """Input sets of every materializer row: enough for a call that reads ``ctx_hidden``,
    writes and reads ``kv`` and writes two more arrays of its size."""
    shape, total_ctx, dtype = workload.shape, workload.total_ctx, workload.dtype
    hidden_bytes = total_ctx * shape.hidden * numpy_dtype(dtype).itemsize
    return workload.sets(hidden_bytes + 3 * shape.kv_nbytes(total_ctx, dtype))


def _torch_family(workload: Workload, fp8: bool = False):
    """The torch materializer (workspace reserved; ``fp8``: of FP8 weights), the family's
    sets, and their ``ctx_hidden``, positions and slots."""
    _check_fp8(workload, fp8)
    materializer = torch_materializer(workload.shape, workload.dtype, workload.torch_device, fp8)
    materializer.reserve(workload.total_ctx)
    sets = family_sets(workload)
    return (materializer, sets, [workload.hidden(i, "torch") for i in range(sets)],
            [workload.varying(i, "torch")[1] for i in range(sets)], [workload.slots(i, "torch") for i in range(sets)])


def torch_gemm(workload: Workload, *, fp8: bool = False) -> Calls:
    materializer, sets, hidden, _, _ = _torch_family(workload, fp8)

    def call(i):
        return materializer.project(hidden[i])

    def check():
        call(0).fill_(float("nan"))
        return projection_verdict(call(0), hidden[0], _layers(workload, fp8), tolerance=_tolerance(fp8))

    return Calls(call, sets, _bytes(workload)[0], check)


def torch_materialize(workload: Workload, *, fp8: bool = False) -> Calls:
    materializer, sets, hidden, positions, _ = _torch_family(workload, fp8)
    outputs = [nan_pair(workload, "torch") for _ in range(sets)]

    def call(i):
        return materializer.materialize(hidden[i], positions[i], k_out=outputs[i][0], v_out=outputs[i][1])

    def check():
        k, v = call(0)
        return op_verdict(k, v, materializer.project(hidden[0]), materializer.k_norm_weight, materializer.eps,
                          materializer.cos_sin_cache, positions[0], static=workload.shape.static())

    return Calls(call, sets, _bytes(workload)[1], check)


def torch_materialize_into_cache(workload: Workload) -> Calls:
    materializer, sets, hidden, positions, slots = _torch_family(workload)
    caches = nan_pair(workload, "torch", rows=workload.num_slots)

    def call(i):
        return materializer.materialize_into_cache(hidden[i], positions[i], slots[i], *caches)

    def check():
        return end_to_end_verdict(*call(0), _layers(workload), hidden[0], positions[0], slots=slots[0])

    return Calls(call, sets, _bytes(workload)[1], check)


def torch_reference_flow(workload: Workload) -> Calls:
    """The GEMM, the op into a temporary, then one indexed write a layer for K and for V."""
    from fusedkv_torch import fused_kv_norm_rope

    materializer, sets, hidden, positions, slots = _torch_family(workload)
    k_cache, v_cache = nan_pair(workload, "torch", rows=workload.num_slots)
    op_arrays = (materializer.k_norm_weight, materializer.eps, materializer.cos_sin_cache)
    static = workload.shape.static()

    def call(i):
        k, v = fused_kv_norm_rope(materializer.project(hidden[i]), *op_arrays, positions[i], **static)
        for layer in range(workload.shape.n_layers):
            k_cache[layer][slots[i]] = k[layer]
            v_cache[layer][slots[i]] = v[layer]
        return k_cache, v_cache

    def check():
        return end_to_end_verdict(*call(0), _layers(workload), hidden[0], positions[0], slots=slots[0])

    return Calls(call, sets, _bytes(workload)[1], check)


def _jax_steps(workload: Workload, step, varying: list, new_outputs, bytes_moved: int, check, *,
               fresh_outputs: bool, fp8: bool = False) -> Steps:
    """A JAX row of the family: the materializer fixed (``fp8``: of FP8 weights), ``ctx_hidden``
    shifted by the chain's zero in every row, and as many calls a jit as the end-to-end row."""
    _check_fp8(workload, fp8)
    return Steps(step, jax_materializer(workload.shape, workload.dtype, fp8), varying, new_outputs, bytes_moved,
                 check, fresh_outputs=fresh_outputs, shift_inputs=True, calls_bytes=_bytes(workload)[1])


def _jax_inputs(workload: Workload, *, slots: bool = False) -> list:
    return [(workload.hidden(i, "jax"), workload.varying(i, "jax")[1], *([workload.slots(i, "jax")] if slots else []))
            for i in range(family_sets(workload))]


def jax_gemm(workload: Workload, *, fp8: bool = False) -> Steps:
    import jax.numpy as jnp

    kv_shape = workload.shape.kv_shape(workload.total_ctx)

    def step(materializer, varying, outputs):
        return materializer.project(varying[0])

    def check(outputs, i):
        return projection_verdict(outputs, workload.hidden(i, "jax"), _layers(workload, fp8), tolerance=_tolerance(fp8))

    return _jax_steps(workload, step, _jax_inputs(workload),
                      lambda: jnp.full(kv_shape, jnp.nan, jnp.dtype(workload.dtype)), _bytes(workload)[0], check,
                      fresh_outputs=True, fp8=fp8)


def _jax_check(workload: Workload, outputs, index: int, *, slots: bool = False, fp8: bool = False) -> str:
    """The end-to-end outputs (or caches) of a call on set ``index`` against the
    materializer's fp32 NumPy path."""
    return end_to_end_verdict(*outputs, _layers(workload, fp8), workload.hidden(index, "jax"),
                              workload.varying(index, "jax")[1],
                              slots=workload.slots(index, "jax") if slots else None, tolerance=_tolerance(fp8))


def jax_materialize(workload: Workload, *, fp8: bool = False) -> Steps:
    def step(materializer, varying, outputs):
        return materializer.materialize(*varying)

    return _jax_steps(workload, step, _jax_inputs(workload), lambda: nan_pair(workload, "jax"), _bytes(workload)[1],
                      functools.partial(_jax_check, workload, fp8=fp8), fresh_outputs=True, fp8=fp8)


def jax_materialize_into_cache(workload: Workload) -> Steps:
    """``materialize_into_cache`` chained through its caches, which each call updates in place."""
    def step(materializer, varying, outputs):
        return materializer.materialize_into_cache(*varying, *outputs)

    return _jax_steps(workload, step, _jax_inputs(workload, slots=True),
                      lambda: nan_pair(workload, "jax", rows=workload.num_slots), _bytes(workload)[1],
                      functools.partial(_jax_check, workload, slots=True), fresh_outputs=False)


def jax_materialize_eager(workload: Workload) -> Calls:
    materializer = jax_materializer(workload.shape, workload.dtype)
    inputs = _jax_inputs(workload)

    def call(i):
        return materializer.materialize(*inputs[i])

    return Calls(call, len(inputs), _bytes(workload)[1], lambda: _jax_check(workload, call(0), 0))
