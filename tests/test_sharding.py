"""Beyond one device: each rank's share of the heads, and the multi-device runs in subprocesses.

``head_parallel_layers`` (interop) and ``head_major_kv`` (JAX) are checked here against
the layouts written out from their definitions. Two runs need processes of their own:
JAX on 4 host devices (``XLA_FLAGS`` must be set before jax starts:
``tests/test_sharding_mesh_jax.py`` in a subprocess) and torch ranks over gloo
(``tests/sharding_torch_rank.py``, one process per rank, the Triton kernel in
interpret mode), compared here with a one-rank run and with the reference.
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fusedkv_jax.sharding import head_major_kv
from interop.core.arrays import numpy_dtype
from interop.core.materializer import head_parallel_layers, materializer_reference, stacked_op_arrays
from interop.testing import random_case
from interop.core.reference import fused_kv_norm_rope_into_cache_reference, fused_kv_norm_rope_reference
from interop.core.spec import FusedKVConfig
from interop.testing import END_TO_END_TOLERANCE, assert_bit_exact, assert_close

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import sharding_torch_rank  # noqa: E402  (the worker's case, shared with its processes)

OP = FusedKVConfig(num_kv_heads=4, head_dim=24, rotary_dim=16)
BF16 = numpy_dtype("bfloat16")


def _layers(op=OP, n_layers=2):
    return random_case(op, n_layers=n_layers, hidden=40, total_ctx=3, max_position=32, seed=2).layers


def _rows_of_heads(weight, heads, head_dim):
    """The K rows, then the V rows, of ``heads``, read off ``weight`` viewed as [K|V, head, dim, hidden]."""
    by_head = np.asarray(weight).reshape(2, -1, head_dim, weight.shape[1])
    return by_head[:, heads].reshape(-1, weight.shape[1])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_each_rank_gets_the_k_then_v_rows_of_its_heads(world_size):
    layers = _layers()
    local = OP.num_kv_heads // world_size
    for rank in range(world_size):
        share = head_parallel_layers(layers, rank, world_size)
        for layer, part in zip(layers, share):
            expected = _rows_of_heads(layer.kv_proj_weight, slice(rank * local, (rank + 1) * local), OP.head_dim)
            assert_bit_exact(part.kv_proj_weight, expected, name=f"rows of rank {rank}")
            assert part.num_kv_heads == local
            assert part.k_norm_weight is layer.k_norm_weight
            assert (part.eps, part.head_dim, part.rope) == (layer.eps, layer.head_dim, layer.rope)


def test_each_rank_gets_the_k_then_v_biases_of_its_heads():
    layers = random_case(OP, n_layers=2, hidden=40, total_ctx=3, max_position=32, seed=2, kv_bias=True).layers
    for rank in range(2):
        for layer, part in zip(layers, head_parallel_layers(layers, rank, 2)):
            expected = _rows_of_heads(layer.kv_proj_bias[:, None], slice(2 * rank, 2 * rank + 2), OP.head_dim)
            assert_bit_exact(part.kv_proj_bias, expected[:, 0], name=f"biases of rank {rank}")


def test_a_ranks_reference_is_its_heads_of_the_whole_reference():
    case = random_case(FusedKVConfig(4, 96, 32, "gptj"), n_layers=3, hidden=32, total_ctx=4,
                       max_position=32, seed=3)
    k_whole, v_whole = materializer_reference(case.layers, case.ctx_hidden, case.positions)
    for rank in range(2):
        k, v = materializer_reference(head_parallel_layers(case.layers, rank, 2), case.ctx_hidden,
                                      case.positions)
        heads = slice(2 * rank, 2 * rank + 2)
        assert_close(k, k_whole[:, :, heads], tolerance=END_TO_END_TOLERANCE)
        assert_close(v, v_whole[:, :, heads], name="v", tolerance=END_TO_END_TOLERANCE)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_shares_keep_their_framework(framework):
    layers = _layers()
    convert = torch.from_numpy if framework == "torch" else jnp.asarray
    framework_layers = [dataclasses.replace(layer, kv_proj_weight=convert(layer.kv_proj_weight.astype(np.float32)))
                        for layer in layers]
    share = head_parallel_layers(framework_layers, 1, 2)
    assert type(share[0].kv_proj_weight) is type(framework_layers[0].kv_proj_weight)
    expected = head_parallel_layers([dataclasses.replace(layer, kv_proj_weight=layer.kv_proj_weight.astype(np.float32))
                                     for layer in layers], 1, 2)
    assert_bit_exact(np.asarray(share[0].kv_proj_weight), expected[0].kv_proj_weight)


@pytest.mark.parametrize("rank, world_size, message", [
    (0, 3, "Invalid world_size for head-parallel fused KV materialization: got 3, expected a positive "
           "int dividing num_kv_heads=4."),
    (0, 0, "Invalid world_size for head-parallel fused KV materialization: got 0, expected a positive "
           "int dividing num_kv_heads=4."),
    (0, 2.0, "Invalid world_size for head-parallel fused KV materialization: got 2.0, expected a "
             "positive int dividing num_kv_heads=4."),
    (0, True, "Invalid world_size for head-parallel fused KV materialization: got True, expected a "
              "positive int dividing num_kv_heads=4."),
    (2, 2, "Invalid rank for head-parallel fused KV materialization: got 2, expected an int in [0, 2)."),
    (-1, 2, "Invalid rank for head-parallel fused KV materialization: got -1, expected an int in [0, 2)."),
    (True, 2, "Invalid rank for head-parallel fused KV materialization: got True, expected an int in [0, 2)."),
])
def test_bad_rank_or_world_size_raises_its_message(rank, world_size, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        head_parallel_layers(_layers(), rank, world_size)


def test_layers_are_validated_before_they_are_cut():
    layers = list(_layers())
    layers[1] = dataclasses.replace(layers[1], num_kv_heads=2)
    with pytest.raises(ValueError, match="^Invalid fused KV materializer layer 1: num_kv_heads got 2"):
        head_parallel_layers(layers, 0, 2)


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_head_major_kv_puts_each_shards_k_heads_then_v_heads_together(num_shards):
    kv = np.random.default_rng(4).standard_normal((3, 2, 2 * OP.kv_size)).astype(BF16)
    reordered = np.asarray(head_major_kv(kv, num_kv_heads=OP.num_kv_heads, head_dim=OP.head_dim,
                                         num_shards=num_shards))
    local = OP.num_kv_heads // num_shards * OP.head_dim
    for shard, part in enumerate(np.split(reordered, num_shards, axis=2)):
        k_heads = kv[:, :, shard * local:(shard + 1) * local]
        v_heads = kv[:, :, OP.kv_size + shard * local:OP.kv_size + (shard + 1) * local]
        assert_bit_exact(part, np.concatenate([k_heads, v_heads], axis=2), name=f"shard {shard}")


@pytest.mark.parametrize("kv_shape, num_shards, message", [
    ((3, 2, 2 * OP.kv_size), 3, "Invalid num_shards for head-parallel fused KV materialization: got 3, "
                                "expected a positive int dividing num_kv_heads=4."),
    ((3, 2, OP.kv_size), 2, f"Invalid fused KV projection shape: got (3, 2, {OP.kv_size}), expected "
                            f"trailing dim {2 * OP.kv_size}."),
])
def test_head_major_kv_refuses_what_it_cannot_split(kv_shape, num_shards, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        head_major_kv(np.zeros(kv_shape, np.float32), num_kv_heads=OP.num_kv_heads,
                      head_dim=OP.head_dim, num_shards=num_shards)


def _run(arguments, env):
    return subprocess.Popen([sys.executable, *arguments], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _env(**variables):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(variables)
    return env


def _finish(process, timeout=600):
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def _gpu_visible() -> bool:
    torch = pytest.importorskip("torch")
    return torch.cuda.is_available()


def test_jax_on_four_host_devices():
    process = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sharding_mesh_jax.py"],
                   _env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    output = _finish(process)
    # Where a GPU is visible, jax 0.11 lowers the GPU kernel only for it, so the two
    # lowering tests skip in this host-device subprocess (test_sharding_gpu.py runs them).
    allowed_skips = "2 skipped" if _gpu_visible() else None
    assert " passed" in output and "failed" not in output, output
    assert "skipped" not in output or (allowed_skips and allowed_skips in output), output


def test_torch_ranks_over_gloo_each_compute_their_heads(tmp_path):
    # The one-rank run and the two ranks at once; every process on the CPU, interpreted.
    env = _env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    processes = [_run(["tests/sharding_torch_rank.py", "0", "1", str(tmp_path)], env)]
    processes += [_run(["tests/sharding_torch_rank.py", str(rank), "2", str(tmp_path)], env) for rank in range(2)]
    for process in processes:
        _finish(process)
    one, two = np.load(tmp_path / "world1.npz"), np.load(tmp_path / "world2.npz")
    case = sharding_torch_rank.case()
    op = sharding_torch_rank.OP
    local = dict(num_kv_heads=op.num_kv_heads // 2, head_dim=op.head_dim, rotary_dim=op.rotary_dim,
                 rope_style=op.rope_style)
    slots = np.array(sharding_torch_rank.SLOTS)
    poison = np.full(two["k_cache"].shape[1:], sharding_torch_rank.POISON, BF16)
    for rank in range(2):
        # Each rank's result is the op on its own projection, and its caches that op's writes.
        host = (two["kv"][rank].astype(BF16), *stacked_op_arrays(case.layers), case.positions)
        k_expected, v_expected = fused_kv_norm_rope_reference(*host, **local)
        assert_close(two["k"][rank].astype(BF16), k_expected, name=f"k of rank {rank}")
        assert_bit_exact(two["v"][rank].astype(BF16), v_expected, name=f"v of rank {rank}")
        k_expected, v_expected = fused_kv_norm_rope_into_cache_reference(*host, slots, poison, poison, **local)
        assert_close(two["k_cache"][rank].astype(BF16), k_expected, name=f"k_cache of rank {rank}")
        assert_bit_exact(two["v_cache"][rank].astype(BF16), v_expected, name=f"v_cache of rank {rank}")
    # Together: the heads of the one-rank run and of the fp32 NumPy path, up to the
    # rounding of a GEMM over other columns.
    k_reference, v_reference = materializer_reference(case.layers, case.ctx_hidden, case.positions)
    for name, reference in (("k", k_reference), ("v", v_reference), ("k_cache", None), ("v_cache", None)):
        whole = np.concatenate(list(two[name]), axis=2).astype(BF16)
        assert_close(whole, one[name][0].astype(BF16), name=name, tolerance=END_TO_END_TOLERANCE)
        if reference is not None:
            assert_close(whole, reference, name=name, tolerance=END_TO_END_TOLERANCE)
