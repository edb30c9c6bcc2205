"""One timer per regime: ``fusedkv bench``'s, and the profiler's kernel times for ``scripts/two_gpu.py``.

What each measures:

* :func:`graph_replay_seconds` (torch): ``triton.testing.do_bench_cudagraph``, many
  calls captured in one CUDA graph, rotating over input sets, the graph replayed and
  timed with CUDA events; per call, the device time including the gap between
  consecutive kernels but no host launch work.
* :func:`in_jit_seconds` (JAX, the way a ``jax.jit`` user runs the op): many calls inside
  one jit (:func:`chained_calls`), several such jits queued before one
  ``block_until_ready``; per call, wall time over calls (of a long batch less a short
  one). Host dispatch of one jit is hidden behind the device work of the jits ahead of
  it, unless the device finishes first, which the timer reports.
* :func:`host_seconds_per_call`: host wall time per call of a loop that waits only at
  its end; what an eager caller pays when the host is the bottleneck.
* :func:`do_bench_seconds`: ``triton.testing.do_bench``'s median, one eager call at a
  time with the L2 flushed before each (device time plus any launch gap).
* :func:`copy_bytes_per_second`: a 1 GiB device-to-device copy, bytes read plus written:
  the device's copy ceiling, one size large enough that no cache or graph artefact of
  a particular size shows in it.
* :func:`gpu_kernel_events`: the GPU kernels of a ``jax.profiler`` trace, each its start
  and duration as the device recorded them.

Nothing here imports torch, triton or jax until a timer runs.
"""

from __future__ import annotations

import glob
import re
import statistics
import time
from typing import Callable

COPY_BYTES = 2**30
# A graph capture fails now and then on a row that captures cleanly when run again; a row gets
# this many attempts.
_CAPTURE_ATTEMPTS = 2


def do_bench_seconds(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def graph_replay_seconds(call: Callable[[int], object], input_sets: int, *, rep_ms: float = 20) -> float:
    """Median per-call device time of ``call(i)`` (i cycles over input sets) replayed from a
    CUDA graph: ``triton.testing.do_bench_cudagraph``, which captures about ``rep_ms`` of
    calls in one graph and times its replays with CUDA events.

    Its capture runs in CUDA's global mode, where another thread's unsafe CUDA call fails
    the capture (or that call): jax's work in the same process is finished before a torch
    row is timed. Python's garbage collector is run before and kept off while it times, so
    that no earlier row's graph or events are freed (CUDA calls a capture forbids) inside
    a capture. A capture that still fails is captured and timed once more from the start;
    a second failure, or any other error, is raised.
    """
    import gc
    import itertools

    import triton.testing

    sets = itertools.count()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for attempt in range(_CAPTURE_ATTEMPTS):
            try:
                milliseconds = triton.testing.do_bench_cudagraph(lambda: call(next(sets) % input_sets), rep=rep_ms,
                                                                 return_mode="median")
                break
            except RuntimeError as error:  # torch.AcceleratorError is one; "captur": capture, capturing
                if attempt + 1 == _CAPTURE_ATTEMPTS or "captur" not in str(error):
                    raise
    finally:
        if was_enabled:
            gc.enable()
    return milliseconds / 1e3


def synchronize_torch(outputs=None) -> None:
    """Wait for all of torch's device work (``outputs`` is ignored)."""
    import torch

    torch.cuda.synchronize()


def host_seconds_per_call(call: Callable[[int], object], input_sets: int, *, calls: int = 2000,
                          repeats: int = 1, wait: Callable[[object], None] = synchronize_torch) -> float:
    """Host wall time per call of a loop of ``call(i)``, waiting (``wait(last outputs)``)
    only at its ends; the median over ``repeats`` loops."""
    for i in range(min(input_sets, 3)):
        outputs = call(i)
    wait(outputs)
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            outputs = call(i % input_sets)
        per_call.append((time.perf_counter() - start) / calls)
        wait(outputs)
    return statistics.median(per_call)


def copy_bytes_per_second(nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth, bytes read plus written per second (do_bench median)."""
    import torch

    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    return 2 * nbytes / do_bench_seconds(lambda: destination.copy_(source))


def gpu_kernel_events(trace_dir: str, device: int | None = None) -> list[tuple[int, int]]:
    """``(start_ns, duration_ns)`` of every kernel on the GPU streams of the newest
    ``jax.profiler`` trace in ``trace_dir``, sorted: of every GPU, or of GPU ``device`` alone."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not files:
        return []
    events = []
    for plane in ProfileData.from_file(files[-1]).planes:
        gpu = re.match(r"/device:GPU:(\d+)", plane.name)
        if gpu is None or (device is not None and int(gpu[1]) != device):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")] or lines
        for line in streams:
            events += [(event.start_ns, event.duration_ns) for event in line.events]
    return sorted(events)


def chained_calls(step: Callable, calls: int, sets: int, *, fresh_outputs: bool = False,
                  opaque_step: bool = False, shift_inputs: bool | None = None, compiler_options: tuple = ()):
    """One jit of ``calls`` calls of ``step``, call ``j`` on input set ``j % sets``.

    ``step(fixed, varying, outputs) -> outputs``; the jit is ``run(fixed, varying_sets,
    outputs, zeros) -> (outputs, earlier)`` with ``outputs`` donated and ``zeros`` a
    float32[calls] array of zeros. Between calls an optimization barrier hands the
    previous outputs and the next inputs on together, so XLA cannot fuse calls (one fusion
    reading an input set once for several calls). A step that writes into the outputs of
    the call before it (the Pallas kernel on its Triton lowering) is chained through them.
    A step with ``fresh_outputs`` (XLA's own computations, which allocate their results)
    ignores them, so nothing would stop XLA from dropping every call but the last or
    merging calls on the same input set (it did both): every call's outputs are returned
    in ``earlier``, and every call reads its inputs plus ``zeros[j]``, a value XLA cannot
    know, a sum XLA fuses into the step's own kernels.

    An ``opaque_step`` with fresh outputs is one kernel XLA cannot fuse into (a custom
    call: the Pallas kernel on Mosaic GPU), for which that sum would be a pass of its own
    over ``kv``; its inputs are left as they are, and the barrier and the returned
    outputs alone keep its calls apart: XLA's GPU compiler removes barriers after
    scheduling, past its common-subexpression passes (its CPU compiler removes them
    before one, and merged calls on one input set so), and the runner counts the
    kernel's launches in the compiled jit to make sure.

    ``shift_inputs`` overrides that rule (None keeps it): rows compared with each other
    (a materializer and its GEMM alone) feed their inputs the same way whatever their outputs.
    ``compiler_options``: ``(name, value)`` pairs of XLA options to compile the jit with.
    """
    import jax
    import jax.numpy as jnp

    def shifted(varying, zero):
        return jax.tree.map(
            lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, varying)

    shift = fresh_outputs and not opaque_step if shift_inputs is None else shift_inputs

    def run(fixed, varying_sets, outputs, zeros):
        earlier = []
        for call in range(calls):
            varying = varying_sets[call % sets]
            if call:
                varying, outputs = jax.lax.optimization_barrier((varying, outputs))
                if fresh_outputs:
                    earlier.append(outputs)
            if shift:
                varying = shifted(varying, zeros[call])
            outputs = step(fixed, varying, outputs)
        return outputs, earlier

    return jax.jit(run, donate_argnums=2, compiler_options=dict(compiler_options) or None)


# PJRT blocks a dispatch while 32 computations are in flight on a GPU; below that, queueing
# time measures the host alone.
MAX_QUEUED_JITS = 24


def in_jit_seconds(run, fixed, varying_sets, outputs, *, calls_per_jit: int, batch_seconds: float = 0.02,
                   repeats: int = 7) -> tuple[float, bool]:
    """Median per-call time of ``run`` (a :func:`chained_calls` jit, already compiled),
    and whether the host was the bottleneck.

    A batch queues jits (``outputs`` passed from one to the next) and waits once. Each
    sample times a short and a long batch, the long one about ``batch_seconds``, and
    divides the difference of their wall times by the difference of their calls: the
    cost of starting and ending a batch (the first dispatch, the final wait) is in both
    and cancels. When queueing takes nearly all of the long batch's wall time, the device
    was waiting on the host and the figure is an upper bound (the second value is True).
    """
    import jax

    zeros = jax.numpy.zeros(calls_per_jit, jax.numpy.float32)

    def batch(jits, outputs):
        start = time.perf_counter()
        every = []
        for _ in range(jits):
            outputs, earlier = run(fixed, varying_sets, outputs, zeros)
            every.append(earlier)
        queued = time.perf_counter() - start
        jax.block_until_ready((outputs, every))
        return time.perf_counter() - start, queued, outputs

    _, _, outputs = batch(1, outputs)
    wall, _, outputs = batch(2, outputs)
    long = max(4, min(MAX_QUEUED_JITS, round(2 * batch_seconds / wall)))
    short = long // 4
    per_call, host_bound = [], 0
    for _ in range(repeats):
        short_wall, _, outputs = batch(short, outputs)
        long_wall, queued, outputs = batch(long, outputs)
        per_call.append((long_wall - short_wall) / ((long - short) * calls_per_jit))
        host_bound += queued > 0.9 * long_wall
    return statistics.median(per_call), 2 * host_bound > repeats
