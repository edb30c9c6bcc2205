"""Every implementation ``fusedkv bench`` measures: its name, framework, kind, and how to call it.

Kinds:

* ``kernel``: ours, the Triton kernel (torch) and the Pallas kernel (jax) on each of its
  lowerings: ``pallas`` on Triton (the default), ``pallas-mosaic`` on Mosaic GPU;
* ``baseline``: the op as a model author would write it (eager PyTorch, ``torch.compile``,
  jnp under ``jax.jit``); the fastest is the speed-up column's yardstick;
* ``copy``: a device copy of the op's bytes in the same framework, the ceiling;
* ``floor``: the Pallas kernel's data movement alone, in its own form
  (:mod:`interop.bench.floors`): ``pallas-floor`` copies K and V unchanged,
  ``pallas-floor-cos-sin`` also loads the cos/sin rows;
* ``materializer``: the materializers' GEMM alone, and the GEMM and the op end to end;
* ``interop``: the backend-neutral call, in one framework and crossing between them;
* ``host``: an eager call, timed on the host (host dispatch, not device time).

A ``prepare`` function takes a :class:`~interop.bench.workload.Workload` and returns
:class:`Calls` (torch's device rows and every host row: ``call(i)`` on input set ``i``)
or :class:`Steps` (JAX's device rows, run many to a jit), each with its bytes and its
check, or raises :class:`NotApplicable` for a shape, dtype or token count the
implementation does not take (the row says so instead of a time). Another variant is one
more entry: a Pallas tile, for instance, is ``functools.partial(_pallas, block_tokens=...)``
under a name of its own::

    Implementation("pallas-bt4", "jax", "kernel", functools.partial(_pallas, lowering="triton", block_tokens=4))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from interop.core.arrays import numpy_dtype
from interop.bench.baselines import jnp_reference_math, torch_reference_math
from interop.bench.check import copy_verdict, end_to_end_verdict, op_verdict, projection_verdict
from interop.bench.shapes import MAX_POSITION, BenchShape
from interop.bench.workload import Workload
from interop.exchange import to_torch
from interop.testing import random_case

KINDS = ("kernel", "baseline", "copy", "floor", "materializer", "interop", "host")
# The custom call jax lowers a Mosaic GPU kernel to (jax 0.10-0.11).
MOSAIC_GPU_TARGET = "mosaic_gpu_v2"


class NotApplicable(Exception):
    """Raised by a ``prepare`` for what its implementation does not take; the message says what."""


@dataclasses.dataclass(frozen=True)
class Calls:
    """An implementation called once per ``call(i)`` on input set ``i`` (of ``sets``).

    ``check()`` makes one call on poisoned outputs and returns its verdict.
    """

    call: Callable[[int], object]
    sets: int
    bytes_moved: int
    check: Callable[[], str]


@dataclasses.dataclass(frozen=True)
class Steps:
    """A JAX implementation as ``step(fixed, varying, outputs) -> outputs``, for
    :func:`interop.bench.timers.chained_calls` to run many to a jit.

    ``varying`` holds one tuple per input set; ``new_outputs()`` makes poisoned outputs;
    ``check(outputs, index)`` judges the outputs of a call on set ``index``;
    ``fresh_outputs``: the step allocates its outputs instead of writing the ones it is
    given; ``kernel_target``: the step is one kernel XLA cannot fuse into, a custom call
    of this target, which the compiled jit must launch once per call (both as
    :func:`~interop.bench.timers.chained_calls` describes).
    """

    step: Callable
    fixed: object
    varying: list
    new_outputs: Callable[[], object]
    bytes_moved: int
    check: Callable[[object, int], str]
    fresh_outputs: bool = False
    kernel_target: str | None = None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One row of the table per token count.

    ``framework``: whose arrays the caller holds and whose GPU it needs, ``"torch"``,
    ``"jax"``, or a crossing such as ``"jax->torch"`` (the caller's first); ``clock``:
    ``"device"`` or ``"host"``; ``baseline``: its time is a yardstick of the speed-up
    column; ``does_op``: it computes the op and nothing more, so a speed-up is shown.
    """

    name: str
    framework: str
    kind: str
    prepare: Callable[[Workload], Calls | Steps]
    clock: str = "device"
    baseline: bool = False
    does_op: bool = True

    @property
    def frameworks(self) -> tuple[str, ...]:
        return tuple(self.framework.split("->"))


def _nan_pair(workload: Workload, framework: str) -> tuple:
    """Poisoned ``(k_out, v_out)`` for one call."""
    shape = workload.shape.output_shape(workload.total_ctx)
    if framework == "torch":
        import torch

        return tuple(torch.full(shape, float("nan"), dtype=getattr(torch, workload.dtype),
                                device=workload.torch_device) for _ in range(2))
    import jax.numpy as jnp

    return tuple(jnp.full(shape, jnp.nan, jnp.dtype(workload.dtype)) for _ in range(2))


def _op_calls(workload: Workload, framework: str, function, *, given_outputs: bool) -> Calls:
    """``function(*op_args)``, or with ``k_out``/``v_out`` of its own set, checked as the op."""
    shape = workload.shape
    op_bytes = shape.op_bytes(workload.total_ctx, workload.dtype)
    sets = workload.sets(op_bytes)
    args = [workload.op_args(i, framework) for i in range(sets)]
    if given_outputs:
        outputs = [_nan_pair(workload, framework) for _ in range(sets)]

        def call(i):
            return function(*args[i], k_out=outputs[i][0], v_out=outputs[i][1])
    else:
        def call(i):
            return function(*args[i])

    return Calls(call, sets, op_bytes, lambda: op_verdict(*call(0), *args[0], static=shape.static()))


def _op_steps(workload: Workload, step, *, fresh_outputs: bool = False, kernel_target: str | None = None) -> Steps:
    """A JAX step of the op over every input set, one poisoned output pair chained through
    (``fresh_outputs``: a step that allocates its own outputs instead; ``kernel_target``:
    see :class:`Steps`)."""
    shape = workload.shape
    sets = workload.sets(shape.kv_nbytes(workload.total_ctx, workload.dtype))
    return Steps(step, workload.shared("jax"), [workload.varying(i, "jax") for i in range(sets)],
                 lambda: _nan_pair(workload, "jax"), shape.op_bytes(workload.total_ctx, workload.dtype),
                 lambda outputs, i: op_verdict(*outputs, *workload.op_args(i, "jax"), static=shape.static()),
                 fresh_outputs, kernel_target)


def _triton(workload: Workload) -> Calls:
    from fusedkv_torch import fused_kv_norm_rope

    return _op_calls(workload, "torch", functools.partial(fused_kv_norm_rope, **workload.shape.static()),
                     given_outputs=True)


def _pallas(workload: Workload, **options) -> Steps:
    """The Pallas kernel writing into the outputs it is given (donated through the chain);
    ``options`` reach ``fusedkv_jax.fused_kv_norm_rope`` (tiles, a lowering)."""
    from fusedkv_jax import fused_kv_norm_rope

    static = workload.shape.static()

    def step(fixed, varying, outputs):
        kv, positions = varying
        return fused_kv_norm_rope(kv, *fixed, positions, **static, k_out=outputs[0], v_out=outputs[1], **options)

    return _op_steps(workload, step)


def _pallas_mosaic(workload: Workload) -> Steps:
    """The Pallas kernel on its Mosaic GPU lowering, whose outputs are fresh arrays (it
    writes no ``k_out``/``v_out`` in place): chained as XLA's own computations are, its
    inputs unshifted (:func:`~interop.bench.timers.chained_calls`)."""
    from fusedkv_jax import fused_kv_norm_rope, mosaic_kernel

    shape, total_ctx = workload.shape, workload.total_ctx
    config = shape.config
    if not mosaic_kernel.supports(config, workload.dtype):
        raise NotApplicable(f"no Mosaic GPU kernel for {workload.dtype} {config.rope_style}, "
                            f"head_dim {config.head_dim}, rotary {config.rotary_dim}")
    interpret = all(device.platform == "cpu" for device in workload.varying(0, "jax")[0].devices())
    if not mosaic_kernel.supports_context(total_ctx, interpret=interpret):
        raise NotApplicable(f"Mosaic GPU's interpreter takes multiples of {mosaic_kernel.BLOCK_TOKENS} tokens"
                            if interpret else "Mosaic GPU takes at most 8 tokens or a multiple of 8")
    static = shape.static()

    def step(fixed, varying, outputs):
        kv, positions = varying
        return fused_kv_norm_rope(kv, *fixed, positions, **static, lowering="mosaic_gpu")

    # Interpreted, the kernel is no custom call but ordinary XLA work, which takes the shift.
    return _op_steps(workload, step, fresh_outputs=True, kernel_target=None if interpret else MOSAIC_GPU_TARGET)


def _pallas_eager(workload: Workload) -> Calls:
    from fusedkv_jax import fused_kv_norm_rope

    return _op_calls(workload, "jax", functools.partial(fused_kv_norm_rope, **workload.shape.static()),
                     given_outputs=False)


def _torch_eager(workload: Workload) -> Calls:
    return _op_calls(workload, "torch", functools.partial(torch_reference_math, config=workload.shape.config),
                     given_outputs=False)


@functools.cache
def _compiled_torch_math():
    """``torch.compile`` of the baseline, one for the whole run so sizes share compilations."""
    import torch

    # Three shapes and token counts of 1, 2 and more each compile their own graph: more
    # than dynamo's default limit, past which it would silently run the eager code.
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
            break
    return torch.compile(torch_reference_math)


def _torch_compile(workload: Workload) -> Calls:
    return _op_calls(workload, "torch", functools.partial(_compiled_torch_math(), config=workload.shape.config),
                     given_outputs=False)


def _jnp_steps(workload: Workload) -> Steps:
    config = workload.shape.config

    def step(fixed, varying, outputs):
        kv, positions = varying
        return jnp_reference_math(kv, *fixed, positions, config=config)

    return _op_steps(workload, step, fresh_outputs=True)


def _jnp_eager(workload: Workload) -> Calls:
    import jax

    jitted = jax.jit(functools.partial(jnp_reference_math, config=workload.shape.config))
    return _op_calls(workload, "jax", jitted, given_outputs=False)


def _pallas_floor(workload: Workload, *, cos_sin: bool) -> Steps:
    """:func:`interop.bench.floors.copy` over every input set, checked as a copy of K and V."""
    from interop.bench import floors

    config = workload.shape.config
    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def step(fixed, varying, outputs):
        kv, positions = varying
        return tuple(floors.copy(kv, fixed[2], positions, *outputs, **static, rotary_dim=config.rotary_dim,
                                 cos_sin=cos_sin))

    steps = _op_steps(workload, step)
    return dataclasses.replace(steps, check=lambda outputs, i: floors.copy_verdict(
        outputs, workload.varying(i, "jax")[0], **static))


def _torch_copy(workload: Workload) -> Calls:
    """``copy_`` of ``kv`` into a buffer of its size: the op's bytes, read and written."""
    import torch

    op_bytes = workload.shape.op_bytes(workload.total_ctx, workload.dtype)
    sets = workload.sets(op_bytes)
    sources = [workload.varying(i, "torch")[0] for i in range(sets)]
    destinations = [torch.full_like(source, float("nan")) for source in sources]

    def call(i):
        return destinations[i].copy_(sources[i])

    return Calls(call, sets, op_bytes, lambda: copy_verdict(call(0), sources[0]))


def _xla_copy(workload: Workload) -> Steps:
    """XLA's elementwise pass over ``kv`` (a negation: a copy would be elided), the op's bytes."""
    import jax.numpy as jnp

    kv_shape = workload.shape.kv_shape(workload.total_ctx)
    sets = workload.sets(workload.shape.kv_nbytes(workload.total_ctx, workload.dtype))

    def step(fixed, varying, outputs):
        return -varying[0]

    return Steps(step, (), [workload.varying(i, "jax") for i in range(sets)],
                 lambda: jnp.full(kv_shape, jnp.nan, jnp.dtype(workload.dtype)),
                 workload.shape.op_bytes(workload.total_ctx, workload.dtype),
                 lambda outputs, i: copy_verdict(outputs, workload.varying(i, "jax")[0], negated=True),
                 fresh_outputs=True)


@functools.cache
def _materializer_case(shape: BenchShape, dtype: str):
    return random_case(shape.config, n_layers=shape.n_layers, hidden=shape.hidden, total_ctx=0,
                       max_position=MAX_POSITION, dtype=dtype)


@functools.cache
def _torch_materializer(shape: BenchShape, dtype: str, device: str):
    from fusedkv_torch.materializer import FusedKVMaterializer

    layers = [dataclasses.replace(layer, kv_proj_weight=to_torch(layer.kv_proj_weight).to(device),
                                  k_norm_weight=to_torch(layer.k_norm_weight).to(device))
              for layer in _materializer_case(shape, dtype).layers]
    return FusedKVMaterializer(layers)


@functools.cache
def _jax_materializer(shape: BenchShape, dtype: str):
    from fusedkv_jax.materializer import FusedKVMaterializer

    return FusedKVMaterializer(_materializer_case(shape, dtype).layers)


def _materializer_bytes(workload: Workload) -> tuple[int, int]:
    """(GEMM, GEMM and op) bytes that no design of the two steps can avoid."""
    gemm = workload.shape.gemm_bytes(workload.total_ctx, workload.dtype)
    return gemm, gemm + workload.shape.op_bytes(workload.total_ctx, workload.dtype)


def _hidden_sets(workload: Workload, outputs_per_set: int) -> int:
    """Input sets of a materializer that reads ``ctx_hidden``, writes and reads ``kv``, and
    writes ``outputs_per_set`` more arrays of kv's size per set."""
    shape, total_ctx, dtype = workload.shape, workload.total_ctx, workload.dtype
    hidden_bytes = total_ctx * shape.hidden * numpy_dtype(dtype).itemsize
    return workload.sets(hidden_bytes + (1 + outputs_per_set) * shape.kv_nbytes(total_ctx, dtype))


def _torch_gemm(workload: Workload) -> Calls:
    materializer = _torch_materializer(workload.shape, workload.dtype, workload.torch_device)
    materializer.reserve(workload.total_ctx)
    sets = _hidden_sets(workload, 0)
    hidden = [workload.hidden(i, "torch") for i in range(sets)]

    def call(i):
        return materializer.project(hidden[i])

    def check():
        call(0).fill_(float("nan"))
        return projection_verdict(call(0), hidden[0], _materializer_case(workload.shape, workload.dtype).layers)

    return Calls(call, sets, _materializer_bytes(workload)[0], check)


def _torch_materializer_calls(workload: Workload) -> Calls:
    materializer = _torch_materializer(workload.shape, workload.dtype, workload.torch_device)
    materializer.reserve(workload.total_ctx)
    sets = _hidden_sets(workload, 2)
    hidden = [workload.hidden(i, "torch") for i in range(sets)]
    positions = [workload.varying(i, "torch")[1] for i in range(sets)]
    outputs = [_nan_pair(workload, "torch") for _ in range(sets)]

    def call(i):
        return materializer.materialize(hidden[i], positions[i], k_out=outputs[i][0], v_out=outputs[i][1])

    def check():
        k, v = call(0)
        return op_verdict(k, v, materializer.project(hidden[0]), materializer.k_norm_weight, materializer.eps,
                          materializer.cos_sin_cache, positions[0], static=workload.shape.static())

    return Calls(call, sets, _materializer_bytes(workload)[1], check)


def _jax_materializer_check(workload: Workload, materializer, outputs, index: int) -> str:
    """The end-to-end outputs against the materializer's fp32 NumPy path."""
    return end_to_end_verdict(*outputs, _materializer_case(workload.shape, workload.dtype).layers,
                              workload.hidden(index, "jax"), workload.varying(index, "jax")[1])


def _jax_gemm(workload: Workload) -> Steps:
    import jax.numpy as jnp

    sets = _hidden_sets(workload, 0)
    kv_shape = workload.shape.kv_shape(workload.total_ctx)
    layers = _materializer_case(workload.shape, workload.dtype).layers

    def step(materializer, varying, outputs):
        return materializer.project(varying[0])

    return Steps(step, _jax_materializer(workload.shape, workload.dtype),
                 [(workload.hidden(i, "jax"),) for i in range(sets)],
                 lambda: jnp.full(kv_shape, jnp.nan, jnp.dtype(workload.dtype)), _materializer_bytes(workload)[0],
                 lambda outputs, i: projection_verdict(outputs, workload.hidden(i, "jax"), layers),
                 fresh_outputs=True)


def _jax_materializer_steps(workload: Workload) -> Steps:
    sets = _hidden_sets(workload, 0)
    materializer = _jax_materializer(workload.shape, workload.dtype)

    def step(materializer, varying, outputs):
        return materializer.materialize(*varying)

    return Steps(step, materializer,
                 [(workload.hidden(i, "jax"), workload.varying(i, "jax")[1]) for i in range(sets)],
                 lambda: _nan_pair(workload, "jax"), _materializer_bytes(workload)[1],
                 functools.partial(_jax_materializer_check, workload, materializer), fresh_outputs=True)


def _jax_materializer_eager(workload: Workload) -> Calls:
    sets = _hidden_sets(workload, 2)
    materializer = _jax_materializer(workload.shape, workload.dtype)
    inputs = [(workload.hidden(i, "jax"), workload.varying(i, "jax")[1]) for i in range(sets)]

    def call(i):
        return materializer.materialize(*inputs[i])

    return Calls(call, sets, _materializer_bytes(workload)[1],
                 lambda: _jax_materializer_check(workload, materializer, call(0), 0))


def _interop(workload: Workload, *, caller: str, backend: str) -> Calls:
    """``interop.fused_kv_norm_rope`` on the caller's arrays, run by ``backend``."""
    from interop import dispatch

    return _op_calls(workload, caller, functools.partial(dispatch.fused_kv_norm_rope, **workload.shape.static(),
                                                         backend=backend), given_outputs=False)


IMPLEMENTATIONS = (
    Implementation("triton", "torch", "kernel", _triton),
    Implementation("pallas", "jax", "kernel", functools.partial(_pallas, lowering="triton")),
    Implementation("pallas-mosaic", "jax", "kernel", _pallas_mosaic),
    Implementation("torch-eager", "torch", "baseline", _torch_eager, baseline=True),
    Implementation("torch-compile", "torch", "baseline", _torch_compile, baseline=True),
    Implementation("jnp-jit", "jax", "baseline", _jnp_steps, baseline=True),
    Implementation("torch-copy", "torch", "copy", _torch_copy, does_op=False),
    Implementation("pallas-floor", "jax", "floor", functools.partial(_pallas_floor, cos_sin=False), does_op=False),
    Implementation("pallas-floor-cos-sin", "jax", "floor", functools.partial(_pallas_floor, cos_sin=True),
                   does_op=False),
    Implementation("xla-copy", "jax", "copy", _xla_copy, does_op=False),
    Implementation("torch-gemm", "torch", "materializer", _torch_gemm, does_op=False),
    Implementation("torch-materializer", "torch", "materializer", _torch_materializer_calls, does_op=False),
    Implementation("jax-gemm", "jax", "materializer", _jax_gemm, does_op=False),
    Implementation("jax-materializer", "jax", "materializer", _jax_materializer_steps, does_op=False),
    Implementation("interop-torch", "torch", "interop",
                   functools.partial(_interop, caller="torch", backend="torch"), clock="host"),
    Implementation("interop-jax", "jax", "interop",
                   functools.partial(_interop, caller="jax", backend="jax"), clock="host"),
    Implementation("interop-jax-to-torch", "jax->torch", "interop",
                   functools.partial(_interop, caller="jax", backend="torch"), clock="host"),
    Implementation("interop-torch-to-jax", "torch->jax", "interop",
                   functools.partial(_interop, caller="torch", backend="jax"), clock="host"),
    Implementation("triton-host", "torch", "host", _triton, clock="host"),
    Implementation("pallas-host", "jax", "host", _pallas_eager, clock="host"),
    Implementation("torch-eager-host", "torch", "host", _torch_eager, clock="host", baseline=True),
    Implementation("torch-compile-host", "torch", "host", _torch_compile, clock="host", baseline=True),
    Implementation("jnp-jit-host", "jax", "host", _jnp_eager, clock="host", baseline=True),
    Implementation("torch-materializer-host", "torch", "host", _torch_materializer_calls, clock="host",
                   does_op=False),
    Implementation("jax-materializer-host", "jax", "host", _jax_materializer_eager, clock="host", does_op=False),
)
BY_NAME = {implementation.name: implementation for implementation in IMPLEMENTATIONS}
COPIES = {implementation.framework: implementation for implementation in IMPLEMENTATIONS
          if implementation.kind == "copy"}


def unknown_words(words: list[str]) -> list[str]:
    """The words that name neither an implementation nor a kind."""
    return [word for word in words if word not in BY_NAME and word not in KINDS]


def select(words: list[str] | None, frameworks_on_gpu) -> tuple[list[Implementation], list[Implementation]]:
    """The implementations to run, in table order, and those skipped because a framework they
    need sees no GPU.

    ``words``: names and kinds (``None``: all). The copy of each framework with a device
    row is always added: the fraction-of-copy column needs it. Unknown words raise
    ``ValueError`` naming them.
    """
    if words is None:
        chosen = set(BY_NAME)
    else:
        unknown = unknown_words(words)
        if unknown:
            raise ValueError(f"unknown implementations or kinds {unknown}, expected some of "
                             f"{list(BY_NAME)} or kinds {list(KINDS)}")
        chosen = {name for name, implementation in BY_NAME.items()
                  if name in words or implementation.kind in words}

    def runs(implementation: Implementation) -> bool:
        return set(implementation.frameworks) <= set(frameworks_on_gpu)

    for implementation in IMPLEMENTATIONS:
        if implementation.name in chosen and implementation.clock == "device" and runs(implementation):
            chosen.add(COPIES[implementation.framework].name)
    selected = [implementation for implementation in IMPLEMENTATIONS if implementation.name in chosen]
    return ([implementation for implementation in selected if runs(implementation)],
            [implementation for implementation in selected if not runs(implementation)])
