"""Measurement shared by the benchmarks: rows and their table, L2 rotation, torch device timing.

What each timing means (METHOD.md):

* :func:`do_bench_seconds`: ``triton.testing.do_bench`` median; it clears the L2 cache
  before every call and times each call with CUDA events, so it is device time of a
  cold-cache call, plus any launch gap when the host cannot keep ahead.
* :func:`graph_replay_seconds`: many calls captured in one CUDA graph (rotating over
  input sets), the graph replayed and timed with events; per-call time with host
  launch overhead removed, the regime of a serving loop that replays graphs.
* :func:`host_seconds_per_call`: host wall time per call over a long loop; when the
  kernel is shorter than the host work this is the Python + launch overhead.
* :func:`copy_bytes_per_second`: the ceiling, a device-to-device copy of 1 GiB timed
  like do_bench, counting bytes read plus bytes written.

Rows and their table know nothing of torch, so the JAX benchmark can print the same.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
import traceback
from typing import Callable

from interop.spec import FusedKVConfig
from interop.tolerance import bit_mismatches, compare

# The draft every benchmark measures (DESIGN.md section 4): a 5-layer draft of a
# Qwen3-8B-sized target, bf16, positions below 32768.
DRAFT = FusedKVConfig(num_kv_heads=8, head_dim=128, rotary_dim=128, rope_style="neox")
N_LAYERS = 5
MAX_POSITION = 32768
DRAFT_STATIC = dict(num_kv_heads=DRAFT.num_kv_heads, head_dim=DRAFT.head_dim,
                    rotary_dim=DRAFT.rotary_dim, rope_style=DRAFT.rope_style)

L2_BYTES = 60 * 2**20  # H200
# Rotate inputs until the working set is about twice the L2 cache.
ROTATION_BYTES = 2 * L2_BYTES
MAX_INPUT_SETS = 64
COPY_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration; ``error`` set when it failed."""

    name: str
    total_ctx: int
    tile: str
    seconds: float | None
    bytes_moved: int
    method: str
    input_sets: int = 1
    check: str = "-"
    error: str = ""

    def gbps(self) -> float | None:
        return None if not self.seconds else self.bytes_moved / self.seconds / 1e9


def verdict(k, v, k_expected, v_expected, *, v_exact: bool = True) -> str:
    """A row's check column: ``'ok'``, or ``'FAIL: '`` and the worst K element or V's count.

    K is held to the tolerance table; V bit for bit, or (``v_exact`` False, for an fp8
    cache the GPU quantizes with its own division) to the table too.
    """
    k_result = compare(k, k_expected)
    v_bad = bit_mismatches(v, v_expected)[0] if v_exact else compare(v, v_expected, name="v").n_bad
    if k_result.ok and not v_bad:
        return "ok"
    return "FAIL: " + (k_result.report() if not k_result.ok else f"v: {v_bad} elements differ")


def input_sets_needed(bytes_per_set: int) -> int:
    """How many input sets to rotate so repeated calls do not just measure the L2 cache."""
    return max(1, min(MAX_INPUT_SETS, math.ceil(ROTATION_BYTES / max(1, bytes_per_set))))


def guarded(name: str, total_ctx: int, tile: str, measure: Callable[[], Row]) -> Row:
    """``measure()``, or an error row (traceback on stderr) so one failure does not end the run."""
    try:
        return measure()
    except Exception as error:  # a benchmark reports every failure and goes on
        traceback.print_exc(file=sys.stderr)
        return Row(name, total_ctx, tile, None, 0, "-", error=f"{type(error).__name__}: {error}")


def format_table(rows: list[Row], copy_bytes_per_second: float) -> str:
    header = ("impl", "tokens", "config", "us", "GB/s", "of copy", "method", "sets", "check")
    lines = [header]
    for row in rows:
        if row.error:
            lines.append((row.name, str(row.total_ctx), row.tile, "ERROR", "-", "-", "-", "-",
                          row.error[:100]))
            continue
        gbps = row.gbps()
        bandwidth = (f"{gbps:.0f}", f"{gbps * 1e9 / copy_bytes_per_second:.0%}") if row.bytes_moved else ("-", "-")
        lines.append((row.name, str(row.total_ctx), row.tile, f"{row.seconds * 1e6:.2f}", *bandwidth,
                      row.method, str(row.input_sets), row.check))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def do_bench_seconds(fn: Callable[[], object], *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3


def graph_replay_seconds(call: Callable[[int], object], input_sets: int, *, calls_per_graph: int = 64,
                         replays: int = 20) -> float:
    """Median per-call device time of ``call(i)`` (i cycles over input sets) replayed from a CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture, as capture requires
        for i in range(min(input_sets, 3)):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls_per_graph):
            call(i % input_sets)
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / calls_per_graph)
    return statistics.median(per_call)


def host_seconds_per_call(call: Callable[[int], object], input_sets: int, *, calls: int = 2000) -> float:
    """Host wall time per call of a long loop of ``call(i)``, synchronized only at its ends."""
    import torch

    for i in range(min(input_sets, 3)):
        call(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        call(i % input_sets)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls


def copy_bytes_per_second(nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth, bytes read plus written per second (do_bench median)."""
    import torch

    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    return 2 * nbytes / do_bench_seconds(lambda: destination.copy_(source))
