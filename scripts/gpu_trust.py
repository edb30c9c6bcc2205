"""The trust run on a GPU in one command: many calls through every entry point, and threads.

``PYTHONPATH=. python3 scripts/gpu_trust.py`` (``bash scripts/gpu_trust.sh`` adds the
property tests under their ``gpu`` profile):

1. Leaks: 10,000 calls through each entry point, token counts cycling through
   ``1, 7, 16, 33, 64, 100, 256, 1000`` (every size is compiled in the warm-up, so
   compilations stay bounded). GPU memory is read after the warm-up and at the end,
   both times with the same sizes' arguments and one result alive; the call count is a
   multiple of the cycle so both readings follow a call of the same size. Live bytes
   (``torch.cuda.memory_allocated``, jax ``bytes_in_use``) may grow by at most
   ``LIVE_SLACK``; torch's ``memory_reserved`` by at most ``RESERVED_SLACK`` (one more
   allocator segment). The last call of each entry point is checked against the reference.
2. Threads: 8 threads x 200 calls of each backend at once, each thread with its own
   inputs (and, in torch, its own CUDA stream); every result is checked against the
   reference after the threads join. Triton's interpreter is not thread-safe, so without
   a GPU the torch threads are skipped (and reported as skipped).

A table comes last; the exit status is non-zero if any row failed. On a machine
without a GPU the same code runs in interpret mode (``--tiny`` keeps it short;
tests/test_gpu_trust.py does that in CI), where there is no device memory to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import threading
import time
import traceback
from typing import Callable

# Before jax is imported: torch and jax share the GPU, so XLA must not take 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Set before any @triton.jit is decorated (fusedkv_torch's import), as tests/conftest.py does.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import fusedkv_jax  # noqa: E402
import fusedkv_torch  # noqa: E402
import interop  # noqa: E402
from fusedkv_jax.materializer import FusedKVMaterializer as JaxMaterializer  # noqa: E402
from fusedkv_torch.materializer import FusedKVMaterializer as TorchMaterializer  # noqa: E402
from interop.core.arrays import as_numpy, numpy_dtype  # noqa: E402
from interop.exchange import to_jax, to_torch  # noqa: E402
from interop.core.materializer import stacked_op_arrays  # noqa: E402
from interop.testing import random_case  # noqa: E402
from interop.core.reference import (  # noqa: E402
    fused_kv_norm_rope_into_cache_reference,
    fused_kv_norm_rope_reference,
)
from interop.core.spec import FusedKVConfig  # noqa: E402
from interop.testing import assert_bit_exact, assert_close, random_inputs  # noqa: E402

MIB = 2**20
LIVE_SLACK = 1 * MIB
RESERVED_SLACK = 32 * MIB
DEVICE = "cuda" if ON_GPU else "cpu"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run does: the op's shape, the sizes cycled through, how many calls."""

    config: FusedKVConfig
    n_layers: int
    hidden: int
    dtype: str
    max_position: int
    token_counts: tuple[int, ...]
    calls: int
    warmup_cycles: int
    threads: int
    calls_per_thread: int
    thread_token_counts: tuple[int, ...]

    @property
    def static(self) -> dict:
        config = self.config
        return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                    rotary_dim=config.rotary_dim, rope_style=config.rope_style)


FULL_PLAN = Plan(
    config=FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128, rope_style="neox"),
    n_layers=5, hidden=4096, dtype="bfloat16", max_position=4096,
    token_counts=(1, 7, 16, 33, 64, 100, 256, 1000), calls=10_000, warmup_cycles=2,
    threads=8, calls_per_thread=200, thread_token_counts=(1, 7, 16, 33, 64),
)
TINY_PLAN = Plan(
    config=FusedKVConfig(num_kv_heads=1, head_dim=64, rotary_dim=32, rope_style="gptj"),
    n_layers=2, hidden=32, dtype="bfloat16", max_position=64,
    token_counts=(1, 2), calls=2, warmup_cycles=1,
    threads=2, calls_per_thread=3, thread_token_counts=(1, 2),
)


# Memory of both frameworks, read after everything queued has finished.

@dataclasses.dataclass(frozen=True)
class Memory:
    torch_allocated: int | None
    torch_reserved: int | None
    jax_in_use: int | None

    def describe(self, frameworks: tuple[str, ...]) -> str:
        parts = []
        if "torch" in frameworks and self.torch_allocated is not None:
            parts.append(f"torch {self.torch_allocated / MIB:.1f}/{self.torch_reserved / MIB:.1f}")
        if "jax" in frameworks and self.jax_in_use is not None:
            parts.append(f"jax {self.jax_in_use / MIB:.1f}")
        return ", ".join(parts) or "n/a"


def wait_for(*results) -> None:
    """Return once every queued computation, and those making ``results``, has finished."""
    jax.block_until_ready([r for r in results if isinstance(r, jax.Array)])
    if ON_GPU:
        torch.cuda.synchronize()


def memory_now(*results) -> Memory:
    wait_for(*results)
    if not ON_GPU:
        return Memory(None, None, None)
    stats = jax.devices()[0].memory_stats() or {}
    return Memory(torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), stats.get("bytes_in_use"))


def memory_growth_problems(warm: Memory, end: Memory, frameworks: tuple[str, ...]) -> list[str]:
    """Each reading of ``frameworks`` that grew past its slack from ``warm`` to ``end``."""
    problems = []
    for framework, field, slack in (("torch", "torch_allocated", LIVE_SLACK),
                                    ("torch", "torch_reserved", RESERVED_SLACK),
                                    ("jax", "jax_in_use", LIVE_SLACK)):
        before, after = getattr(warm, field), getattr(end, field)
        if framework in frameworks and before is not None and after - before > slack:
            problems.append(f"{field} grew by {(after - before) / MIB:.2f} MiB "
                            f"(slack {slack / MIB:.0f} MiB)")
    return problems


# The entry points. Each is made once per token count (its inputs built then) into a
# call without arguments, and checked on the result of its last call.

@dataclasses.dataclass
class Sized:
    call: Callable[[], object]
    check: Callable[[object], None]


@dataclasses.dataclass(frozen=True)
class EntryPoint:
    name: str
    frameworks: tuple[str, ...]
    at_size: Callable[[Plan, int], Sized]


def _host_inputs(plan: Plan, total_ctx: int, seed: int):
    return random_inputs(plan.config, n_layers=plan.n_layers, total_ctx=total_ctx, dtype=plan.dtype,
                         max_position=plan.max_position, seed=seed).arrays()


def _torch(array):
    return to_torch(np.ascontiguousarray(array)).to(DEVICE, copy=True)


def _check_op(host, plan):
    expected_k, expected_v = fused_kv_norm_rope_reference(*host, **plan.static)

    def check(result):
        k, v = result
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
    return check


def _torch_op(plan, total_ctx, *, outputs_given=False):
    host = _host_inputs(plan, total_ctx, seed=total_ctx)
    args = [_torch(a) for a in host]
    outputs = {}
    if outputs_given:
        shape = plan.config.output_shape(plan.n_layers, total_ctx)
        outputs = {name: torch.full(shape, float("nan"), dtype=args[0].dtype, device=DEVICE)
                   for name in ("k_out", "v_out")}
    return Sized(lambda: fusedkv_torch.fused_kv_norm_rope(*args, **plan.static, **outputs),
                 _check_op(host, plan))


def _cache_arguments(plan, total_ctx, seed):
    """Host slots (a permutation, every third token padding) and NaN-poisoned caches."""
    rng = np.random.default_rng(seed)
    num_slots = total_ctx + 3
    slots = rng.permutation(num_slots)[:total_ctx].astype(np.int64)
    slots[::3] = -1
    shape = (plan.n_layers, num_slots, plan.config.num_kv_heads, plan.config.head_dim)
    poison = np.full(shape, np.nan, np.float32).astype(numpy_dtype(plan.dtype))
    return slots, poison


def _check_cache(host, slots, poison, plan):
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(*host, slots, poison, poison, **plan.static)

    def check(result):
        k_cache, v_cache = result
        assert_close(k_cache, expected_k, name="k_cache")
        assert_bit_exact(v_cache, expected_v, name="v_cache")
    return check


def _torch_cache(plan, total_ctx):
    host = _host_inputs(plan, total_ctx, seed=total_ctx + 1)
    slots, poison = _cache_arguments(plan, total_ctx, seed=total_ctx)
    args = [_torch(a) for a in (*host, slots, poison, poison)]
    return Sized(lambda: fusedkv_torch.fused_kv_norm_rope_into_cache(*args, **plan.static),
                 _check_cache(host, slots, poison, plan))


def _jax_op(plan, total_ctx, *, jitted=False):
    host = _host_inputs(plan, total_ctx, seed=total_ctx + 2)
    args = [to_jax(a) for a in host]
    op = functools.partial(fusedkv_jax.fused_kv_norm_rope, **plan.static)
    if jitted:
        op = jax.jit(op)
    return Sized(lambda: op(*args), _check_op(host, plan))


def _jax_cache(plan, total_ctx):
    host = _host_inputs(plan, total_ctx, seed=total_ctx + 3)
    slots, poison = _cache_arguments(plan, total_ctx, seed=total_ctx + 3)
    args = [to_jax(a) for a in (*host, slots, poison, poison)]
    return Sized(lambda: fusedkv_jax.fused_kv_norm_rope_into_cache(*args, **plan.static),
                 _check_cache(host, slots, poison, plan))


def _interop(plan, total_ctx, *, backend):
    host = _host_inputs(plan, total_ctx, seed=total_ctx + 4)
    args = [_torch(a) for a in host]
    return Sized(lambda: interop.fused_kv_norm_rope(*args, **plan.static, backend=backend),
                 _check_op(host, plan))


@functools.cache
def _materializer_case(plan: Plan):
    """One set of layers for every size; the context of a size is the first rows."""
    return random_case(plan.config, n_layers=plan.n_layers, hidden=plan.hidden,
                       total_ctx=max(plan.token_counts), max_position=plan.max_position,
                       dtype=plan.dtype, seed=5)


@functools.cache
def _torch_materializer(plan: Plan) -> TorchMaterializer:
    case = _materializer_case(plan)
    return TorchMaterializer([dataclasses.replace(layer, kv_proj_weight=_torch(layer.kv_proj_weight),
                                                  k_norm_weight=_torch(layer.k_norm_weight))
                              for layer in case.layers])


@functools.cache
def _jax_materializer(plan: Plan) -> JaxMaterializer:
    return JaxMaterializer(_materializer_case(plan).layers)


def _check_materialized(plan, materializer, ctx_hidden, positions):
    """The op's reference on the materializer's own GEMM output (``project``), read at
    check time: torch's workspace is rewritten by the next call."""
    layers = _materializer_case(plan).layers

    def check(result):
        k, v = result
        kv = as_numpy(materializer.project(ctx_hidden))
        expected_k, expected_v = fused_kv_norm_rope_reference(
            kv, *stacked_op_arrays(layers), as_numpy(positions), **plan.static)
        assert_close(k, expected_k)
        assert_bit_exact(v, expected_v)
    return check


def _torch_materialize(plan, total_ctx):
    case = _materializer_case(plan)
    materializer = _torch_materializer(plan)
    ctx_hidden, positions = _torch(case.ctx_hidden[:total_ctx]), _torch(case.positions[:total_ctx])
    return Sized(lambda: materializer.materialize(ctx_hidden, positions),
                 _check_materialized(plan, materializer, ctx_hidden, positions))


def _jax_materialize(plan, total_ctx):
    case = _materializer_case(plan)
    materializer = _jax_materializer(plan)
    ctx_hidden, positions = to_jax(case.ctx_hidden[:total_ctx]), to_jax(case.positions[:total_ctx])
    return Sized(lambda: materializer.materialize(ctx_hidden, positions),
                 _check_materialized(plan, materializer, ctx_hidden, positions))


ENTRY_POINTS = (
    EntryPoint("torch fused_kv_norm_rope", ("torch",), _torch_op),
    EntryPoint("torch fused_kv_norm_rope, outputs given", ("torch",),
               functools.partial(_torch_op, outputs_given=True)),
    EntryPoint("torch fused_kv_norm_rope_into_cache", ("torch",), _torch_cache),
    EntryPoint("jax fused_kv_norm_rope (eager)", ("jax",), _jax_op),
    EntryPoint("jax fused_kv_norm_rope (in a jit)", ("jax",), functools.partial(_jax_op, jitted=True)),
    EntryPoint("jax fused_kv_norm_rope_into_cache", ("jax",), _jax_cache),
    EntryPoint("interop torch->torch", ("torch",), functools.partial(_interop, backend="torch")),
    EntryPoint("interop torch->jax", ("torch", "jax"), functools.partial(_interop, backend="jax")),
    EntryPoint("torch materializer.materialize", ("torch",), _torch_materialize),
    EntryPoint("jax materializer.materialize", ("jax",), _jax_materialize),
)


@dataclasses.dataclass
class Row:
    name: str
    calls: int
    seconds: float
    warm: str
    end: str
    problems: list[str]
    skipped: str = ""

    @property
    def verdict(self) -> str:
        return "FAIL" if self.problems else "skipped" if self.skipped else "ok"


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def run_entry_point(entry: EntryPoint, plan: Plan) -> Row:
    """Warm up every size, read memory, make ``plan.calls`` calls cycling the sizes, read
    memory again, check the last result against the reference."""
    calls = -(-plan.calls // len(plan.token_counts)) * len(plan.token_counts)
    started = time.perf_counter()
    try:
        sized = [entry.at_size(plan, total_ctx) for total_ctx in plan.token_counts]
        result = None
        for _ in range(plan.warmup_cycles):
            for at_size in sized:
                result = at_size.call()
        warm = memory_now(*_leaves(result))
        started = time.perf_counter()
        for index in range(calls):
            result = sized[index % len(sized)].call()
        end = memory_now(*_leaves(result))
        seconds = time.perf_counter() - started
        problems = memory_growth_problems(warm, end, entry.frameworks)
        try:
            sized[(calls - 1) % len(sized)].check(result)
        except AssertionError as mismatch:
            problems.append(f"last call: {_first_line(mismatch)}")
        return Row(entry.name, calls, seconds, warm.describe(entry.frameworks),
                   end.describe(entry.frameworks), problems)
    except Exception as error:  # one broken entry point must not hide the others' results
        traceback.print_exc()
        return Row(entry.name, 0, time.perf_counter() - started, "-", "-", [_first_line(error)])


def _leaves(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


# Threads: every thread its own inputs (and torch stream), all released at once.

def _thread_work(backend: str, plan: Plan, thread: int):
    """``[(call, check)]``, one per call this thread makes; sizes cycle, inputs its own."""
    sized = []
    for total_ctx in plan.thread_token_counts:
        host = _host_inputs(plan, total_ctx, seed=1000 * (thread + 1) + total_ctx)
        module = fusedkv_torch if backend == "torch" else fusedkv_jax
        args = [_torch(a) for a in host] if backend == "torch" else [to_jax(a) for a in host]
        sized.append((functools.partial(module.fused_kv_norm_rope, *args, **plan.static),
                      _check_op(host, plan)))
    return [sized[index % len(sized)] for index in range(plan.calls_per_thread)]


def run_threads(backend: str, plan: Plan) -> Row:
    name = f"{backend}, {plan.threads} threads at once"
    total = plan.threads * plan.calls_per_thread
    if backend == "torch" and not ON_GPU:
        return Row(name, 0, 0.0, "-", "-", [], skipped="Triton's interpreter is not thread-safe")
    work = [_thread_work(backend, plan, thread) for thread in range(plan.threads)]
    results: list[list] = [[] for _ in range(plan.threads)]
    errors: list[str] = []
    start = threading.Barrier(plan.threads)
    if ON_GPU:
        torch.cuda.synchronize()  # the inputs, made on the default stream, are ready for every stream

    def worker(thread):
        try:
            # None (the current stream, a no-op context) for jax and without a GPU.
            stream = torch.cuda.Stream() if backend == "torch" and ON_GPU else None
            with torch.cuda.stream(stream):
                start.wait()
                for call, _ in work[thread]:
                    results[thread].append(call())
        except Exception as error:
            errors.append(f"thread {thread}: {_first_line(error)}")
            start.abort()

    threads = [threading.Thread(target=worker, args=(thread,)) for thread in range(plan.threads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait_for(*(leaf for thread_results in results for result in thread_results for leaf in result))
    seconds = time.perf_counter() - started
    bad = 0
    for thread, thread_results in enumerate(results):
        for index, result in enumerate(thread_results):
            try:
                work[thread][index][1](result)
            except Exception as mismatch:  # AssertionError, or a result of the wrong kind
                bad += 1
                if bad == 1:
                    errors.append(f"thread {thread} call {index}: {_first_line(mismatch)}")
    made = sum(len(r) for r in results)
    if bad:
        errors.append(f"{bad} of {made} results differ from the reference")
    if made != total and not errors:
        errors.append(f"{made} of {total} calls made")
    return Row(name, made, seconds, "-", "-", errors)


def print_table(rows: list[Row]) -> None:
    header = (f"{'entry point':44s} {'calls':>6s} {'seconds':>8s}  {'memory after warm-up (MiB)':28s} "
              f"{'memory at end (MiB)':28s} check")
    print(f"\n== gpu_trust: memory is torch allocated/reserved, jax bytes in use; growth after warm-up "
          f"allowed: {LIVE_SLACK / MIB:.0f} MiB live, {RESERVED_SLACK / MIB:.0f} MiB reserved ==", flush=True)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.name:44s} {row.calls:6d} {row.seconds:8.2f}  {row.warm:28s} {row.end:28s} {row.verdict}")
        for problem in row.problems:
            print(f"    {problem}")
        if row.skipped:
            print(f"    skipped: {row.skipped}")
    print(flush=True)


THREAD_BACKENDS = ("torch", "jax")


def run(plan: Plan) -> list[Row]:
    rows = []
    for entry in ENTRY_POINTS:
        print(f"-- {entry.name}: {plan.calls} calls over {plan.token_counts} tokens", flush=True)
        rows.append(run_entry_point(entry, plan))
        print(f"   {rows[-1].verdict} in {rows[-1].seconds:.2f} s {rows[-1].problems or ''}", flush=True)
    for backend in THREAD_BACKENDS:
        print(f"-- {backend}: {plan.threads} threads x {plan.calls_per_thread} calls", flush=True)
        try:
            rows.append(run_threads(backend, plan))
        except Exception as error:  # e.g. making the inputs; the other rows still count
            traceback.print_exc()
            rows.append(Row(f"{backend}, {plan.threads} threads at once", 0, 0.0, "-", "-", [_first_line(error)]))
        print(f"   {rows[-1].verdict} in {rows[-1].seconds:.2f} s {rows[-1].problems or ''}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a handful of calls at tiny sizes (the CPU smoke run)")
    parser.add_argument("--calls", type=int, help="calls per entry point (default 10,000)")
    options = parser.parse_args(argv)
    plan = TINY_PLAN if options.tiny else FULL_PLAN
    if options.calls:
        plan = dataclasses.replace(plan, calls=options.calls)
    device = torch.cuda.get_device_name() if ON_GPU else "no GPU: interpret mode"
    print(f"gpu_trust on {device}; torch {torch.__version__}, jax {jax.__version__} "
          f"({jax.default_backend()}); {plan.n_layers} layers, {plan.config}, {plan.dtype}", flush=True)
    if ON_GPU and jax.default_backend() != "gpu":
        # Pallas would fall back to interpret mode on the CPU: hours, not minutes.
        print("gpu_trust: FAILED: jax sees no GPU here (is its CUDA plugin installed?)", flush=True)
        return 1
    rows = run(plan)
    print_table(rows)
    failed = [row.name for row in rows if row.problems]
    print(f"gpu_trust: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
