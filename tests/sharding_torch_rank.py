"""One rank of the tensor-parallel torch test: ``python tests/sharding_torch_rank.py RANK WORLD_SIZE DIR``.

``tests/test_sharding.py`` starts ``WORLD_SIZE`` of these (gloo, CPU, the Triton kernel
in interpret mode). Each rank builds its materializer from its share of the heads
(:func:`interop.core.materializer.head_parallel_layers`; one rank: the whole layers) and runs ``materialize`` and
``materialize_into_cache`` on its own caches; then, for the test only, rank 0 gathers
every rank's projection, results and caches and writes them to ``DIR/world{WORLD_SIZE}.npz``
(as float32, which holds every bfloat16 value exactly).
"""

import dataclasses
import datetime
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from fusedkv_torch import FusedKVMaterializer
from interop.core.arrays import as_numpy
from interop.exchange import to_torch
from interop.core.materializer import head_parallel_layers
from interop.testing import random_case
from interop.core.spec import FusedKVConfig

OP = FusedKVConfig(num_kv_heads=4, head_dim=32, rotary_dim=16, rope_style="gptj")
N_LAYERS, HIDDEN, NUM_SLOTS = 2, 64, 8
SLOTS = (5, -1, 0, 7, 2)
POISON = -3.5


def case():
    return random_case(OP, n_layers=N_LAYERS, hidden=HIDDEN, total_ctx=len(SLOTS), max_position=64, seed=21)


def _tensor(array) -> torch.Tensor:
    return to_torch(np.ascontiguousarray(array)).clone()


def main(rank: int, world_size: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous{world_size}",
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=300))
    host = case()
    layers = [dataclasses.replace(layer, kv_proj_weight=_tensor(layer.kv_proj_weight),
                                  k_norm_weight=_tensor(layer.k_norm_weight))
              for layer in host.layers]
    # One rank is the one-device run: the layers as they are.
    share = layers if world_size == 1 else head_parallel_layers(layers, rank, world_size)
    materializer = FusedKVMaterializer(share)
    ctx_hidden, positions = _tensor(host.ctx_hidden), _tensor(host.positions)
    results = {"kv": materializer.project(ctx_hidden).clone()}
    results["k"], results["v"] = materializer.materialize(ctx_hidden, positions)
    cache_shape = (N_LAYERS, NUM_SLOTS, OP.num_kv_heads // world_size, OP.head_dim)
    k_cache = torch.full(cache_shape, POISON, dtype=torch.bfloat16)
    v_cache = torch.full(cache_shape, POISON, dtype=torch.bfloat16)
    materializer.materialize_into_cache(ctx_hidden, positions, torch.tensor(SLOTS), k_cache, v_cache)
    results["k_cache"], results["v_cache"] = k_cache, v_cache

    gathered = {}
    for name, tensor in results.items():
        parts = [torch.empty_like(tensor, dtype=torch.float32) for _ in range(world_size)]
        dist.all_gather(parts, tensor.float())
        gathered[name] = np.stack([as_numpy(part) for part in parts])
    if rank == 0:
        np.savez(os.path.join(directory, f"world{world_size}.npz"), **gathered)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
