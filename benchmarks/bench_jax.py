"""Device time of the Pallas kernel on a GPU, beside plain jnp under jax.jit and the copy ceiling.

``python -m benchmarks.bench_jax [--quick]`` from the tree (``PYTHONPATH=.``). Rows: bf16,
5 layers, 8 KV heads, head_dim 128 (neox) at 16, 256, 4096 and 32768 tokens, the kernel
with its default tile, plain jnp reference math under ``jax.jit``, XLA's elementwise pass
over ``kv`` (the same bytes read and written: the floor under the kernel), and the
paged-cache entry point (bf16 and fp8 caches of twice as many slots); then a sweep of
tiles (``block_tokens``, ``block_heads``, ``num_warps``) at every size.

Timing (the measurement method in BENCHMARKS.md): device time, not host dispatch. Each step is run many times under
``jax.profiler`` and the GPU's own kernel durations are read back from the trace
(``jax.profiler.ProfileData``); a step's time is the sum of the kernels it launched,
and the row gives the median over steps with the 10th-90th percentile spread. If the
trace holds no GPU events, the fallback is host wall time over many queued steps (an
upper bound, marked ``wall``).
Inputs are random, the outputs donated back into the next step (written in place,
as a serving loop would), and rotated over enough input sets to exceed the L2 cache
where one set fits in it. Bandwidth is ``2 * kv.nbytes`` (read ``kv``, write K and V)
over the time; the copy ceiling is a jitted elementwise pass over 1 GiB measured the
same way, counting bytes read plus written. Each row's K and V are also checked
against the interop reference once before timing. One failing configuration prints
an error row and the run goes on; a short table comes last.
"""

from __future__ import annotations

import argparse
import functools
import glob
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import DRAFT, DRAFT_STATIC, N_LAYERS, Row, format_table, guarded
from fusedkv_jax import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from interop.bench.baselines import jnp_reference_math
from interop.bench.check import verdict
from interop.bench.shapes import MAX_POSITION
from interop.bench.timers import COPY_BYTES, copy_bytes_per_second
from interop.bench.workload import input_sets_needed
from interop.core.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.testing import random_inputs

SIZES = (16, 256, 4096, 32768)
SWEEP_SIZES = (16, 256, 4096, 32768)
# Steps at 16 and 256 tokens, whatever --quick says: ten-step medians there moved by 40%.
SMALL_STEPS = 100
# The NumPy reference of a whole paged cache is slow past this many tokens.
CACHE_CHECK_LIMIT = 4096


def _gpu_kernel_events(trace_dir: str, device: int | None = None) -> list:
    """Kernel events (start_ns, duration_ns) on the GPU streams of the newest trace in ``trace_dir``:
    of every GPU, or of GPU ``device`` alone."""
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


def _queue(launch, steps: int) -> None:
    """Queue ``steps`` steps and wait for the last; each step's outputs are dropped as the next
    is queued (freed in stream order), so fresh outputs never pile up in device memory."""
    for i in range(steps):
        outputs = launch(i)
    jax.block_until_ready(outputs)


def device_seconds(launch, steps: int) -> tuple[float, str]:
    """Median device time of one step: ``launch(i)`` queues step ``i`` and returns its outputs.

    Warm-up (compilation, first touch) happens before; the steps are queued back to back.
    """
    jax.block_until_ready(launch(0))
    events = []
    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            jax.profiler.start_trace(trace_dir)
        except Exception as error:  # no profiler here: fall back to wall time below
            print(f"profiler unavailable ({type(error).__name__}: {error}); timing wall clock",
                  file=sys.stderr)
        else:
            try:
                _queue(launch, steps)
            finally:
                jax.profiler.stop_trace()
            events = _gpu_kernel_events(trace_dir)
    if events:
        durations = [duration for _, duration in events]
        if len(durations) % steps:
            return sum(durations) / steps * 1e-9, f"profiler mean ({len(durations)} kernels)"
        per_step = len(durations) // steps
        sums = [sum(durations[i:i + per_step]) * 1e-9 for i in range(0, len(durations), per_step)]
        deciles = statistics.quantiles(sums, n=10)
        return statistics.median(sums), (f"profiler ({per_step} kernel{'s' * (per_step > 1)}/step, "
                                         f"p10-p90 {deciles[0] * 1e6:.2f}-{deciles[-1] * 1e6:.2f})")
    walls = []
    for _ in range(5):
        start = time.perf_counter()
        _queue(launch, steps)
        walls.append((time.perf_counter() - start) / steps)
    return statistics.median(walls), "wall"


def copy_bandwidth(steps: int) -> tuple[float, str]:
    """Bytes per second (read + written) of a jitted elementwise pass over ``COPY_BYTES`` of bf16."""
    source = jax.random.normal(jax.random.key(0), (COPY_BYTES // 2,), jnp.bfloat16)
    negate = jax.jit(jnp.negative)
    seconds, method = device_seconds(lambda i: negate(source), steps)
    return 2 * source.nbytes / seconds, method


def device_copy_ceiling(steps: int) -> tuple[float, str]:
    """The higher of XLA's elementwise pass and, where torch sees the GPU, a plain device copy.

    XLA's pass reached only about 80% of a cudaMemcpy on the H200, and a ceiling set too
    low would flatter the kernel; the fraction is taken of the device's best copy.
    """
    rate, method = copy_bandwidth(steps)
    try:
        import torch
    except ImportError:
        return rate, method
    if not torch.cuda.is_available():
        return rate, method
    memcpy_rate = copy_bytes_per_second()
    if memcpy_rate <= rate:
        return rate, method
    return memcpy_rate, f"torch device copy; XLA pass {rate / 1e9:.0f} GB/s"


@functools.cache
def _input_sets(total_ctx: int) -> tuple[tuple[np.ndarray, ...], list[list[jax.Array]]]:
    """Host copy of the first set (for the check) and every set on the device, made once per size."""
    count = input_sets_needed(3 * total_ctx * N_LAYERS * 2 * DRAFT.kv_size * 2)  # kv, K and V
    hosts = [random_inputs(DRAFT, n_layers=N_LAYERS, total_ctx=total_ctx, max_position=MAX_POSITION,
                           seed=total_ctx + i).arrays() for i in range(count)]
    return hosts[0], [[jax.device_put(a) for a in host] for host in hosts]


@functools.cache
def _expected(total_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    return fused_kv_norm_rope_reference(*_input_sets(total_ctx)[0], **DRAFT_STATIC)


def _check(k, v, total_ctx: int) -> str:
    return verdict(k, v, *_expected(total_ctx))


def measure_kernel(total_ctx: int, steps: int, *, check: bool, **tile) -> Row:
    """The kernel, its outputs donated back into each next step (written in place)."""
    host, device_sets = _input_sets(total_ctx)
    step = jax.jit(functools.partial(fused_kv_norm_rope, **DRAFT_STATIC, **tile), donate_argnames=("k_out", "v_out"))
    shape = DRAFT.output_shape(N_LAYERS, total_ctx)
    sets = [dict(inputs=inputs, k=jnp.full(shape, jnp.nan, jnp.bfloat16),
                 v=jnp.full(shape, jnp.nan, jnp.bfloat16)) for inputs in device_sets]

    def launch(i):
        state = sets[i % len(sets)]
        state["k"], state["v"] = step(*state["inputs"], k_out=state["k"], v_out=state["v"])
        return state["k"], state["v"]

    result = "-"
    if check:
        launch(0)
        result = _check(sets[0]["k"], sets[0]["v"], total_ctx)
    seconds, method = device_seconds(launch, steps)
    label = ", ".join(f"{name}={value}" for name, value in tile.items()) or "default"
    return Row("pallas", total_ctx, label, seconds, 2 * host[0].nbytes, method, len(sets), result)


def measure_cache(total_ctx: int, steps: int, *, fp8: bool) -> Row:
    """The paged-cache entry point: tokens scattered over twice as many slots, caches donated."""
    host, device_sets = _input_sets(total_ctx)
    num_slots = 2 * total_ctx
    rng = np.random.default_rng(total_ctx)
    host_slots = [rng.permutation(num_slots)[:total_ctx].astype(np.int32) for _ in device_sets]
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    shape = DRAFT.output_shape(N_LAYERS, num_slots)
    host_scales = dict(k_scale=np.full(N_LAYERS, 0.02, np.float32),
                       v_scale=np.full(N_LAYERS, 0.03, np.float32)) if fp8 else {}
    scales = {name: jax.device_put(scale) for name, scale in host_scales.items()}
    step = jax.jit(functools.partial(fused_kv_norm_rope_into_cache, **DRAFT_STATIC), donate_argnums=(6, 7))
    sets = [dict(inputs=inputs, slots=jax.device_put(slots), k=jnp.zeros(shape, dtype),
                 v=jnp.zeros(shape, dtype)) for inputs, slots in zip(device_sets, host_slots)]

    def launch(i):
        state = sets[i % len(sets)]
        state["k"], state["v"] = step(*state["inputs"], state["slots"], state["k"], state["v"], **scales)
        return state["k"], state["v"]

    result = "-"
    if total_ctx <= CACHE_CHECK_LIMIT:
        launch(0)
        empty = np.zeros(shape, jnp.dtype(dtype))
        expected = fused_kv_norm_rope_into_cache_reference(
            *host, host_slots[0], empty, empty, **DRAFT_STATIC, **host_scales)
        result = verdict(sets[0]["k"], sets[0]["v"], *expected, v_exact=not fp8)
    seconds, method = device_seconds(launch, steps)
    written = host[0].nbytes // (2 if fp8 else 1)
    name = "pallas cache fp8" if fp8 else "pallas cache"
    return Row(name, total_ctx, "default", seconds, host[0].nbytes + written, method, len(sets), result)


def measure_xla_pass(total_ctx: int, steps: int) -> Row:
    """The floor under the kernel's bytes: XLA's own elementwise pass over kv (read and written)."""
    host, device_sets = _input_sets(total_ctx)
    negate = jax.jit(jnp.negative)
    seconds, method = device_seconds(lambda i: negate(device_sets[i % len(device_sets)][0]), steps)
    return Row("floor: XLA pass over kv", total_ctx, "-", seconds, 2 * host[0].nbytes, method,
               len(device_sets))


def measure_jnp(total_ctx: int, steps: int) -> Row:
    host, device_sets = _input_sets(total_ctx)
    step = jax.jit(functools.partial(jnp_reference_math, config=DRAFT))
    k, v = step(*device_sets[0])
    result = _check(k, v, total_ctx)
    seconds, method = device_seconds(lambda i: step(*device_sets[i % len(device_sets)]), steps)
    return Row("jnp (jit)", total_ctx, "-", seconds, 2 * host[0].nbytes, method, len(device_sets), result)


def sweep_tiles(total_ctx: int, quick: bool) -> list[dict]:
    if total_ctx <= 256:
        # Latency-bound: more, smaller programs against fewer, wider ones.
        return [dict(block_tokens=1, block_heads=bh, num_warps=nw)
                for bh, nw in ((1, 1), (2, 1), (4, 1), (8, 1), (8, 4))]
    if quick:
        return [dict(block_tokens=bt, block_heads=8, num_warps=nw) for bt, nw in ((1, 2), (2, 4), (4, 4), (8, 8))]
    # Between 4 and 64 K elements per thread with every head in the block, and two
    # half-head blocks.
    tiles = [dict(block_tokens=bt, block_heads=8, num_warps=nw)
             for bt in (1, 2, 4, 8, 16) for nw in (1, 2, 4, 8)
             if 4 <= bt * 8 * DRAFT.head_dim // (32 * nw) <= 64]
    return tiles + [dict(block_tokens=bt, block_heads=4, num_warps=4) for bt in (2, 4)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller tile sweep")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"bench_jax: no GPU (jax backend {jax.default_backend()!r}); nothing to time.")
        return 0
    steps = 20 if args.quick else 100
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; bf16, {N_LAYERS} layers, "
          f"{DRAFT.num_kv_heads} KV heads, head_dim {DRAFT.head_dim}, {DRAFT.rope_style}; {steps} steps")
    copy_rate, copy_method = device_copy_ceiling(steps)
    print(f"copy ceiling: {copy_rate / 1e9:.0f} GB/s ({copy_method})", flush=True)

    rows = []
    for total_ctx in SIZES:
        # Decode sizes vary by 1.5x from step to step (the inputs' cache state): more steps.
        size_steps = max(steps, SMALL_STEPS) if total_ctx <= 256 else steps
        rows.append(guarded("pallas", total_ctx, "default",
                             lambda: measure_kernel(total_ctx, size_steps, check=True)))
        rows.append(guarded("jnp (jit)", total_ctx, "-", lambda: measure_jnp(total_ctx, size_steps)))
        rows.append(guarded("floor: XLA pass over kv", total_ctx, "-",
                            lambda: measure_xla_pass(total_ctx, size_steps)))
        for fp8 in (False, True):
            rows.append(guarded("pallas cache", total_ctx, "default",
                                lambda: measure_cache(total_ctx, size_steps, fp8=fp8)))
        print(format_table(rows[-5:], copy_rate), flush=True)
    sweep = []
    for total_ctx in SWEEP_SIZES:
        size_steps = SMALL_STEPS if total_ctx <= 256 else max(10, steps // 5)
        for tile in sweep_tiles(total_ctx, args.quick):
            label = ", ".join(f"{k}={v}" for k, v in tile.items())
            sweep.append(guarded("pallas", total_ctx, label, lambda: measure_kernel(
                total_ctx, size_steps, check=False, **tile)))
            print(format_table(sweep[-1:], copy_rate), flush=True)

    print("\n== sweep (best first per size) ==")
    ranked = sorted(sweep, key=lambda r: (r.total_ctx, r.seconds is None, r.seconds or 0.0))
    print(format_table(ranked, copy_rate))
    print(f"\n== fused KV norm+RoPE, jax/Pallas: copy ceiling {copy_rate / 1e9:.0f} GB/s "
          f"({copy_method}); bar: 85% of copy at 4096/32768, <=1.5 us at 16, <=4 us at 256 ==")
    best = {size: min((r for r in sweep if r.total_ctx == size and r.seconds), key=lambda r: r.seconds,
                      default=None) for size in SWEEP_SIZES}
    print(format_table(rows + [r for r in best.values() if r is not None], copy_rate))
    return 0 if all(not r.error and r.check in ("ok", "-") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
