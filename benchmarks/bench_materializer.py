"""The whole materialization path on a GPU: the reference design against direct scatter.

``python -m benchmarks.bench_materializer [--quick]`` from the tree (``PYTHONPATH=.``).
The draft of a Qwen3-8B-sized model: 5 layers, hidden 4096, 8 KV heads, head_dim 128,
neox, bf16, a paged KV cache of 200k slots and random slots (distinct, over the whole
pool), at 16, 512 and 8192 tokens. Rows, all under CUDA-graph replay unless named:

* ``gemm``: the stacked K/V projection of all layers alone (``project``);
* ``(a) reference``: the design the materializer replaces: the GEMM, the fused op into a
  temporary ``[n_layers, total_ctx, H, D]`` pair, then per layer
  ``k_pool[layer][cache_loc] = k[layer]`` (and V); ``rest`` is all but the GEMM;
* ``(b) scatter``: ``materialize_into_cache``, the GEMM then one launch that writes
  every layer's slots; ``rest`` is that launch alone;
* ``callback``: ``materialize_layers`` with the same per-layer index writes;
* ``op alone``: the fused op into a temporary on the same GEMM output, the yardstick
  for (b)'s rest (the issue holds it to 1.2x of this);
* the eager calls of (a) and (b) at 16 tokens, and of (b)'s two parts (the GEMM alone,
  the op alone): host wall time per call of a long loop, which is what an eager caller
  waits when the host is the bottleneck;
* the JAX materializer (``materialize_into_cache`` jitted with the caches donated, and
  the GEMM alone): device time from the profiler, as in ``bench_jax``; and its eager
  call at 16 tokens, host wall time per call as above.

"rest" rows run on a fixed GEMM output per input set. Bandwidth counts the bytes the
work cannot avoid: for the GEMM its weights, ``ctx_hidden`` and ``kv``; for the rest
``2 * kv.nbytes`` (read ``kv``, write K and V once), whatever the design moves beyond
that, so (a) and (b) compare on one scale. Before timing, each size checks the cache
slots of (a) and (b) for a sample of tokens against the interop reference on the same
GEMM output. Sizes whose working set fits in L2 rotate over several input sets. One
failing configuration prints an error row and the run goes on; the table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
import torch

from benchmarks.measure import DRAFT, DRAFT_STATIC, N_LAYERS, Row, format_table, guarded
from fusedkv_torch import fused_kv_norm_rope, fused_kv_norm_rope_into_cache
from fusedkv_torch.materializer import FusedKVMaterializer
from interop.bench.check import verdict
from interop.bench.shapes import DRAFT_SHAPE, MAX_POSITION
from interop.bench.timers import copy_bytes_per_second, graph_replay_seconds, host_seconds_per_call
from interop.bench.workload import input_sets_needed
from interop.exchange import to_torch
from interop.core.materializer import stacked_op_arrays
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_reference

HIDDEN = DRAFT_SHAPE.hidden
NUM_SLOTS = 200_000
SIZES = (16, 512, 8192)
EAGER_SIZE = 16
CHECKED_TOKENS = 64
DEVICE = "cuda"


@dataclasses.dataclass
class InputSet:
    ctx_hidden: torch.Tensor
    positions: torch.Tensor
    cache_loc: torch.Tensor
    kv: torch.Tensor  # this set's GEMM output, for the "rest" rows


class Bench:
    """One materializer, one stacked pool pair, and the calls every row times."""

    def __init__(self):
        self.case = random_case(DRAFT, n_layers=N_LAYERS, hidden=HIDDEN, total_ctx=0,
                                max_position=MAX_POSITION)
        layers = [dataclasses.replace(layer, kv_proj_weight=to_torch(layer.kv_proj_weight).to(DEVICE),
                                      k_norm_weight=to_torch(layer.k_norm_weight).to(DEVICE))
                  for layer in self.case.layers]
        self.materializer = FusedKVMaterializer(layers)
        shape = (N_LAYERS, NUM_SLOTS, DRAFT.num_kv_heads, DRAFT.head_dim)
        self.k_pool = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        self.v_pool = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        self.op_arrays = (self.materializer.k_norm_weight, self.materializer.eps,
                          self.materializer.cos_sin_cache)

    def input_sets(self, total_ctx: int, seed: int) -> list[InputSet]:
        kv_bytes = total_ctx * self.materializer.config.kv_width * 2
        count = input_sets_needed(total_ctx * HIDDEN * 2 + 3 * kv_bytes)
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        self.materializer.reserve(total_ctx, staging=True)
        sets = []
        for _ in range(count):
            hidden = torch.randn((total_ctx, HIDDEN), generator=generator, device=DEVICE).bfloat16()
            positions = torch.randint(0, MAX_POSITION, (total_ctx,), generator=generator, device=DEVICE)
            cache_loc = torch.randperm(NUM_SLOTS, generator=generator, device=DEVICE)[:total_ctx]
            kv = self.materializer.project(hidden).clone()
            sets.append(InputSet(hidden, positions, cache_loc, kv))
        return sets

    def gemm(self, inputs: InputSet):
        self.materializer.project(inputs.ctx_hidden)

    def write_layer_kv(self, cache_loc):
        def write(layer, k, v):
            self.k_pool[layer][cache_loc] = k
            self.v_pool[layer][cache_loc] = v
        return write

    def reference_rest(self, inputs: InputSet, kv=None):
        k, v = fused_kv_norm_rope(inputs.kv if kv is None else kv, *self.op_arrays, inputs.positions,
                                  **DRAFT_STATIC)
        write = self.write_layer_kv(inputs.cache_loc)
        for layer in range(N_LAYERS):
            write(layer, k[layer], v[layer])

    def reference_total(self, inputs: InputSet):
        self.reference_rest(inputs, kv=self.materializer.project(inputs.ctx_hidden))

    def op_alone(self, inputs: InputSet):
        """The fused op into a temporary, nothing else: what the scatter's rest is held to."""
        fused_kv_norm_rope(inputs.kv, *self.op_arrays, inputs.positions, **DRAFT_STATIC)

    def scatter_rest(self, inputs: InputSet):
        fused_kv_norm_rope_into_cache(inputs.kv, *self.op_arrays, inputs.positions, inputs.cache_loc,
                                      self.k_pool, self.v_pool, **DRAFT_STATIC)

    def scatter_total(self, inputs: InputSet):
        self.materializer.materialize_into_cache(inputs.ctx_hidden, inputs.positions,
                                                 inputs.cache_loc, self.k_pool, self.v_pool)

    def callback_total(self, inputs: InputSet):
        self.materializer.materialize_layers(inputs.ctx_hidden, inputs.positions,
                                             self.write_layer_kv(inputs.cache_loc))

    def check(self, call, inputs: InputSet) -> str:
        """Run ``call`` on poisoned pools, then check the slots of its first tokens."""
        self.k_pool.fill_(float("nan"))
        self.v_pool.fill_(float("nan"))
        call(inputs)
        return check_slots(self.case, inputs.kv, inputs.positions, inputs.cache_loc,
                           self.k_pool, self.v_pool)


def check_slots(case, kv, positions, cache_loc, k_pool, v_pool) -> str:
    """The pool slots of the first tokens against the reference on the same GEMM output ``kv``."""
    tokens = min(CHECKED_TOKENS, kv.shape[0])
    slots = cache_loc[:tokens]
    k_expected, v_expected = fused_kv_norm_rope_reference(
        kv[:tokens], *stacked_op_arrays(case.layers), positions[:tokens], **DRAFT_STATIC)
    return verdict(k_pool[:, slots], v_pool[:, slots], k_expected, v_expected)


def _bytes(total_ctx: int) -> tuple[int, int]:
    """(GEMM, rest) bytes that no design can avoid moving."""
    return DRAFT_SHAPE.gemm_bytes(total_ctx, "bfloat16"), DRAFT_SHAPE.op_bytes(total_ctx, "bfloat16")


def torch_rows(bench: Bench, total_ctx: int, *, quick: bool) -> list[Row]:
    sets = bench.input_sets(total_ctx, seed=total_ctx)
    gemm_bytes, rest_bytes = _bytes(total_ctx)
    checks = {"(a) reference": bench.check(bench.reference_total, sets[0]),
              "(b) scatter": bench.check(bench.scatter_total, sets[0]),
              "callback": bench.check(bench.callback_total, sets[0])}
    graph_ms = 5 if quick else 20

    def replayed(name, part, call, nbytes):
        def measure():
            seconds = graph_replay_seconds(lambda i: call(sets[i]), len(sets), rep_ms=graph_ms)
            return Row(name, total_ctx, part, seconds, nbytes, "graph", len(sets),
                       checks.get(name, "-"))
        return guarded(name, total_ctx, part, measure)

    return [
        replayed("gemm", "project", bench.gemm, gemm_bytes),
        replayed("op alone", "temporary", bench.op_alone, rest_bytes),
        replayed("(a) reference", "rest", bench.reference_rest, rest_bytes),
        replayed("(a) reference", "total", bench.reference_total, gemm_bytes + rest_bytes),
        replayed("(b) scatter", "rest", bench.scatter_rest, rest_bytes),
        replayed("(b) scatter", "total", bench.scatter_total, gemm_bytes + rest_bytes),
        replayed("callback", "total", bench.callback_total, gemm_bytes + rest_bytes),
    ]


def eager_rows(bench: Bench, *, quick: bool) -> list[Row]:
    sets = bench.input_sets(EAGER_SIZE, seed=1)
    gemm_bytes, rest_bytes = _bytes(EAGER_SIZE)
    calls = 300 if quick else 2000
    rows = []
    for name, part, call, nbytes in (
            ("gemm", "eager project", bench.gemm, gemm_bytes),
            ("(b) scatter", "eager rest", bench.scatter_rest, rest_bytes),
            ("(a) reference", "eager", bench.reference_total, gemm_bytes + rest_bytes),
            ("(b) scatter", "eager", bench.scatter_total, gemm_bytes + rest_bytes)):
        rows.append(guarded(name, EAGER_SIZE, part, lambda: Row(
            name, EAGER_SIZE, part, host_seconds_per_call(lambda i: call(sets[i]), len(sets), calls=calls),
            nbytes, "host", len(sets))))
    return rows


def jax_rows(case, *, quick: bool) -> list[Row]:
    """The JAX materializer: the GEMM alone, and the direct scatter into donated caches."""
    import jax
    import jax.numpy as jnp

    from benchmarks.bench_jax import device_seconds
    from fusedkv_jax.materializer import FusedKVMaterializer as JaxMaterializer

    if jax.default_backend() != "gpu":
        print(f"bench_materializer: jax sees no GPU (backend {jax.default_backend()!r}); "
              "no JAX rows.", file=sys.stderr)
        return []
    materializer = JaxMaterializer(case.layers)
    project = jax.jit(lambda m, hidden: m.project(hidden))
    scatter = jax.jit(lambda m, hidden, positions, cache_loc, k_cache, v_cache:
                      m.materialize_into_cache(hidden, positions, cache_loc, k_cache, v_cache),
                      donate_argnums=(4, 5))
    shape = (N_LAYERS, NUM_SLOTS, DRAFT.num_kv_heads, DRAFT.head_dim)
    caches = [jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)]
    steps = 20 if quick else 100
    rows = []
    for total_ctx in SIZES:
        gemm_bytes, rest_bytes = _bytes(total_ctx)
        rng = np.random.default_rng(total_ctx)
        hidden = jnp.asarray(rng.standard_normal((total_ctx, HIDDEN), np.float32), jnp.bfloat16)
        positions = rng.integers(0, MAX_POSITION, total_ctx).astype(np.int32)
        cache_loc = rng.permutation(NUM_SLOTS)[:total_ctx].astype(np.int32)
        device_positions, device_loc = jnp.asarray(positions), jnp.asarray(cache_loc)

        def launch_scatter(i):
            caches[:] = scatter(materializer, hidden, device_positions, device_loc, *caches)
            return caches

        def check() -> str:
            caches[0], caches[1] = (jnp.full(shape, jnp.nan, jnp.bfloat16) for _ in range(2))
            launch_scatter(0)
            return check_slots(case, project(materializer, hidden), positions, cache_loc, *caches)

        def timed(name, part, launch, nbytes, result="-"):
            seconds, method = device_seconds(launch, steps)
            return Row(name, total_ctx, part, seconds, nbytes, method, 1, result)

        rows.append(guarded("jax gemm", total_ctx, "project", lambda: timed(
            "jax gemm", "project", lambda i: project(materializer, hidden), gemm_bytes)))
        rows.append(guarded("jax (b) scatter", total_ctx, "total", lambda: timed(
            "jax (b) scatter", "total", launch_scatter, gemm_bytes + rest_bytes, check())))

    def eager_scatter(i):
        caches[:] = materializer.materialize_into_cache(hidden, device_positions, device_loc, *caches)
        return caches

    rng = np.random.default_rng(EAGER_SIZE)
    hidden = jnp.asarray(rng.standard_normal((EAGER_SIZE, HIDDEN), np.float32), jnp.bfloat16)
    device_positions = jnp.asarray(rng.integers(0, MAX_POSITION, EAGER_SIZE), jnp.int32)
    device_loc = jnp.asarray(rng.permutation(NUM_SLOTS)[:EAGER_SIZE], jnp.int32)
    rows.append(guarded("jax (b) scatter", EAGER_SIZE, "eager", lambda: Row(
        "jax (b) scatter", EAGER_SIZE, "eager",
        host_seconds_per_call(eager_scatter, 1, calls=300 if quick else 2000, wait=jax.block_until_ready),
        sum(_bytes(EAGER_SIZE)), "host", 1)))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter timing graphs")
    parser.add_argument("--no-jax", action="store_true", help="skip the JAX materializer")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_materializer: no CUDA device; nothing to time.")
        return 0
    # torch holds the pools first; XLA must not claim 75% of the GPU up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; bf16, {N_LAYERS} layers, "
          f"hidden {HIDDEN}, {DRAFT.num_kv_heads} KV heads, head_dim {DRAFT.head_dim}, "
          f"{NUM_SLOTS} cache slots", flush=True)
    copy_rate = copy_bytes_per_second()
    print(f"copy ceiling: {copy_rate / 1e9:.0f} GB/s", flush=True)

    start = time.perf_counter()
    bench = Bench()
    rows = []
    for total_ctx in SIZES:
        rows += torch_rows(bench, total_ctx, quick=args.quick)
        print(format_table(rows[-6:], copy_rate), flush=True)
    rows += eager_rows(bench, quick=args.quick)
    case = bench.case
    del bench
    torch.cuda.empty_cache()
    if not args.no_jax:
        rows += jax_rows(case, quick=args.quick)
    print(f"\n== materialization, {N_LAYERS} layers, hidden {HIDDEN}, {NUM_SLOTS} slots: "
          f"copy ceiling {copy_rate / 1e9:.0f} GB/s; {time.perf_counter() - start:.0f} s ==")
    print(format_table(rows, copy_rate))
    return 0 if all(not row.error and row.check in ("ok", "-") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
