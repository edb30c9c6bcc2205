"""What a row of ``fusedkv bench`` is: an :class:`Implementation` whose ``prepare`` turns a
:class:`~interop.bench.workload.Workload` into :class:`Calls` or :class:`Steps`, and the
pieces the op's rows share (poisoned outputs, the op called or stepped over every set).

``prepare`` raises :class:`NotApplicable` for a shape, dtype or token count the
implementation does not take; the row says so instead of a time.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from interop.bench.check import op_verdict
from interop.bench.workload import Workload


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
    given; ``kernel_target``: the step is kernels XLA cannot fuse into, custom calls whose
    target matches this regex, which the compiled jit must launch ``kernel_launches`` times
    per call (a forward and its backward: two); ``shift_inputs``:
    :func:`~interop.bench.timers.chained_calls`'s override of its rule (None keeps it);
    ``calls_bytes``: the bytes a call's time is estimated from to size a jit, where not
    ``bytes_moved`` (rows compared with each other run as many calls a jit);
    ``compiler_options``: ``(name, value)`` pairs of XLA options the jit is compiled with.
    """

    step: Callable
    fixed: object
    varying: list
    new_outputs: Callable[[], object]
    bytes_moved: int
    check: Callable[[object, int], str]
    fresh_outputs: bool = False
    kernel_target: str | None = None
    kernel_launches: int = 1
    shift_inputs: bool | None = None
    calls_bytes: int | None = None
    compiler_options: tuple = ()


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One row of the table per token count.

    ``framework``: whose arrays the caller holds and whose GPU it needs, ``"torch"``,
    ``"jax"``, or a crossing such as ``"jax->torch"`` (the caller's first); ``clock``:
    ``"device"`` or ``"host"``; ``baseline``: its time is a yardstick of the speed-up
    column; ``does_op``: it computes the op and nothing more, so a speed-up is shown;
    ``gemm``: the row timing the GEMM call this one makes, alone (the "x its GEMM" column);
    ``beside``: the row that makes the same call without this one's option (kind ``options``).
    """

    name: str
    framework: str
    kind: str
    prepare: Callable[[Workload], Calls | Steps]
    clock: str = "device"
    baseline: bool = False
    does_op: bool = True
    gemm: str = ""
    beside: str = ""

    @property
    def frameworks(self) -> tuple[str, ...]:
        return tuple(self.framework.split("->"))


def nan_pair(workload: Workload, framework: str, rows: int | None = None) -> tuple:
    """Poisoned ``(k, v)`` of the op's output shape, or of ``rows`` rows a layer (caches)."""
    shape = workload.shape.output_shape(workload.total_ctx if rows is None else rows)
    if framework == "torch":
        import torch

        return tuple(torch.full(shape, float("nan"), dtype=getattr(torch, workload.dtype),
                                device=workload.torch_device) for _ in range(2))
    import jax.numpy as jnp

    return tuple(jnp.full(shape, jnp.nan, jnp.dtype(workload.dtype)) for _ in range(2))


OP_ARRAYS = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions")


def with_options(op_args: tuple, options: dict) -> tuple[tuple, dict]:
    """``op_args`` with the arrays that ``options`` names replaced, and the other options (keywords)."""
    return (tuple(options.get(name, array) for name, array in zip(OP_ARRAYS, op_args)),
            {name: value for name, value in options.items() if name not in OP_ARRAYS})


def op_calls(workload: Workload, framework: str, function, *, given_outputs: bool, options: dict | None = None,
             v_exact: bool = True) -> Calls:
    """``function(*op_args)``, or with ``k_out``/``v_out`` of its own set, checked as the op.

    ``options``: the op's options by argument name (:func:`with_options`), given to the
    call and to the reference alike; ``v_exact``: see :func:`~interop.bench.check.verdict`.
    """
    shape = workload.shape
    op_bytes = shape.op_bytes(workload.total_ctx, workload.dtype)
    sets = workload.sets(op_bytes)
    split = [with_options(workload.op_args(i, framework), options or {}) for i in range(sets)]
    args, keywords = [arrays for arrays, _ in split], split[0][1]
    if given_outputs:
        outputs = [nan_pair(workload, framework) for _ in range(sets)]

        def call(i):
            return function(*args[i], k_out=outputs[i][0], v_out=outputs[i][1], **keywords)
    else:
        def call(i):
            return function(*args[i], **keywords)

    return Calls(call, sets, op_bytes, lambda: op_verdict(*call(0), *args[0], static=shape.static(),
                                                          options=keywords, v_exact=v_exact))


def op_steps(workload: Workload, step, *, fresh_outputs: bool = False, kernel_target: str | None = None) -> Steps:
    """A JAX step of the op over every input set, one poisoned output pair chained through
    (``fresh_outputs``: a step that allocates its own outputs instead; ``kernel_target``:
    see :class:`Steps`)."""
    shape = workload.shape
    sets = workload.sets(shape.kv_nbytes(workload.total_ctx, workload.dtype))
    return Steps(step, workload.shared("jax"), [workload.varying(i, "jax") for i in range(sets)],
                 lambda: nan_pair(workload, "jax"), shape.op_bytes(workload.total_ctx, workload.dtype),
                 lambda outputs, i: op_verdict(*outputs, *workload.op_args(i, "jax"), static=shape.static()),
                 fresh_outputs, kernel_target)
