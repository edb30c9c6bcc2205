"""Where the decode-size latency goes: GPU clock state, programmatic dependent launch, kernel vs gaps.

``python -m benchmarks.latency_probe`` on the GPU (``PYTHONPATH=.``). For the draft shape at
16 and 256 tokens it times graph replay (i) right after the GPU sat idle, as the other
benchmarks' first rows do, (ii) right after ~300 ms of sustained copies (a busy GPU, as in
a serving loop), (iii) as (ii) with programmatic dependent launch; the SM clock is read
through NVML around each. Beside them: a trivial kernel of as many programs, the kernel's
own duration from the torch profiler, a small tile sweep, and the Pallas kernel's profiler
time idle and busy.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.language as tl

from benchmarks import bench_torch
from benchmarks.bench_torch import Case, input_sets, poison_and_check
from benchmarks.measure import DRAFT, N_LAYERS, graph_replay_seconds, input_sets_needed
from fusedkv_torch.kernel import launch


def sm_clock_mhz() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return str(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
    except Exception as error:  # no NVML: say so in the table
        return f"? ({type(error).__name__})"


_HEAT_SOURCE = None


def keep_busy(milliseconds: float = 300) -> None:
    global _HEAT_SOURCE
    if _HEAT_SOURCE is None:
        _HEAT_SOURCE = torch.empty(2**28, dtype=torch.uint8, device="cuda"), torch.empty(2**28, dtype=torch.uint8,
                                                                                     device="cuda")
    source, destination = _HEAT_SOURCE
    end = time.perf_counter() + milliseconds / 1e3
    while time.perf_counter() < end:
        for _ in range(20):
            destination.copy_(source)
        torch.cuda.synchronize()


def idle(seconds: float = 1.0) -> None:
    torch.cuda.synchronize()
    time.sleep(seconds)


@triton.jit
def _store_one_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def report(label: str, seconds: float, clock_before: str) -> None:
    print(f"{label:58s} {seconds * 1e6:8.3f} us   sm clock {clock_before} -> {sm_clock_mhz()} MHz", flush=True)


def probe_torch(total_ctx: int) -> None:
    case = Case(DRAFT, N_LAYERS, total_ctx)
    count = input_sets_needed(2 * case.kv_bytes())
    sets = input_sets(case, count)

    def caller(**options):
        def call(i):
            s = sets[i]
            launch(*s.args(), s.k_out, s.v_out, config=case.config, **options)
            return s.k_out, s.v_out
        return call

    print(f"-- torch, {total_ctx} tokens, {count} input sets; check {poison_and_check(case, sets, caller())}, "
          f"with PDL {poison_and_check(case, sets, caller(dependent_launch=True))}")
    for state, prepare in (("idle", idle), ("busy", keep_busy)):
        for pdl in (False, True):
            prepare()
            clock = sm_clock_mhz()
            report(f"graph replay after {state}, pdl={pdl}", graph_replay_seconds(caller(dependent_launch=pdl), count),
                   clock)
    out = torch.empty(1 << 16, device="cuda")
    programs = total_ctx * N_LAYERS * DRAFT.num_kv_heads
    keep_busy()
    clock = sm_clock_mhz()
    report(f"trivial kernel, {programs} one-warp programs, busy",
           graph_replay_seconds(lambda i: _store_one_kernel[(programs,)](out, num_warps=1), 1), clock)
    for tile in (dict(block_tokens=1, heads_per_program=1, num_warps=1),
                 dict(block_tokens=1, heads_per_program=2, num_warps=1),
                 dict(block_tokens=1, heads_per_program=4, num_warps=1),
                 dict(block_tokens=1, heads_per_program=8, num_warps=1),
                 dict(block_tokens=1, heads_per_program=8, num_warps=2),
                 dict(block_tokens=2, heads_per_program=8, num_warps=4)):
        for pdl in (False, True):
            keep_busy(100)
            clock = sm_clock_mhz()
            report(f"busy {tile} pdl={pdl}", graph_replay_seconds(caller(dependent_launch=pdl, **tile), count), clock)

    keep_busy()
    call = caller()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for i in range(400):
            call(i % count)
        torch.cuda.synchronize()
    for event in profile.key_averages():
        if "fused_kv" in event.key:
            device_us = getattr(event, "device_time", None) or getattr(event, "cuda_time", 0.0)
            print(f"{'kernel duration, eager launches, torch profiler':58s} {device_us:8.3f} us   "
                  f"({event.count} kernels)", flush=True)


def probe_jax(total_ctx: int) -> None:
    from benchmarks import bench_jax

    bench_jax._input_sets(total_ctx)
    for state, prepare in (("idle", idle), ("busy", keep_busy)):
        bench_jax.measure_kernel(total_ctx, 5, check=False)  # compiled and warm before the state
        prepare()
        clock = sm_clock_mhz()
        row = bench_jax.measure_kernel(total_ctx, 100, check=False)
        report(f"pallas {total_ctx} tokens after {state} ({row.method})", row.seconds, clock)


def main() -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"idle sm clock {sm_clock_mhz()} MHz")
    for total_ctx in (16, 256):
        probe_torch(total_ctx)
    for total_ctx in (16, 256):
        probe_jax(total_ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
