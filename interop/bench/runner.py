"""The run: every (shape, token count, implementation), checked, then timed, behind a progress bar.

For each shape and token count one :class:`~interop.bench.workload.Workload` is drawn
and every implementation measured on it in table order. An implementation is first
called on poisoned outputs and checked (:mod:`interop.bench.check`); one that fails is
recorded with its verdict and never timed, one that does not take the shape, dtype or
token count (:class:`~interop.bench.rows.NotApplicable`) is recorded as ``n/a`` and
why, and one that raises is recorded with its error (the traceback goes to
``on_error``) while the run goes on. With ``rounds`` above one, every row of a size is
checked first and then timed once a round, the rows' order reversed every other round,
so that drift over the run (clocks, temperature) falls on every row alike; a row's time
is the median of its rounds. The rows of a size are then held ready together, inputs,
outputs and compiled jits.

Timers by row: torch on the device, CUDA-graph replay
(:func:`~interop.bench.timers.graph_replay_seconds`, ``Effort.graph_ms`` of calls a
graph); host rows, a loop of eager calls, only up to
:data:`~interop.bench.shapes.DECODE_TOKENS` tokens; JAX on the device, the in-jit method
(:func:`~interop.bench.timers.in_jit_seconds`), with as many calls in one jit as
:func:`calls_per_jit` takes from the bytes a call moves.

Calls per jit: the device must take longer over one jit's calls than the host takes to
dispatch the next jit, or the figure is the host's ("host-bound" in the method column,
an upper bound). So a jit holds about :data:`JIT_DEVICE_SECONDS` of device work: a call
is estimated at its bytes over :data:`ESTIMATED_BYTES_PER_SECOND`, and at least
:data:`CALL_FLOOR_SECONDS` for each kernel it launches (:func:`kernels_per_call`: XLA's
unfused math is many kernels a call, each as short as a launch allows), and a jit holds
that work over the estimate in calls,
between :data:`MIN_CALLS_PER_JIT` and ``Effort.max_calls_per_jit`` (512, or
``--max-calls-per-jit``); the method column gives the calls and the device time they
were estimated at. The calls are unrolled: a loop (``lax.scan``) would hand the kernel
slices of stacked input sets, which XLA materializes before a custom call. So compiling
takes longer the more calls there are, hence the cap. Steps with fresh outputs return
every call's outputs, host work at each dispatch, so where their calls are shortest
they may stay host-bound.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import re
import statistics
import time
import traceback
from typing import Callable

from interop.bench.rows import Implementation, NotApplicable, Steps
from interop.bench.report import Measurement
from interop.bench.shapes import DECODE_TOKENS, BenchShape
from interop.bench.timers import chained_calls, graph_replay_seconds, host_seconds_per_call, in_jit_seconds
from interop.bench.workload import Workload

JIT_DEVICE_SECONDS = 1e-3
# Below a large GPU's copy bandwidth, so that estimates err toward more calls.
ESTIMATED_BYTES_PER_SECOND = 3e12
# About the shortest call in a jit: a kernel of a few programs, launched.
CALL_FLOOR_SECONDS = 1.5e-6
MIN_CALLS_PER_JIT = 8


@dataclasses.dataclass(frozen=True)
class Effort:
    """How long each timer samples, and how many calls one jit may hold (module docstring)."""

    graph_ms: float = 20
    jax_repeats: int = 7
    jax_batch_seconds: float = 0.02
    host_calls: int = 500
    host_repeats: int = 5
    max_calls_per_jit: int = 512


FULL = Effort()
QUICK = Effort(graph_ms=10, jax_repeats=5, jax_batch_seconds=0.01, host_calls=200, host_repeats=3)


def plan(shapes: list[BenchShape], tokens: list[int],
         implementations: list[Implementation]) -> list[tuple[BenchShape, int, Implementation]]:
    """Every row to measure, in table order; host rows only at decode sizes."""
    return [(shape, total_ctx, implementation) for shape in shapes for total_ctx in tokens
            for implementation in implementations
            if implementation.clock == "device" or total_ctx <= DECODE_TOKENS]


def estimated_call_seconds(bytes_moved: int, kernels: int = 1) -> float:
    """A call's device time as :func:`calls_per_jit` estimates it (module docstring)."""
    return max(kernels * CALL_FLOOR_SECONDS, bytes_moved / ESTIMATED_BYTES_PER_SECOND)


def calls_per_jit(bytes_moved: int, *, most: int, kernels: int = 1) -> int:
    """Calls of ``bytes_moved`` and ``kernels`` launches each in one jit: about
    :data:`JIT_DEVICE_SECONDS` of device work by :func:`estimated_call_seconds`, at least
    :data:`MIN_CALLS_PER_JIT`, at most ``most``."""
    wanted = math.ceil(JIT_DEVICE_SECONDS / estimated_call_seconds(bytes_moved, kernels))
    return min(most, max(MIN_CALLS_PER_JIT, wanted))


def _wait_for(implementation: Implementation) -> Callable[[object], None]:
    """What a host loop waits on at its end: jax's outputs, and all of torch's device work."""
    frameworks = implementation.frameworks

    def wait(outputs):
        if frameworks[0] == "jax":
            import jax

            jax.block_until_ready(outputs)
        if "torch" in frameworks:
            import torch

            torch.cuda.synchronize()
    return wait


def _zeros(calls: int):
    import jax.numpy as jnp

    return jnp.zeros(calls, jnp.float32)


def _launches(run, arguments, target: str) -> int:
    """How many times the compiled ``run`` launches a custom call whose name matches ``target`` (a regex)."""
    return len(re.findall(f'custom_call_target="(?:{target})"', run.lower(*arguments).compile().as_text()))


def kernels_per_call(prepared: Steps) -> int:
    """The kernels a call of ``prepared`` launches: its custom calls' ``kernel_launches``; for
    XLA's own computations (fresh outputs), the fusions and custom calls of a jit of one call
    as XLA compiles it; else one. Rows sized by ``calls_bytes`` to match another count one,
    as that other row does."""
    if prepared.kernel_target is not None:
        return prepared.kernel_launches
    if not prepared.fresh_outputs or prepared.calls_bytes is not None:
        return 1
    import jax

    run = chained_calls(prepared.step, 1, len(prepared.varying), fresh_outputs=True,
                        shift_inputs=prepared.shift_inputs, compiler_options=prepared.compiler_options)
    # The outputs' shapes alone: compiling needs no second set of them on the device.
    outputs = jax.eval_shape(prepared.new_outputs)
    compiled = run.lower(prepared.fixed, prepared.varying, outputs, _zeros(1)).compile()
    return max(1, len(re.findall(r"\b(?:fusion|custom-call)\(", compiled.as_text())))


def jit_calls(prepared: Steps, effort: Effort, kernels: int) -> int:
    """The calls one jit of ``prepared`` holds: :func:`calls_per_jit` of its ``calls_bytes``
    (or, where not given, the bytes it moves) and ``kernels`` launches a call."""
    return calls_per_jit(prepared.calls_bytes or prepared.bytes_moved, most=effort.max_calls_per_jit,
                         kernels=kernels)


# A row's timer: one timing, (seconds per call, whether the host set the pace).
Timer = Callable[[], tuple]


def _ready_in_jit(prepared: Steps, effort: Effort) -> tuple[dict, Timer | None]:
    """The check of a JAX step, and its in-jit timer (None where the check failed)."""
    sets = len(prepared.varying)
    kernels = kernels_per_call(prepared)
    calls = jit_calls(prepared, effort, kernels)
    estimate = calls * estimated_call_seconds(prepared.calls_bytes or prepared.bytes_moved, kernels)
    run = chained_calls(prepared.step, calls, sets, fresh_outputs=prepared.fresh_outputs,
                        opaque_step=prepared.kernel_target is not None, shift_inputs=prepared.shift_inputs,
                        compiler_options=prepared.compiler_options)
    arguments = (prepared.fixed, prepared.varying, prepared.new_outputs(), _zeros(calls))
    found = dict(bytes_moved=prepared.bytes_moved, input_sets=sets,
                 method=f"in-jit, {calls} calls/jit{f' of {kernels} kernels' if kernels > 1 else ''} "
                        f"(~{estimate * 1e3:.2g} ms est.)")
    if prepared.kernel_target is not None:
        launches = _launches(run, arguments, prepared.kernel_target)
        if launches != calls * prepared.kernel_launches:
            each = f" of {prepared.kernel_launches} launches" if prepared.kernel_launches != 1 else ""
            return dict(found, check=f"FAIL: the jit launches {prepared.kernel_target} {launches} times for "
                                     f"{calls} calls{each} (XLA merged or dropped calls)"), None
    outputs, _ = run(*arguments)
    found["check"] = prepared.check(outputs, (calls - 1) % sets)
    if found["check"] != "ok":
        return found, None
    checked = [outputs]

    def timer():
        given = checked.pop() if checked else prepared.new_outputs()  # the timer donates what it is given
        return in_jit_seconds(run, prepared.fixed, prepared.varying, given, calls_per_jit=calls,
                              batch_seconds=effort.jax_batch_seconds, repeats=effort.jax_repeats)
    return found, timer


def _ready(implementation: Implementation, workload: Workload, effort: Effort) -> tuple[dict, Timer | None]:
    """Check: the fields of the measurement beyond its identity, and the row's timer."""
    prepared = implementation.prepare(workload)
    if isinstance(prepared, Steps):
        return _ready_in_jit(prepared, effort)
    found = dict(bytes_moved=prepared.bytes_moved, input_sets=prepared.sets, check=prepared.check())
    if found["check"] != "ok":
        return found, None
    if implementation.clock == "host":
        wait = _wait_for(implementation)
        return dict(found, method=f"host loop, {effort.host_calls} calls"), lambda: (host_seconds_per_call(
            prepared.call, prepared.sets, calls=effort.host_calls, repeats=effort.host_repeats, wait=wait), False)
    return dict(found, method=f"graph replay, {effort.graph_ms:g} ms a graph"), lambda: (graph_replay_seconds(
        prepared.call, prepared.sets, rep_ms=effort.graph_ms), False)


def _identity(implementation: Implementation, shape: BenchShape, total_ctx: int, dtype: str) -> dict:
    return dict(shape=shape.name, dtype=dtype, implementation=implementation.name,
                framework=implementation.framework, kind=implementation.kind, clock=implementation.clock,
                tokens=total_ctx, baseline=implementation.baseline, does_op=implementation.does_op,
                gemm=implementation.gemm)


def _attempt(identity: dict, action: Callable, on_error) -> tuple[object, Measurement | None]:
    """``(action(), None)``, or ``(None, the row saying why not)``: not applicable, or raised."""
    try:
        return action(), None
    except NotApplicable as reason:
        return None, Measurement(**identity, seconds=None, bytes_moved=0, check=f"n/a: {reason}")
    except Exception as error:  # one failing row is reported and the run goes on
        failed = Measurement(**identity, seconds=None, bytes_moved=0, error=f"{type(error).__name__}: {error}")
        if on_error is not None:
            on_error(failed, traceback.format_exc())
        return None, failed


def _measured(identity: dict, found: dict, timings: list[tuple[float, bool]]) -> Measurement:
    """The row from its check's fields and its timings (one a round; none where its check failed)."""
    if not timings:
        return Measurement(**identity, **dict(dict(seconds=None, bytes_moved=0), **found))
    seconds = [value for value, _ in timings]
    method = found["method"] + (", host-bound" if any(bound for _, bound in timings) else "")
    if len(seconds) > 1:
        method += f", median of {len(seconds)} rounds ({min(seconds) * 1e6:.2f}-{max(seconds) * 1e6:.2f} us)"
    return Measurement(**identity, **dict(found, seconds=statistics.median(seconds), method=method,
                                          rounds=tuple(seconds) if len(seconds) > 1 else ()))


def _missing_inputs() -> None:
    raise RuntimeError("the inputs of this size could not be drawn (see the first error)")


def measure(implementation: Implementation, workload: Workload | None, effort: Effort, *,
            shape: BenchShape, total_ctx: int, dtype: str,
            on_error: Callable[[Measurement, str], None] | None = None) -> Measurement:
    """One row, checked and timed once; ``workload`` None when drawing it failed (the row records that error)."""
    start = time.perf_counter()
    row = _checked_and_timed(implementation, workload, effort, _identity(implementation, shape, total_ctx, dtype),
                             on_error)
    return dataclasses.replace(row, wall_seconds=time.perf_counter() - start)


def _checked_and_timed(implementation, workload, effort, identity: dict, on_error) -> Measurement:
    ready, failed = _attempt(identity, _missing_inputs if workload is None else
                             lambda: _ready(implementation, workload, effort), on_error)
    if failed is not None:
        return failed
    found, timer = ready
    if timer is None:
        return _measured(identity, found, [])
    timing, failed = _attempt(identity, timer, on_error)
    return failed if failed is not None else _measured(identity, found, [timing])


def measure_rounds(implementations: list[Implementation], workload: Workload | None, effort: Effort, rounds: int,
                   *, shape: BenchShape, total_ctx: int, dtype: str,
                   on_error: Callable[[Measurement, str], None] | None = None) -> list[Measurement]:
    """Every row of one size checked, then timed once a round, the order reversed every other round."""
    rows = []
    for implementation in implementations:
        identity = _identity(implementation, shape, total_ctx, dtype)
        start = time.perf_counter()
        ready, failed = _attempt(identity, _missing_inputs if workload is None else
                                 lambda: _ready(implementation, workload, effort), on_error)
        rows.append(dict(identity=identity, ready=ready, failed=failed, timings=[],
                         wall=time.perf_counter() - start))
    for index in range(rounds):
        for row in rows if index % 2 == 0 else rows[::-1]:
            if row["failed"] is None and row["ready"][1] is not None:
                start = time.perf_counter()
                timing, row["failed"] = _attempt(row["identity"], row["ready"][1], on_error)
                row["timings"].append(timing)
                row["wall"] += time.perf_counter() - start
    return [dataclasses.replace(row["failed"] or _measured(row["identity"], row["ready"][0], row["timings"]),
                                wall_seconds=row["wall"]) for row in rows]


def _release_device_memory() -> None:
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(tasks: list[tuple[BenchShape, int, Implementation]], *, dtype: str, framework: str, effort: Effort = FULL,
        rounds: int = 1, positions: str = "uniform", progress=None,
        on_error: Callable[[Measurement, str], None] | None = None,
        on_size_done: Callable[[list[Measurement]], None] | None = None) -> list[Measurement]:
    """Measure ``tasks`` (from :func:`plan`), inputs drawn in ``framework``, each row timed
    in ``rounds`` alternated rounds (module docstring); in ``dtype``, or a shape's own;
    positions drawn as ``positions`` says (:data:`~interop.bench.workload.POSITIONS`).

    ``progress``: a tqdm-like bar, advanced once per row; ``on_size_done(rows so far)``
    after each shape and token count (to write partial results).
    """
    measurements: list[Measurement] = []
    run_dtype = dtype
    for (shape, total_ctx), group in itertools.groupby(tasks, key=lambda task: (task[0], task[1])):
        dtype = shape.dtype or run_dtype
        workload = None
        try:
            workload = Workload(shape, total_ctx, dtype, framework=framework, positions=positions)
        except Exception as error:  # every row of this size records it below
            if on_error is not None:
                on_error(Measurement(shape.name, dtype, "inputs", framework, "-", "-", total_ctx, None, 0,
                                     error=f"{type(error).__name__}: {error}"), traceback.format_exc())
        implementations = [implementation for _, _, implementation in group]
        if rounds > 1:
            if progress is not None:
                progress.set_postfix_str(f"{shape.name}, {total_ctx} tokens: {rounds} rounds", refresh=False)
            measurements += measure_rounds(implementations, workload, effort, rounds, shape=shape,
                                           total_ctx=total_ctx, dtype=dtype, on_error=on_error)
            if progress is not None:
                progress.update(len(implementations))
        else:
            for implementation in implementations:
                if progress is not None:
                    progress.set_postfix_str(f"{shape.name}, {total_ctx} tokens: {implementation.name}",
                                             refresh=False)
                measurements.append(measure(implementation, workload, effort, shape=shape, total_ctx=total_ctx,
                                            dtype=dtype, on_error=on_error))
                if progress is not None:
                    progress.update(1)
        del workload
        _release_device_memory()
        if on_size_done is not None:
            on_size_done(measurements)
    return measurements
