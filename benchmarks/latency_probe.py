"""Where the decode-size time goes, and what programmatic dependent launch (PDL) changes.

``python -m benchmarks.latency_probe`` on the GPU (``PYTHONPATH=.``), bf16 draft shape.

* decomposition at 16 and 256 tokens: the kernel beside three stand-ins with one program
  per (token, layer, head) and one warp each: a store of one float (launch and
  scheduling only), a copy of the K and V rows (one round trip to memory), and a
  position-then-cos/sin-row gather (the kernel's chain of two dependent round trips);
  each under graph replay over rotated input sets and as its duration in the torch
  profiler;
* the kernel under graph replay with and without PDL over tiles at 16, 256 and 4096
  tokens, and at 4096 do_bench beside graph replay (do_bench's time includes the gap
  between its start event and the kernel).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from benchmarks.bench_torch import Case, input_sets, poison_and_check
from benchmarks.measure import (DRAFT, N_LAYERS, copy_bytes_per_second, do_bench_seconds, graph_replay_seconds,
                                input_sets_needed)
from fusedkv_torch.kernel import launch


@triton.jit
def _store_one_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


@triton.jit
def _copy_rows_kernel(kv_ptr, k_ptr, v_ptr, total_ctx, N_LAYERS: tl.constexpr, NUM_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    head = pid % NUM_HEADS
    layer = (pid // NUM_HEADS) % N_LAYERS
    token = pid // (NUM_HEADS * N_LAYERS)
    dims = tl.arange(0, HEAD_DIM)
    row = kv_ptr + (token * N_LAYERS + layer) * (2 * NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims
    out = ((layer * total_ctx + token) * NUM_HEADS + head) * HEAD_DIM + dims
    k = tl.load(row)
    v = tl.load(row + NUM_HEADS * HEAD_DIM)
    tl.store(k_ptr + out, k)
    tl.store(v_ptr + out, v)


@triton.jit
def _gather_rows_kernel(positions_ptr, cos_sin_ptr, k_ptr, total_ctx, N_LAYERS: tl.constexpr,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid = tl.program_id(0)
    head = pid % NUM_HEADS
    layer = (pid // NUM_HEADS) % N_LAYERS
    token = pid // (NUM_HEADS * N_LAYERS)
    dims = tl.arange(0, HEAD_DIM)
    position = tl.load(positions_ptr + token)
    row = tl.load(cos_sin_ptr + position.to(tl.int64) * HEAD_DIM + dims)
    tl.store(k_ptr + ((layer * total_ctx + token) * NUM_HEADS + head) * HEAD_DIM + dims, row.to(tl.bfloat16))


def line(label: str, seconds: float, note: str = "") -> None:
    print(f"{label:64s} {seconds * 1e6:9.3f} us  {note}", flush=True)


def decomposition(total_ctx: int) -> None:
    case = Case(DRAFT, N_LAYERS, total_ctx)
    count = input_sets_needed(2 * case.kv_bytes())
    sets = input_sets(case, count)
    programs = total_ctx * N_LAYERS * DRAFT.num_kv_heads
    scratch = torch.empty(programs, device="cuda")
    static = dict(N_LAYERS=N_LAYERS, NUM_HEADS=DRAFT.num_kv_heads, HEAD_DIM=DRAFT.head_dim)
    stand_ins = {
        "store one float": lambda i: _store_one_kernel[(programs,)](scratch, num_warps=1),
        "copy K and V rows": lambda i: _copy_rows_kernel[(programs,)](
            sets[i].kv, sets[i].k_out, sets[i].v_out, total_ctx, **static, num_warps=1),
        "position then cos/sin row": lambda i: _gather_rows_kernel[(programs,)](
            sets[i].positions, sets[i].cos_sin_cache, sets[i].k_out, total_ctx, **static, num_warps=1),
        "kernel, default tile": lambda i: launch(*sets[i].args(), sets[i].k_out, sets[i].v_out,
                                                 config=DRAFT, dependent_launch=False),
        "kernel, default tile, PDL": lambda i: launch(*sets[i].args(), sets[i].k_out, sets[i].v_out,
                                                      config=DRAFT, dependent_launch=True),
    }
    print(f"-- {total_ctx} tokens, {programs} (token, layer, head) rows, {count} input sets")
    for label, call in stand_ins.items():
        line(f"graph replay: {label}", graph_replay_seconds(call, count))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for label, call in stand_ins.items():
            for i in range(300):
                call(i % count)
            torch.cuda.synchronize()
    for event in profile.key_averages():
        device_us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
        line(f"profiler duration: {event.key[:40]}", device_us * 1e-6, f"({event.count} kernels)")


def tiles(total_ctx: int, tile_list, methods=("graph",)) -> None:
    case = Case(DRAFT, N_LAYERS, total_ctx)
    count = max(2 if total_ctx >= 4096 else 1, input_sets_needed(2 * case.kv_bytes()))
    sets = input_sets(case, count)
    print(f"-- {total_ctx} tokens, {count} input sets")
    for tile in tile_list:
        for pdl in (False, True):
            options = dict(zip(("block_tokens", "heads_per_program", "num_warps"), tile or ()),
                           dependent_launch=pdl)

            def call(i):
                s = sets[i]
                launch(*s.args(), s.k_out, s.v_out, config=DRAFT, **options)
                return s.k_out, s.v_out

            check = poison_and_check(case, sets, call)
            for method in methods:
                if method == "graph":
                    seconds = graph_replay_seconds(call, count)
                else:
                    counter = iter(range(10**9))
                    seconds = do_bench_seconds(lambda: call(next(counter) % count))
                gbps = 2 * case.kv_bytes() / seconds / 1e9
                line(f"{method:8s} tile={tile or 'default'} pdl={pdl}", seconds, f"{gbps:6.0f} GB/s  {check}")


def pallas_steps(total_ctx: int, steps: int, **tile) -> str:
    """Quantiles of the per-step kernel durations of the Pallas kernel, from the jax profiler."""
    import functools
    import statistics
    import tempfile

    import jax
    import jax.numpy as jnp

    from benchmarks import bench_jax
    from fusedkv_jax import fused_kv_norm_rope as pallas_op

    _, device_sets = bench_jax._input_sets(total_ctx)
    step = jax.jit(functools.partial(pallas_op, num_kv_heads=DRAFT.num_kv_heads, head_dim=DRAFT.head_dim,
                                     rotary_dim=DRAFT.rotary_dim, rope_style=DRAFT.rope_style, **tile),
                   donate_argnames=("k_out", "v_out"))
    shape = DRAFT.output_shape(N_LAYERS, total_ctx)
    outputs = [[jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)] for _ in device_sets]

    def launch(i):
        state = outputs[i % len(outputs)]
        state[0], state[1] = step(*device_sets[i % len(device_sets)], k_out=state[0], v_out=state[1])
        return state

    jax.block_until_ready(launch(0))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        bench_jax._queue(launch, steps)
        jax.profiler.stop_trace()
        durations = [d * 1e-3 for _, d in bench_jax._gpu_kernel_events(trace_dir)]
    q = statistics.quantiles(durations, n=10)
    return (f"{len(durations)} kernels over {steps} steps ({len(device_sets)} sets): min {min(durations):.2f} "
            f"p10 {q[0]:.2f} median {statistics.median(durations):.2f} p90 {q[-1]:.2f} max {max(durations):.2f} us")


def probe_pallas() -> None:
    import jax

    print(f"jax {jax.__version__}")
    for total_ctx, tiles_here in ((16, [{}, dict(block_tokens=1, block_heads=8, num_warps=4),
                                        dict(block_tokens=1, block_heads=1, num_warps=1),
                                        dict(block_tokens=1, block_heads=2, num_warps=1)]),
                                  (256, [{}, dict(block_tokens=2, block_heads=8, num_warps=4),
                                         dict(block_tokens=4, block_heads=8, num_warps=8),
                                         dict(block_tokens=2, block_heads=8, num_warps=8)])):
        for steps in (10, 100):
            for tile in tiles_here:
                print(f"pallas {total_ctx:4d} tokens {str(tile or 'default'):58s} "
                      f"{pallas_steps(total_ctx, steps, **tile)}", flush=True)


def main() -> int:
    if "--pallas" in sys.argv:
        probe_pallas()
        return 0
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    copy_rate = copy_bytes_per_second()
    print(f"copy ceiling {copy_rate / 1e9:.0f} GB/s; 85% = {0.85 * copy_rate / 1e9:.0f} GB/s")
    for total_ctx in (16, 256):
        decomposition(total_ctx)
    tiles(16, [None, (1, 1, 2), (2, 1, 1), (1, 2, 1)])
    tiles(256, [None, (2, 8, 2), (2, 8, 4), (4, 8, 4), (4, 8, 8), (8, 8, 8), (1, 4, 1), (2, 4, 2)])
    tiles(4096, [None, (1, 8, 4), (2, 8, 4), (4, 8, 8)], methods=("do_bench", "graph"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
