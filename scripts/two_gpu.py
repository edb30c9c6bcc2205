"""fusedkv on two GPUs, each with its share of the work, checked against one GPU.

Run from the tree on a machine with two GPUs (nothing installed; ``$OUT`` when set, else
``/tmp/fusedkv-two-gpu``, receives ``two_gpu.json``)::

    PYTHONPATH=. python3 scripts/two_gpu.py [--quick]

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
set here before either framework starts). With fewer than two GPUs it says so and exits 0.
Draft shape throughout: 5 layers, 8 KV heads, head_dim 128, neox, bf16.

* PyTorch, two NCCL ranks (one process per GPU): each builds its ``FusedKVMaterializer``
  from its four heads (``interop.core.materializer.head_parallel_layers``) and writes its
  own paged caches through ``materialize_into_cache`` at 8192 tokens (hidden 4096).
  Checks: each rank's cache slots against the reference on its own projection (a sample
  of tokens; K by the tolerance table, V bit for bit), slots not addressed left
  untouched, and the ranks' heads, gathered over NCCL on rank 0 (for this check only),
  against the one-GPU materializer (END_TO_END_TOLERANCE: the GEMM over half the columns
  may round otherwise; whether they are bitwise equal is printed). Time: CUDA-graph
  replay, both ranks at once, each rank's time against half the one-GPU time.
* JAX, at 4096 and 32768 tokens: the op under ``jax.jit`` with ``kv`` and ``positions``
  split by tokens over both GPUs (Explicit and Auto mesh axes), and the op inside
  ``jax.shard_map`` (default settings) with each GPU its four heads. Checks: equal to
  the one-GPU call bit for bit (and, at 4096, to the reference), the compiled program
  free of collectives, the outputs split as asked. Time: device time per GPU from the
  profiler (``interop.bench.timers.gpu_kernel_events``), against an XLA pass over the
  same bytes on the same GPU (its kv share read and written) and against half the
  one-GPU time.
* The JAX materializer over heads (``fusedkv_jax.sharding.head_parallel_materializer``,
  ``materialize`` and ``materialize_into_cache`` inside ``jax.shard_map``) against the
  one-GPU materializer, as for the torch ranks.

Exit status 1 if any check failed.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
# torch and jax share the GPUs: stop XLA from taking 75% of each up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402  (the environment above must be set before torch and jax start)
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from interop.core.arrays import as_numpy, numpy_dtype  # noqa: E402
from interop.bench.shapes import DRAFT_SHAPE, MAX_POSITION  # noqa: E402
from interop.bench.timers import gpu_kernel_events, graph_replay_seconds  # noqa: E402
from interop.core.materializer import head_parallel_layers, stacked_op_arrays  # noqa: E402
from interop.testing import random_case  # noqa: E402
from interop.core.reference import fused_kv_norm_rope_reference  # noqa: E402
from interop.testing import END_TO_END_TOLERANCE, bit_mismatches, compare, random_inputs  # noqa: E402

DRAFT, N_LAYERS, DRAFT_STATIC = DRAFT_SHAPE.config, DRAFT_SHAPE.n_layers, DRAFT_SHAPE.static()
WORLD_SIZE = 2
HIDDEN = 4096
TORCH_TOKENS = 8192
NUM_SLOTS = 65536
JAX_SIZES = (4096, 32768)
MATERIALIZER_TOKENS, MATERIALIZER_SLOTS = 4096, 8192
CHECKED_TOKENS = 256
REFERENCE_LIMIT = 4096  # the NumPy reference of a whole call above this is slow
BF16 = numpy_dtype("bfloat16")


def _equal_to_one_gpu(name, got, one_gpu, *, exact: bool) -> dict:
    """A check's record: bitwise equality, and (``exact`` False) the END_TO_END comparison."""
    got, one_gpu = as_numpy(got), as_numpy(one_gpu)
    differing, first = bit_mismatches(got, one_gpu)
    record = {"check": name, "bitwise_equal": differing == 0, "elements_differing": differing}
    if exact:
        record["ok"] = differing == 0
        if differing:
            record["first_difference"] = str(first)
    else:
        comparison = compare(got, one_gpu, name=name, tolerance=END_TO_END_TOLERANCE)
        record.update(ok=comparison.ok, report=comparison.report())
    return record


def _against_reference(name, k, v, k_expected, v_expected) -> dict:
    k_result = compare(k, k_expected, name=f"{name} k")
    v_differing = bit_mismatches(v, v_expected)[0]
    return {"check": name, "ok": k_result.ok and not v_differing, "k": k_result.report(),
            "v_elements_differing": v_differing}


# PyTorch: two NCCL ranks.

def _torch_rank(rank: int, init_method: str, out_dir: str, quick: bool) -> None:
    """One rank; writes its checks to ``torch_rank{rank}.json``, rank 0 also the comparison and times."""
    import torch.distributed as dist

    from fusedkv_torch import FusedKVMaterializer
    from interop.exchange import to_torch

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=WORLD_SIZE)
    case = random_case(DRAFT, n_layers=N_LAYERS, hidden=HIDDEN, total_ctx=TORCH_TOKENS,
                       max_position=MAX_POSITION, seed=15)
    layers = [dataclasses.replace(layer, kv_proj_weight=to_torch(layer.kv_proj_weight).to(device),
                                  k_norm_weight=to_torch(layer.k_norm_weight).to(device))
              for layer in case.layers]
    ctx_hidden = to_torch(case.ctx_hidden).to(device)
    positions = to_torch(case.positions).to(device)
    cache_loc = torch.from_numpy(np.random.default_rng(16).permutation(NUM_SLOTS)[:TORCH_TOKENS]).to(device)
    addressed = torch.zeros(NUM_SLOTS, dtype=torch.bool, device=device)
    addressed[cache_loc] = True

    def pools(heads):
        shape = (N_LAYERS, NUM_SLOTS, heads, DRAFT.head_dim)
        return (torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device),
                torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device))

    def timed(materializer, k_pool, v_pool) -> float:
        return graph_replay_seconds(lambda i: materializer.materialize_into_cache(
            ctx_hidden, positions, cache_loc, k_pool, v_pool), 1, rep_ms=5 if quick else 20)

    local_heads = DRAFT.num_kv_heads // WORLD_SIZE
    share = FusedKVMaterializer(head_parallel_layers(layers, rank, WORLD_SIZE))
    share.reserve(TORCH_TOKENS)
    k_pool, v_pool = pools(local_heads)
    share.materialize_into_cache(ctx_hidden, positions, cache_loc, k_pool, v_pool)
    kv = share.project(ctx_hidden)[:CHECKED_TOKENS].cpu()
    local_static = dict(DRAFT_STATIC, num_kv_heads=local_heads)
    checks = []
    k_expected, v_expected = fused_kv_norm_rope_reference(
        kv, *stacked_op_arrays(case.layers), case.positions[:CHECKED_TOKENS], **local_static)
    slots = cache_loc[:CHECKED_TOKENS]
    checks.append(_against_reference(f"torch rank {rank}: its cache slots against the reference on its "
                                     f"own projection ({CHECKED_TOKENS} tokens)",
                                     k_pool[:, slots].cpu(), v_pool[:, slots].cpu(), k_expected, v_expected))
    written = int((~torch.isnan(k_pool[:, ~addressed])).sum() + (~torch.isnan(v_pool[:, ~addressed])).sum())
    checks.append({"check": f"torch rank {rank}: slots not addressed left untouched", "ok": written == 0,
                   "elements_written": written})

    with open(os.path.join(out_dir, f"torch_rank{rank}.json"), "w") as file:
        json.dump(checks, file)
    checks = []
    gathered = {}
    for name, pool in (("k", k_pool), ("v", v_pool)):
        parts = [torch.empty_like(pool[:, cache_loc]) for _ in range(WORLD_SIZE)]
        dist.all_gather(parts, pool[:, cache_loc].contiguous())
        gathered[name] = torch.cat(parts, dim=2)
    dist.barrier()
    rank_seconds = torch.tensor([timed(share, k_pool, v_pool)], device=device)
    all_seconds = [torch.empty_like(rank_seconds) for _ in range(WORLD_SIZE)]
    dist.all_gather(all_seconds, rank_seconds)
    del k_pool, v_pool, share

    if rank == 0:  # the one-GPU run, while rank 1 waits
        whole = FusedKVMaterializer(layers)
        whole.reserve(TORCH_TOKENS)
        k_pool, v_pool = pools(DRAFT.num_kv_heads)
        whole.materialize_into_cache(ctx_hidden, positions, cache_loc, k_pool, v_pool)
        for name, pool in (("k", k_pool), ("v", v_pool)):
            checks.append(_equal_to_one_gpu(f"torch: {name} slots of both ranks against one GPU",
                                            gathered[name].cpu(), pool[:, cache_loc].cpu(), exact=False))
        one_gpu = timed(whole, k_pool, v_pool)
        rank_times = [float(t) for t in all_seconds]
        result = {"tokens": TORCH_TOKENS, "one_gpu_seconds": one_gpu, "rank_seconds": rank_times,
                  "rank_over_half_one_gpu": [t / (one_gpu / 2) for t in rank_times], "checks": checks}
        with open(os.path.join(out_dir, "torch_ranks.json"), "w") as file:
            json.dump(result, file)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torch_section(quick: bool, out_dir: str) -> dict:
    import torch.multiprocessing as mp

    mp.spawn(_torch_rank, args=(f"tcp://127.0.0.1:{_free_port()}", out_dir, quick), nprocs=WORLD_SIZE)
    with open(os.path.join(out_dir, "torch_ranks.json")) as file:
        result = json.load(file)
    for rank in reversed(range(WORLD_SIZE)):
        with open(os.path.join(out_dir, f"torch_rank{rank}.json")) as file:
            result["checks"][:0] = json.load(file)
    print(f"\n== torch, {WORLD_SIZE} NCCL ranks, materialize_into_cache at {TORCH_TOKENS} tokens "
          f"(hidden {HIDDEN}), CUDA-graph replay ==")
    print(f"one GPU: {result['one_gpu_seconds'] * 1e6:.1f} us")
    for rank, (seconds, ratio) in enumerate(zip(result["rank_seconds"], result["rank_over_half_one_gpu"])):
        print(f"rank {rank}: {seconds * 1e6:.1f} us = {ratio:.2f} x half the one-GPU time")
    return result


# JAX: one process, both GPUs.

def _per_device_seconds(launch, steps: int, devices: int) -> tuple[list[float], str]:
    """Median device time of one step on each GPU (the profiler), else host wall time for all."""
    import jax

    jax.block_until_ready(launch())
    durations = []
    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            jax.profiler.start_trace(trace_dir)
        except Exception as error:  # no profiler here: wall time below
            print(f"profiler unavailable ({type(error).__name__}: {error})", file=sys.stderr)
        else:
            try:
                for _ in range(steps):
                    outputs = launch()
                jax.block_until_ready(outputs)
            finally:
                jax.profiler.stop_trace()
            durations = [[duration for _, duration in gpu_kernel_events(trace_dir, device)]
                         for device in range(devices)]
    if durations and all(durations):
        medians = []
        for device_durations in durations:
            per_step = max(1, len(device_durations) // steps)
            sums = [sum(device_durations[i:i + per_step]) * 1e-9
                    for i in range(0, per_step * steps, per_step)]
            medians.append(statistics.median(sums))
        return medians, f"profiler ({[len(d) // steps for d in durations]} kernels/step per GPU)"
    start = time.perf_counter()
    for _ in range(steps):
        outputs = launch()
    jax.block_until_ready(outputs)
    wall = (time.perf_counter() - start) / steps
    return [wall] * devices, "wall (profiler gave no GPU events)"


def _collectives(compiled) -> list[str]:
    import re

    return sorted(set(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)",
                                 compiled.as_text())))


def jax_section(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from fusedkv_jax import FusedKVMaterializer, fused_kv_norm_rope
    from fusedkv_jax.sharding import head_major_kv, head_parallel_materializer

    steps = 20 if quick else 100
    devices = jax.devices()[:WORLD_SIZE]
    local_static = dict(DRAFT_STATIC, num_kv_heads=DRAFT.num_kv_heads // WORLD_SIZE)
    call = jax.jit(functools.partial(fused_kv_norm_rope, **DRAFT_STATIC))
    negate = jax.jit(jnp.negative)
    rows, checks = [], []
    print(f"\n== jax {jax.__version__}, {devices[0].device_kind} x{WORLD_SIZE}: the op, draft shape ==")
    for total_ctx in JAX_SIZES:
        host = random_inputs(DRAFT, n_layers=N_LAYERS, total_ctx=total_ctx, max_position=MAX_POSITION,
                             seed=total_ctx).arrays()
        one_inputs = [jax.device_put(a, devices[0]) for a in host]
        k_one, v_one = (np.asarray(a) for a in call(*one_inputs))
        if total_ctx <= REFERENCE_LIMIT:
            checks.append(_against_reference(f"jax one GPU, {total_ctx} tokens: against the reference",
                                             k_one, v_one, *fused_kv_norm_rope_reference(*host, **DRAFT_STATIC)))
        (one_seconds,), _ = _per_device_seconds(lambda: call(*one_inputs), steps, 1)
        kv_bytes = host[0].nbytes

        def row(name, function, args, mesh, out_spec, kv_share):
            compiled = jax.jit(function).lower(*args).compile()
            k, v = compiled(*args)
            found = _collectives(compiled)
            checks.append({"check": f"jax {name}, {total_ctx} tokens: no collectives", "ok": not found,
                           "collectives": found})
            split = all(a.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 4) for a in (k, v))
            checks.append({"check": f"jax {name}, {total_ctx} tokens: outputs split as {out_spec}", "ok": split})
            for label, got, one in (("k", k, k_one), ("v", v, v_one)):
                checks.append(_equal_to_one_gpu(f"jax {name}, {total_ctx} tokens: {label} against one GPU",
                                                got, one, exact=True))
            seconds, method = _per_device_seconds(lambda: compiled(*args), steps, WORLD_SIZE)
            copy_seconds, _ = _per_device_seconds(lambda: negate(kv_share), steps, WORLD_SIZE)
            rows.append({"name": name, "tokens": total_ctx, "one_gpu_us": one_seconds * 1e6,
                         "per_gpu_us": [s * 1e6 for s in seconds],
                         "per_gpu_GBps": [kv_bytes / s / 1e9 for s in seconds],  # 2 * (kv / 2) per GPU
                         "of_same_bytes_copy": [c / s for c, s in zip(copy_seconds, seconds)],
                         "over_half_one_gpu": [s / (one_seconds / 2) for s in seconds], "method": method})

        for mode in ("explicit", "auto"):
            mesh = jax.make_mesh((WORLD_SIZE,), ("tokens",), axis_types=(getattr(AxisType, mode.title()),))
            specs = (P("tokens"), P(), P(), P(), P("tokens"))
            args = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(host, specs)]
            row(f"jit, tokens split ({mode} axes)", call, args, mesh, P(None, "tokens"), args[0])

        mesh = jax.make_mesh((WORLD_SIZE,), ("heads",), axis_types=(AxisType.Auto,))
        by_heads, whole = P(None, None, "heads"), P()
        kv = head_major_kv(host[0], num_kv_heads=DRAFT.num_kv_heads, head_dim=DRAFT.head_dim,
                           num_shards=WORLD_SIZE)
        args = [jax.device_put(kv, NamedSharding(mesh, by_heads)),
                *(jax.device_put(a, NamedSharding(mesh, whole)) for a in host[1:])]
        heads = jax.shard_map(functools.partial(fused_kv_norm_rope, **local_static), mesh=mesh,
                              in_specs=(by_heads, whole, whole, whole, whole), out_specs=by_heads)
        row("shard_map, heads split", heads, args, mesh, by_heads, args[0])

    print(f"\n== jax materializer over heads (shard_map), {MATERIALIZER_TOKENS} tokens ==")
    case = random_case(DRAFT, n_layers=N_LAYERS, hidden=HIDDEN, total_ctx=MATERIALIZER_TOKENS,
                       max_position=MAX_POSITION, seed=17)
    one_gpu = FusedKVMaterializer(case.layers)  # on jax's default device, the first GPU
    ctx_hidden, positions = jnp.asarray(case.ctx_hidden), jnp.asarray(case.positions)
    cache_loc = np.random.default_rng(18).permutation(MATERIALIZER_SLOTS)[:MATERIALIZER_TOKENS].astype(np.int32)
    cache_shape = (N_LAYERS, MATERIALIZER_SLOTS, DRAFT.num_kv_heads, DRAFT.head_dim)
    k_one, v_one = one_gpu.materialize(ctx_hidden, positions)
    k_cache_one, v_cache_one = one_gpu.materialize_into_cache(
        ctx_hidden, positions, jnp.asarray(cache_loc), jnp.zeros(cache_shape, jnp.bfloat16),
        jnp.zeros(cache_shape, jnp.bfloat16))
    mesh = jax.make_mesh((WORLD_SIZE,), ("heads",), axis_types=(AxisType.Auto,))
    materializer, specs = head_parallel_materializer(case.layers, mesh, "heads")
    by_heads = P(None, None, "heads")
    replicated = NamedSharding(mesh, P())
    materialize = jax.jit(jax.shard_map(lambda m, x, p: m.materialize(x, p), mesh=mesh,
                                        in_specs=(specs, P(), P()), out_specs=by_heads))
    into_cache = jax.jit(jax.shard_map(lambda m, x, p, s, kc, vc: m.materialize_into_cache(x, p, s, kc, vc),
                                       mesh=mesh, in_specs=(specs, P(), P(), P(), by_heads, by_heads),
                                       out_specs=by_heads), donate_argnums=(4, 5))
    args = (materializer, jax.device_put(case.ctx_hidden, replicated), jax.device_put(case.positions, replicated))
    k, v = materialize(*args)
    caches = [jax.device_put(np.zeros(cache_shape, BF16), NamedSharding(mesh, by_heads)) for _ in range(2)]
    k_cache, v_cache = into_cache(*args, jax.device_put(cache_loc, replicated), *caches)
    for label, got, one in (("k", k, k_one), ("v", v, v_one), ("k_cache", k_cache, k_cache_one),
                            ("v_cache", v_cache, v_cache_one)):
        checks.append(_equal_to_one_gpu(f"jax materializer over heads: {label} against one GPU",
                                        got, one, exact=False))
    return {"rows": rows, "checks": checks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and replays")
    parser.add_argument("--sections", default="torch,jax", help="comma-separated: torch, jax")
    args = parser.parse_args(argv)
    found = torch.cuda.device_count()
    if found < WORLD_SIZE:
        print(f"two_gpu.py needs {WORLD_SIZE} GPUs, found {found}: nothing run.")
        return 0
    out_dir = os.environ.get("OUT", "/tmp/fusedkv-two-gpu")
    os.makedirs(out_dir, exist_ok=True)
    sections = args.sections.split(",")
    report = {"environment": {name: os.environ.get(name) for name in
                              ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
              "gpus": [torch.cuda.get_device_name(i) for i in range(found)]}
    checks = []
    # torch first: its ranks are separate processes, started before this one holds the GPUs through jax.
    if "torch" in sections:
        report["torch"] = torch_section(args.quick, out_dir)
        checks += report["torch"]["checks"]
    if "jax" in sections:
        report["jax"] = jax_section(args.quick)
        checks += report["jax"]["checks"]
        for row in report["jax"]["rows"]:
            print(f"{row['name']:<32} {row['tokens']:>6} tokens: one GPU {row['one_gpu_us']:8.1f} us; per GPU "
                  + ", ".join(f"{us:8.1f} us {gbps:5.0f} GB/s {copy:4.0%} of copy {half:4.2f}x half"
                              for us, gbps, copy, half in zip(row["per_gpu_us"], row["per_gpu_GBps"],
                                                              row["of_same_bytes_copy"], row["over_half_one_gpu"]))
                  + f"  [{row['method']}]")
    print("\n== checks ==")
    for check in checks:
        details = {key: value for key, value in check.items() if key not in ("check", "ok")}
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']}  {details}")
    with open(os.path.join(out_dir, "two_gpu.json"), "w") as file:
        json.dump(report, file, indent=1)
    failed = sum(not check["ok"] for check in checks)
    print(f"\n{len(checks) - failed} of {len(checks)} checks passed; report in {out_dir}/two_gpu.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
