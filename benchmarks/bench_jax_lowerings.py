"""The two Pallas lowerings of the fused K/V kernel side by side on a GPU: checks, then in-jit times.

``python -m benchmarks.bench_jax_lowerings [--checks-only] [--shapes draft,hd256,rot64]``
from the tree (``PYTHONPATH=.``).

Checks: each lowering against the interop reference (K in tolerance, V bit for bit) on
fresh random inputs at odd and common shapes, outputs poisoned (given as NaN-filled
``k_out``/``v_out``), out-of-range positions included; a donated pair of outputs must
come back in the same buffers.

Times, the way a jit user runs the op: one jit holds ``calls`` calls (64 at decode sizes,
16 and 256 tokens; 8 above), several such jits are queued before one wait, and a
call's time is the wall time over all calls (median of repeats). Each lowering is
timed with every call's outputs returned (each call on its own positions, so XLA can
neither merge nor drop calls); the Triton lowering also chained through its outputs
(each call's ``k_out``/``v_out`` are the last call's, donated, so every call writes in
place and waits for the one before), which a Mosaic GPU chain cannot be: its outputs
alias nothing, and XLA drops the calls whose outputs nothing reads. The ceilings beside
each row: a same-bytes copy chained the same way in one jit (``kv`` negated, read and
written once per step, each step behind an optimization barrier so XLA cannot fuse
the chain), and torch's device copy of the same bytes (``do_bench`` median; XLA's
elementwise pass reaches only about 75% of it at large sizes). Bandwidth is
``2 * kv.nbytes`` over the time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fusedkv_jax import fused_kv_norm_rope
from benchmarks.measure import copy_bytes_per_second
from interop.reference import fused_kv_norm_rope_reference
from interop.spec import FusedKVConfig
from interop.testing import bit_mismatches, compare, random_inputs

SHAPES = {  # name: (n_layers, config)
    "draft": (5, FusedKVConfig(8, 128, 128, "neox")),
    "hd256": (5, FusedKVConfig(2, 256, 256, "neox")),
    "rot64": (8, FusedKVConfig(4, 128, 64, "neox")),
}
SIZES = (16, 256, 4096, 32768)
LOWERINGS = ("mosaic_gpu", "triton")
CHECKS = [  # n_layers, config, total_ctx, kv dtype
    (5, FusedKVConfig(8, 128, 128, "neox"), 1, "bfloat16"),
    (5, FusedKVConfig(8, 128, 128, "neox"), 100, "bfloat16"),
    (5, FusedKVConfig(8, 128, 128, "neox"), 4096, "bfloat16"),
    (5, FusedKVConfig(2, 256, 256, "neox"), 130, "bfloat16"),
    (8, FusedKVConfig(4, 128, 64, "neox"), 72, "bfloat16"),
    (1, FusedKVConfig(1, 96, 96, "neox"), 7, "bfloat16"),
    (1, FusedKVConfig(1, 96, 96, "neox"), 64, "float16"),
    (2, FusedKVConfig(2, 64, 32, "neox"), 65, "float32"),
    (2, FusedKVConfig(3, 128, 96, "neox"), 200, "float16"),
    (2, FusedKVConfig(2, 128, 64, "gptj"), 33, "bfloat16"),
]


def _static(config):
    return dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim, rope_style=config.rope_style)


def check(n_layers, config, total_ctx, dtype, lowering) -> str:
    host = list(random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, dtype=dtype,
                              max_position=512, seed=total_ctx).arrays())
    positions = host[4].copy()
    positions[::7] = -1  # out of range: an all-NaN K row, no read
    positions[3::11] = 512
    host[4] = positions
    shape = config.output_shape(n_layers, total_ctx)
    poison = jnp.full(shape, jnp.nan, host[0].dtype)
    step = jax.jit(functools.partial(fused_kv_norm_rope, **_static(config), lowering=lowering),
                   donate_argnames=("k_out", "v_out"))
    k_out, v_out = poison, jnp.array(poison)
    pointers = k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()
    k, v = step(*(jax.device_put(a) for a in host), k_out=k_out, v_out=v_out)
    k_expected, v_expected = fused_kv_norm_rope_reference(*host, **_static(config))
    result = compare(k, k_expected)
    mismatches, _ = bit_mismatches(v, v_expected)
    in_place = (k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()) == pointers
    if result.ok and not mismatches:
        return "ok" + ("" if in_place else " (not in place)")
    return f"FAIL k: {result.report()[:160]}; v: {mismatches} differ"


def _chained(call, calls: int):
    def run(kv, weight, eps, cos_sin, positions, k, v):
        for _ in range(calls):
            k, v = call(kv, weight, eps, cos_sin, positions, k_out=k, v_out=v)
        return k, v
    return jax.jit(run, donate_argnums=(5, 6))


def _copy_chain(calls: int):
    def run(x):
        for _ in range(calls):
            x = jax.lax.optimization_barrier(-x)
        return x
    return jax.jit(run, donate_argnums=0)


def _wall_per_call(step, state, calls: int, jits: int, repeats: int) -> float:
    state = step(*state)  # compile and warm up
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(jits):
            state = step(*state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) / (jits * calls))
    return statistics.median(times)


def _returning(call, calls: int):
    """``calls`` calls in one jit, each on its own positions (no two alike for XLA to merge),
    every output returned (none for XLA to drop)."""
    def run(kv, weight, eps, cos_sin, positions):
        return [call(kv, weight, eps, cos_sin, p) for p in positions]
    return jax.jit(run)


def _wall_per_returning_call(step, args, calls: int, jits: int, repeats: int) -> float:
    jax.block_until_ready(step(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(jits):
            outputs = step(*args)
        jax.block_until_ready(outputs)
        times.append((time.perf_counter() - start) / (jits * calls))
    return statistics.median(times)


def measure(n_layers, config, total_ctx) -> dict:
    """Seconds per call: each lowering with every output returned, the Triton lowering also
    chained through donated outputs (Mosaic GPU's outputs alias nothing, so a chain of its
    calls leaves all but the last unread, and XLA drops them), and the copies."""
    host = random_inputs(config, n_layers=n_layers, total_ctx=total_ctx, max_position=32768,
                         seed=total_ctx).arrays()
    inputs = [jax.device_put(a) for a in host]
    shape = config.output_shape(n_layers, total_ctx)
    calls = 64 if total_ctx <= 256 else 8
    jits, repeats = (5, 5) if total_ctx <= 4096 else (3, 3)
    rng = np.random.default_rng(total_ctx)
    positions = [jax.device_put(rng.permutation(host[4]).astype(np.int32)) for _ in range(calls)]
    kv, rest = inputs[0], inputs[1:]
    times = {}
    for lowering in LOWERINGS:
        call = functools.partial(fused_kv_norm_rope, **_static(config), lowering=lowering)
        try:
            times[lowering] = _wall_per_returning_call(
                _returning(call, calls), (kv, *rest[:3], positions), calls, jits, repeats)
        except Exception as error:  # one failing lowering must not hide the others
            times[lowering] = f"{type(error).__name__}: {str(error)[:120]}"
    call = functools.partial(fused_kv_norm_rope, **_static(config), lowering="triton")
    chained = _chained(call, calls)
    state = (jnp.full(shape, jnp.nan, kv.dtype), jnp.full(shape, jnp.nan, kv.dtype))
    times["triton chained"] = _wall_per_call(lambda k, v: chained(kv, *rest, k, v), state, calls,
                                             jits, repeats)
    copy = _copy_chain(calls)
    times["copy"] = _wall_per_call(lambda x: (copy(x),), (jnp.array(kv),), calls, jits, repeats)
    times["bytes"] = 2 * host[0].nbytes
    try:
        times["memcpy"] = times["bytes"] / copy_bytes_per_second(host[0].nbytes)
    except Exception as error:  # no torch with CUDA here: the in-jit copy stands alone
        times["memcpy"] = f"{type(error).__name__}"
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks-only", action="store_true")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"bench_jax_lowerings: no GPU (jax backend {jax.default_backend()!r}); nothing to run.")
        return 0
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    failures = 0
    if not args.no_checks:
        for n_layers, config, total_ctx, dtype in CHECKS:
            for lowering in LOWERINGS:
                try:
                    verdict = check(n_layers, config, total_ctx, dtype, lowering)
                except Exception as error:
                    verdict = f"ERROR {type(error).__name__}: {str(error)[:300]}"
                failures += not verdict.startswith("ok")
                print(f"check L{n_layers} h{config.num_kv_heads} d{config.head_dim} "
                      f"r{config.rotary_dim} {config.rope_style} T{total_ctx} {dtype} "
                      f"{lowering}: {verdict}", flush=True)
    if args.checks_only:
        return int(failures > 0)
    rows = []
    for name in args.shapes.split(","):
        n_layers, config = SHAPES[name]
        for total_ctx in map(int, args.sizes.split(",")):
            times = measure(n_layers, config, total_ctx)
            rows.append((name, total_ctx, times))
            print(name, total_ctx, {k: (f"{v * 1e6:.2f}us" if isinstance(v, float) else v)
                                     for k, v in times.items() if k != "bytes"}, flush=True)
    print("\n% copy: of the faster of the in-jit copy chain and torch's same-bytes device copy")
    columns = (*LOWERINGS, "triton chained")
    print("shape   tokens | " + " | ".join(f"{c + ' us (% copy)':>26}" for c in columns)
          + " | jit copy us  TB/s | memcpy us")
    for name, total_ctx, times in rows:
        memcpy = times["memcpy"] if isinstance(times["memcpy"], float) else float("inf")
        copy = min(times["copy"], memcpy)
        cells = [f"{times[c] * 1e6:16.2f} ({copy / times[c]:6.1%})" if isinstance(times[c], float)
                 else f"{'error':>26}" for c in columns]
        print(f"{name:6} {total_ctx:7} | " + " | ".join(f"{c:>26}" for c in cells)
              + f" | {times['copy'] * 1e6:11.2f} {times['bytes'] / times['copy'] / 1e12:5.2f}"
              f" | {memcpy * 1e6:9.2f}")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
