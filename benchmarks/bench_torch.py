"""Device time of the Triton kernel on a GPU, beside plain PyTorch math (eager and compiled) and the copy ceiling.

``python -m benchmarks.bench_torch [--quick] [--sections draft,floor,baselines,variants,host,sweep,alternated] [--json PATH]``
from the tree (``PYTHONPATH=.``). Rows, all bf16 unless named:

* ``draft``: the draft shape (5 layers, 8 KV heads, head_dim 128, neox) at 16, 256, 4096
  and 32768 tokens: the kernel under CUDA-graph replay (device time without host launch
  gaps; at 16 and 256 tokens also without programmatic dependent launch) and as an
  eager call (do_bench, which also counts the gap between its start event and the
  kernel), and the paged-cache variant (bf16 and fp8 caches);
* ``floor``: at 16 and 256 tokens, what bounds a call from below under the same graph
  replay: an empty launch of the kernel's grid, a device copy of the same bytes, and
  the position-then-cos/sin-row chain alone;
* ``baselines``: plain PyTorch reference math, eager and under ``torch.compile``;
* ``variants`` at 4096 and 32768 tokens: head_dim 256, rotary_dim 64 of 128, gptj, 1 and 8 layers;
* ``host``: host time per call at 16 tokens, broken down: the public calls, ``launch()``
  launching directly and through Triton's ``kernel[grid]``, the compiled kernel's own
  launcher alone (the floor), the registered custom op, and a five-argument kernel
  launched through ``kernel[grid]`` as a yardstick;
* ``alternated``: candidate tiles at 16, 256 and 512 tokens under graph replay, in
  alternation over four rounds (their differences are within one run's spread);
* ``sweep``: (block_tokens, block_heads, num_warps) tiles: graph replay at 16 and
  256 tokens, do_bench at 4096 and 32768, head_dim 256 at 4096, the fp8 cache.

Inputs are random (kv gaussian, positions uniform over the cos/sin table), outputs are
poisoned with NaN before the first run, every output element is checked written and a
sample of token rows is compared with the interop reference. Sizes whose working set
fits in L2 rotate over several input sets. Bandwidth counts bytes read plus written
(``2 * kv.nbytes`` for the op), next to a device copy measured in the same run. One
failing configuration prints an error row and the run goes on; a short table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from benchmarks.measure import DRAFT, N_LAYERS, Row, format_table, guarded
from fusedkv_torch import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_torch import kernel as kernel_module
from fusedkv_torch.kernel import default_tile, launch
from interop.core.arrays import as_numpy
from interop.bench.baselines import torch_reference_math
from interop.bench.check import checked_rows, op_verdict, verdict
from interop.bench.shapes import BenchShape
from interop.bench.timers import (
    copy_bytes_per_second,
    do_bench_seconds,
    graph_replay_seconds,
    host_seconds_per_call,
)
from interop.bench.workload import Workload, input_sets_needed
from interop.core.reference import fused_kv_norm_rope_into_cache_reference
from interop.core.spec import FusedKVConfig

SIZES = (16, 256, 4096, 32768)
GRAPH_SIZES = (16, 256)
SWEEP_SIZES = (4096, 32768)
DEVICE = "cuda"


@dataclasses.dataclass(frozen=True)
class Case:
    config: FusedKVConfig
    n_layers: int
    total_ctx: int
    dtype: str = "bfloat16"

    @property
    def shape(self) -> BenchShape:
        return BenchShape("case", self.config, self.n_layers, "-")

    def static(self) -> dict:
        return self.shape.static()

    def kv_bytes(self) -> int:
        return self.shape.kv_nbytes(self.total_ctx, self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclasses.dataclass
class InputSet:
    """One call's device arguments and its preallocated outputs."""

    kv: torch.Tensor
    k_norm_weight: torch.Tensor
    eps: torch.Tensor
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.kv, self.k_norm_weight, self.eps, self.cos_sin_cache, self.positions)


def input_sets(case: Case, count: int, seed: int = 0) -> list[InputSet]:
    """Random device inputs (``fusedkv bench``'s, generated on the GPU), each with its outputs."""
    workload = Workload(case.shape, case.total_ctx, case.dtype, framework="torch", seed=seed, set_count=count,
                        torch_device=DEVICE)
    shape = case.config.output_shape(case.n_layers, case.total_ctx)
    return [InputSet(*workload.op_args(i, "torch"), torch.empty(shape, dtype=case.torch_dtype, device=DEVICE),
                     torch.empty(shape, dtype=case.torch_dtype, device=DEVICE)) for i in range(count)]


def sampled_host_args(inputs: InputSet, rows: np.ndarray) -> list[np.ndarray]:
    """The op's arguments on the host for the sampled token rows only (kv can be GBs)."""
    index = torch.as_tensor(rows, device=DEVICE)
    return [as_numpy(inputs.kv.index_select(0, index)), as_numpy(inputs.k_norm_weight), as_numpy(inputs.eps),
            as_numpy(inputs.cos_sin_cache), as_numpy(inputs.positions.index_select(0, index))]


def poison_and_check(case: Case, sets: list[InputSet], call) -> str:
    for s in sets[:1]:
        s.k_out.fill_(float("nan"))
        s.v_out.fill_(float("nan"))
    k, v = call(0)
    return op_verdict(k, v, *sets[0].args(), static=case.static())


def time_call(call, count: int, method: str) -> float:
    counter = itertools.count()
    if method == "graph":
        return graph_replay_seconds(call, count)
    return do_bench_seconds(lambda: call(next(counter) % count))


def tile_label(case: Case, tile: dict | None) -> str:
    block, heads, warps = default_tile(case.total_ctx, case.config.num_kv_heads, case.config.head_dim)
    tile = tile or {}
    label = (f"bt={tile.get('block_tokens', block)},bh={tile.get('block_heads', heads)},"
             f"nw={tile.get('num_warps', warps)}")
    if tile.get("dependent_launch") is False:
        label += ",no PDL"
    return label if set(tile) - {"dependent_launch"} else f"default {label}"


def input_set_count(case: Case, method: str) -> int:
    # Graph replay repeats calls back to back: two sets at least, so no call finds its kv in L2.
    return max(2 if method == "graph" else 1, input_sets_needed(2 * case.kv_bytes()))


def measure_kernel(case: Case, method: str, *, name: str = "triton", tile: dict | None = None,
                   check: bool = True) -> Row:
    """The public call, or with ``tile`` (launch options) :func:`launch`, timed by ``method``."""
    count = input_set_count(case, method)
    sets = input_sets(case, count)
    config = case.config

    if tile:
        def call(i):
            s = sets[i]
            launch(*s.args(), s.k_out, s.v_out, config=config, **tile)
            return s.k_out, s.v_out
    else:
        def call(i):
            s = sets[i]
            return fused_kv_norm_rope(*s.args(), **case.static(), k_out=s.k_out, v_out=s.v_out)

    result = poison_and_check(case, sets, call) if check else "-"
    seconds = time_call(call, count, method)
    return Row(name, case.total_ctx, tile_label(case, tile), seconds, 2 * case.kv_bytes(), method,
               count, result)


_compiled_math = torch.compile(torch_reference_math)


def measure_math(case: Case, *, compiled: bool) -> Row:
    count = input_sets_needed(2 * case.kv_bytes())
    sets = input_sets(case, count)
    math_fn = _compiled_math if compiled else torch_reference_math

    def call(i):
        return math_fn(*sets[i].args(), config=case.config)

    result = op_verdict(*call(0), *sets[0].args(), static=case.static())
    seconds = time_call(call, count, "do_bench")
    name = "torch math (compile)" if compiled else "torch math (eager)"
    return Row(name, case.total_ctx, "-", seconds, 2 * case.kv_bytes(), "do_bench", count, result)


def measure_cache(case: Case, method: str, *, fp8: bool, tile: dict | None = None) -> Row:
    """The paged-cache variant: tokens scattered over a cache of twice as many slots."""
    count = input_sets_needed(2 * case.kv_bytes())
    sets = input_sets(case, count)
    num_slots = 2 * case.total_ctx
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    slots = [torch.randperm(num_slots, generator=generator, device=DEVICE)[:case.total_ctx] for _ in sets]
    cache_dtype = torch.float8_e4m3fn if fp8 else case.torch_dtype
    shape = case.config.output_shape(case.n_layers, num_slots)
    caches = [(torch.zeros(shape, dtype=cache_dtype, device=DEVICE),
               torch.zeros(shape, dtype=cache_dtype, device=DEVICE)) for _ in sets]
    scales = {}
    if fp8:
        scales = dict(k_scale=torch.full((case.n_layers,), 0.02, device=DEVICE),
                      v_scale=torch.full((case.n_layers,), 0.03, device=DEVICE))

    if tile:
        def call(i):
            launch(*sets[i].args(), *caches[i], config=case.config, cache_loc=slots[i], **scales, **tile)
    else:
        def call(i):
            fused_kv_norm_rope_into_cache(*sets[i].args(), slots[i], *caches[i], **case.static(), **scales)

    call(0)
    torch.cuda.synchronize()
    # The sampled tokens' cache rows, against the reference writing them into a compact cache.
    rows = checked_rows(case.total_ctx)
    sampled_slots = slots[0].index_select(0, torch.as_tensor(rows, device=DEVICE))
    compact = np.zeros((case.n_layers, len(rows), case.config.num_kv_heads, case.config.head_dim),
                       as_numpy(caches[0][0][:1, :1]).dtype)
    expected_k, expected_v = fused_kv_norm_rope_into_cache_reference(
        *sampled_host_args(sets[0], rows), np.arange(len(rows)), compact, compact,
        **case.static(), **{k: as_numpy(v) for k, v in scales.items()})
    check = verdict(caches[0][0].index_select(1, sampled_slots), caches[0][1].index_select(1, sampled_slots),
                    expected_k, expected_v)
    seconds = time_call(call, count, method)
    written = case.kv_bytes() // (2 if fp8 else 1)
    name = "triton cache fp8" if fp8 else "triton cache"
    return Row(name, case.total_ctx, tile_label(case, tile), seconds, case.kv_bytes() + written, method,
               count, check)


@triton.jit
def _copy_rows_kernel(source_ptr, destination_ptr, columns, source_stride, destination_stride,
                      BLOCK: tl.constexpr):
    # The host-overhead yardstick: a simple kernel of five runtime arguments, one row per program.
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    values = tl.load(source_ptr + row * source_stride + offsets, mask=offsets < columns)
    tl.store(destination_ptr + row * destination_stride + offsets, values, mask=offsets < columns)


HOST_WAYS = ("public call", "public, allocating", "public, into cache", "launch()", "launch(), kernel[grid]",
             "compiled launcher alone", "custom op", "yardstick: 5-argument kernel[grid]")


def measure_host_overhead(case: Case, way: str) -> Row:
    """Host time per call of one way to launch, at a size where the kernel is shorter than it.

    ``launch(), kernel[grid]`` is Triton's own launch path (direct launches off);
    ``compiled launcher alone`` calls the compiled kernel's launcher with every argument
    ready, the floor under the other ways; the yardstick is a simple kernel of five
    runtime arguments launched through ``kernel[grid]``.
    """
    count = input_sets_needed(2 * case.kv_bytes())
    sets = input_sets(case, count)
    static, config = case.static(), case.config
    slots = torch.arange(case.total_ctx, device=DEVICE)
    caches = [torch.empty(config.output_shape(case.n_layers, case.total_ctx), dtype=case.torch_dtype,
                          device=DEVICE) for _ in range(2)]

    def public(i):
        s = sets[i]
        return fused_kv_norm_rope(*s.args(), **static, k_out=s.k_out, v_out=s.v_out)

    def allocating(i):
        return fused_kv_norm_rope(*sets[i].args(), **static)

    def into_cache(i):
        return fused_kv_norm_rope_into_cache(*sets[i].args(), slots, *caches, **static)

    def bare(i):
        s = sets[i]
        launch(*s.args(), s.k_out, s.v_out, config=config)

    def custom_op(i):
        s = sets[i]
        torch.ops.fusedkv.write_fused_kv_norm_rope(*s.args(), s.k_out, s.v_out, config.num_kv_heads,
                                                   config.head_dim, config.rotary_dim, config.rope_style)

    def yardstick(i):
        s = sets[i]
        _copy_rows_kernel[(case.total_ctx * case.n_layers,)](
            s.kv, s.v_out, config.kv_size, s.kv.stride(1), config.kv_size,
            BLOCK=triton.next_power_of_2(config.kv_size))

    def timed(call) -> Row:
        return Row(f"host: {way}", case.total_ctx, "-", host_seconds_per_call(call, count), 0, "host wall",
                   count)

    if way == "launch(), kernel[grid]":
        kernel_module._launcher.direct = False
        try:
            return timed(bare)
        finally:
            kernel_module._launcher.direct = True
    if way == "compiled launcher alone":
        return timed(compiled_launcher_alone(case, sets[0]))
    return timed(dict(zip(HOST_WAYS, (public, allocating, into_cache, bare, None, None, custom_op,
                                      yardstick)))[way])


def compiled_launcher_alone(case: Case, inputs: InputSet):
    """A call of the compiled kernel's own launcher with every argument ready, as a direct launch makes it."""
    tensors = (inputs.kv, inputs.k_norm_weight, inputs.eps, inputs.cos_sin_cache, inputs.positions, None,
               inputs.k_out, inputs.v_out, None, None)
    for _ in range(2):  # the first compiles through kernel[grid], the second launches directly
        launch(*inputs.args(), inputs.k_out, inputs.v_out, config=case.config)
    grid, constexprs, num_warps, launch_pdl = kernel_module._plan(
        case.config, case.total_ctx, case.n_layers, False, False, False, None, None, None,
        kernel_module.supports_dependent_launch(inputs.kv.device))
    signature = (constexprs, num_warps, launch_pdl,
                 *[None if t is None else (t.dtype, t.get_device()) for t in tensors])
    run, function, metadata = next(iter(kernel_module._launcher._by_signature[signature].values()))
    args = ([None if t is None else t.data_ptr() for t in tensors]
            + [case.total_ctx, inputs.cos_sin_cache.shape[0], case.total_ctx]
            + [*inputs.kv.stride(), *inputs.k_norm_weight.stride(), *inputs.eps.stride(),
               *inputs.cos_sin_cache.stride(), *inputs.positions.stride(), 0, 0, 0, *inputs.k_out.stride(),
               *inputs.v_out.stride()]
            + list(constexprs))
    stream = torch.cuda.current_stream().cuda_stream

    def call(i):
        run(grid, 1, 1, stream, function, metadata, None, None, None, *args)
    return call


# (block_tokens, block_heads, num_warps) per size, around the defaults (see
# fusedkv_torch.kernel.default_tile); [32, 1, 128] tiles of 4 warps were the
# defaults in the first session.
SWEEP_TILES = {
    16: [(1, 1, 1), (1, 2, 1), (1, 1, 2), (1, 8, 2), (2, 1, 1)],
    256: [(4, 1, 1), (1, 4, 1), (1, 8, 2), (2, 8, 2), (2, 8, 4), (4, 8, 4), (4, 8, 8)],
    4096: [(1, 8, 1), (1, 8, 2), (1, 8, 4), (2, 8, 2), (2, 8, 4), (4, 8, 4), (8, 4, 4), (32, 1, 4)],
}
SWEEP_TILES[32768] = SWEEP_TILES[4096]
QUICK_SWEEP_TILES = {16: [(1, 1, 1), (1, 8, 2)], 256: [(4, 1, 1), (1, 8, 2)],
                     4096: [(1, 8, 2), (2, 8, 4), (32, 1, 4)], 32768: [(1, 8, 2), (2, 8, 4), (32, 1, 4)]}
HD256 = FusedKVConfig(8, 256, 256, "neox")
HD256_TILES = [(1, 8, 2), (1, 8, 4), (2, 8, 4), (2, 8, 8), (16, 1, 8)]
FP8_TILES = [(1, 8, 1), (1, 8, 2), (1, 8, 4), (2, 8, 4)]


def as_tile(block_tokens: int, block_heads: int, num_warps: int) -> dict:
    return dict(block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps)


VARIANTS = (
    ("hd256", FusedKVConfig(8, 256, 256, "neox"), N_LAYERS),
    ("rotary 64/128", FusedKVConfig(8, 128, 64, "neox"), N_LAYERS),
    ("gptj", FusedKVConfig(8, 128, 128, "gptj"), N_LAYERS),
    ("1 layer", DRAFT, 1),
    ("8 layers", DRAFT, 8),
)


def draft_rows(run, quick: bool) -> None:
    for total_ctx in SIZES:
        case = Case(DRAFT, N_LAYERS, total_ctx)
        method = "graph" if total_ctx in GRAPH_SIZES else "do_bench"
        run("triton", case, lambda: measure_kernel(case, "graph"))
        if total_ctx in GRAPH_SIZES:
            run("triton, no PDL", case, lambda: measure_kernel(case, "graph", name="triton, no PDL",
                                                               tile=dict(dependent_launch=False)))
        run("triton", case, lambda: measure_kernel(case, "do_bench"))
        for fp8 in (False, True):
            run("triton cache", case, lambda: measure_cache(case, method, fp8=fp8))


@triton.jit
def _store_one_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


@triton.jit
def _gather_cos_sin_rows_kernel(positions_ptr, cos_sin_ptr, out_ptr, ROW: tl.constexpr):
    # The kernel's dependent chain alone: a token's position, then its cos/sin row.
    token = tl.program_id(0)
    columns = tl.arange(0, ROW)
    position = tl.load(positions_ptr + token).to(tl.int64)
    tl.store(out_ptr + token * ROW + columns, tl.load(cos_sin_ptr + position * ROW + columns))


FLOOR_WAYS = ("empty launch of the kernel's grid", "device copy of kv (same bytes)", "position, then cos/sin row")


def measure_floor(case: Case, way: str) -> Row:
    """What bounds a decode-size call from below, under the kernel's own graph-replay method.

    An empty launch of as many one-warp programs as the kernel's default grid (launch and
    scheduling alone); a device copy of kv into a buffer of its size (the op's bytes, read
    and written, by torch's copy); and one program per token loading its position, then
    its cos/sin row (the kernel's chain of two dependent reads), over rotated inputs.
    """
    count = input_set_count(case, "graph")
    sets = input_sets(case, count)
    programs = kernel_module._plan(case.config, case.total_ctx, case.n_layers, False, False, False, None, None,
                                   None, False)[0]
    scratch = torch.empty(programs, device=DEVICE)
    copies = [torch.empty_like(s.kv) for s in sets]
    rows = [torch.empty_like(s.cos_sin_cache[:case.total_ctx]) for s in sets]
    calls = {
        FLOOR_WAYS[0]: lambda i: _store_one_kernel[(programs,)](scratch, num_warps=1),
        FLOOR_WAYS[1]: lambda i: copies[i].copy_(sets[i].kv),
        FLOOR_WAYS[2]: lambda i: _gather_cos_sin_rows_kernel[(case.total_ctx,)](
            sets[i].positions, sets[i].cos_sin_cache, rows[i], ROW=case.config.rotary_dim, num_warps=1),
    }
    bytes_moved = 2 * case.kv_bytes() if way == FLOOR_WAYS[1] else 0
    return Row(f"floor: {way}", case.total_ctx, f"{programs} programs" if way == FLOOR_WAYS[0] else "-",
               graph_replay_seconds(calls[way], count), bytes_moved, "graph", count)


def floor_rows(run, quick: bool) -> None:
    for total_ctx in GRAPH_SIZES:
        case = Case(DRAFT, N_LAYERS, total_ctx)
        for way in FLOOR_WAYS:
            run(f"floor: {way}", case, lambda: measure_floor(case, way))


def baseline_rows(run, quick: bool) -> None:
    for total_ctx in SIZES[::3] if quick else SIZES:
        case = Case(DRAFT, N_LAYERS, total_ctx)
        run("torch math (eager)", case, lambda: measure_math(case, compiled=False))
        run("torch math (compile)", case, lambda: measure_math(case, compiled=True))


def variant_rows(run, quick: bool) -> None:
    for label, config, n_layers in VARIANTS[:2] if quick else VARIANTS:
        for total_ctx in SWEEP_SIZES[:1] if quick else SWEEP_SIZES:
            case = Case(config, n_layers, total_ctx)
            run(f"triton {label}", case, lambda: measure_kernel(case, "do_bench", name=f"triton {label}"))


def host_rows(run, quick: bool) -> None:
    decode = Case(DRAFT, N_LAYERS, 16)
    for way in HOST_WAYS:
        run(f"host: {way}", decode, lambda: measure_host_overhead(decode, way))


def sweep_rows(run, quick: bool) -> None:
    tiles = QUICK_SWEEP_TILES if quick else SWEEP_TILES
    for total_ctx in GRAPH_SIZES + SWEEP_SIZES:
        case = Case(DRAFT, N_LAYERS, total_ctx)
        method = "graph" if total_ctx in GRAPH_SIZES else "do_bench"
        for tile in tiles[total_ctx]:
            run("triton sweep", case,
                lambda: measure_kernel(case, method, name="triton sweep", tile=as_tile(*tile)))
    hd256 = Case(HD256, N_LAYERS, SWEEP_SIZES[0])
    for tile in HD256_TILES[::3] if quick else HD256_TILES:
        run("triton hd256 sweep", hd256,
            lambda: measure_kernel(hd256, "do_bench", name="triton hd256 sweep", tile=as_tile(*tile)))
    for total_ctx in SWEEP_SIZES[1:] if quick else SWEEP_SIZES:
        case = Case(DRAFT, N_LAYERS, total_ctx)
        for tile in FP8_TILES[::2] if quick else FP8_TILES:
            run("triton cache fp8 sweep", case,
                lambda: measure_cache(case, "do_bench", fp8=True, tile=as_tile(*tile)))


# Candidate tiles at decode sizes, timed in alternation over rounds: their differences are
# within one run's spread, so a single sweep row cannot separate them.
ALTERNATED_TILES = {16: [(1, 1, 1), (2, 1, 1)], 256: [(1, 8, 2), (4, 8, 8), (2, 8, 4)],
                    512: [(1, 8, 2), (4, 8, 8), (2, 8, 4)]}
ROUNDS = 4


def alternated_rows(run, quick: bool) -> None:
    for round_ in range(2 if quick else ROUNDS):
        for total_ctx, tiles in ALTERNATED_TILES.items():
            case = Case(DRAFT, N_LAYERS, total_ctx)
            for tile in tiles:
                run(f"triton round {round_}", case, lambda: measure_kernel(
                    case, "graph", name=f"triton round {round_}", tile=as_tile(*tile), check=round_ == 0))


SECTIONS = dict(draft=draft_rows, floor=floor_rows, baselines=baseline_rows, variants=variant_rows,
                host=host_rows, sweep=sweep_rows, alternated=alternated_rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer variants and a smaller sweep")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; expected some of {list(SECTIONS)}")
    if not torch.cuda.is_available():
        print("bench_torch: no CUDA device; nothing to time.")
        return 0

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"draft shape: bf16, {N_LAYERS} layers, {DRAFT.num_kv_heads} KV heads, "
          f"head_dim {DRAFT.head_dim}, {DRAFT.rope_style}", flush=True)
    copy_rate = copy_bytes_per_second()
    print(f"copy ceiling: {copy_rate / 1e9:.0f} GB/s (1 GiB device copy, read+write, do_bench median)",
          flush=True)

    rows = {name: [] for name in sections}
    for name in sections:
        def run(label, case, measure, section_rows=rows[name]):
            section_rows.append(guarded(label, case.total_ctx, "-", measure))
            print(format_table(section_rows[-1:], copy_rate), flush=True)

        SECTIONS[name](run, args.quick)

    if args.json:
        with open(args.json, "w") as file:
            json.dump(dict(copy_bytes_per_second=copy_rate,
                           rows={name: [dataclasses.asdict(r) for r in section] for name, section in rows.items()}),
                      file, indent=1)
    if rows.get("sweep"):
        print("\n== sweep, best 5 per kind and size ==")
        ranked = []
        for kind in dict.fromkeys((r.name, r.total_ctx) for r in rows["sweep"]):
            timed = sorted((r for r in rows["sweep"] if (r.name, r.total_ctx) == kind and r.seconds),
                           key=lambda r: r.seconds)
            ranked += timed[:5]
        print(format_table(ranked, copy_rate))
    host = {r.name.removeprefix("host: "): r.seconds for r in rows.get("host", []) if r.seconds}
    if "compiled launcher alone" in host:
        floor = host["compiled launcher alone"]
        print("\n== host time above the compiled kernel's own launcher, per call at 16 tokens ==")
        for way, seconds in host.items():
            print(f"{way:40s} {seconds * 1e6:8.2f} us  (+{(seconds - floor) * 1e6:.2f} us)")
    if rows.get("alternated"):
        print("\n== alternated tiles: per-round graph-replay us, median ==")
        by_tile = {}
        for r in rows["alternated"]:
            by_tile.setdefault((r.total_ctx, r.tile), []).append(r.seconds * 1e6 if r.seconds else float("nan"))
        for (total_ctx, tile), values in by_tile.items():
            print(f"{total_ctx:6d}  {tile:18s} {' '.join(f'{v:6.2f}' for v in values)}   median "
                  f"{statistics.median(values):.2f}")
    summary = [r for name, section in rows.items() if name not in ("sweep", "alternated") for r in section]
    print(f"\n== fused KV norm+RoPE, torch/Triton: copy ceiling {copy_rate / 1e9:.0f} GB/s; bar: 85% of "
          f"copy ({0.85 * copy_rate / 1e9:.0f} GB/s) at 4096/32768, <=1.5 us at 16, <=4 us at 256 (graph) ==")
    print(format_table(summary, copy_rate))
    failed = [r for r in summary if r.error or r.check.startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
