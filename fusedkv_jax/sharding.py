"""Head-parallel fusedkv inside ``jax.shard_map``: each device its own KV heads.

Under ``jax.jit`` the op splits by tokens and layers by itself
(:mod:`fusedkv_jax.partitioning`). Heads cannot be split that way: per token and layer
``kv`` holds all K heads, then all V heads, so cutting its last dim into equal parts
gives the first devices only K. Inside ``jax.shard_map`` each device instead holds
``kv`` of its own heads, ``[total_ctx, n_layers, 2*local_heads*head_dim]``, its K heads
then its V heads, and calls the op with ``num_kv_heads=local_heads``: the outputs
``[n_layers, total_ctx, local_heads, head_dim]`` are its heads of the whole result, so
``out_specs=P(None, None, axis)`` assembles them in head order.

That ``kv`` comes from a column-parallel projection (each device the K and V rows of
its heads: :func:`head_parallel_materializer`), or from a whole ``kv`` reordered shard
by shard (:func:`head_major_kv`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from fusedkv_jax.materializer import FusedKVMaterializer
from interop.core.materializer import LayerKV, head_parallel_layers


def head_major_kv(kv: jax.Array, *, num_kv_heads: int, head_dim: int, num_shards: int) -> jax.Array:
    """``kv`` reordered so that a split of its last dim into ``num_shards`` equal parts is a split by heads.

    ``kv: dtype[total_ctx, n_layers, 2*kv_size]`` (all K heads, then all V heads) becomes
    ``dtype[total_ctx, n_layers, num_shards * 2*(H/S)*head_dim]``: for shard ``s`` the K
    heads ``[s*H/S, (s+1)*H/S)``, then the V heads of the same range (``H =
    num_kv_heads``, ``S = num_shards``). One copy of ``kv``; with ``num_shards=1`` the
    array is returned as is.
    """
    if not (isinstance(num_shards, int) and not isinstance(num_shards, bool)
            and num_shards > 0 and num_kv_heads % num_shards == 0):
        raise ValueError(
            "Invalid num_shards for head-parallel fused KV materialization: "
            f"got {num_shards!r}, expected a positive int dividing num_kv_heads={num_kv_heads}."
        )
    total_ctx, n_layers, width = kv.shape
    if width != 2 * num_kv_heads * head_dim:
        raise ValueError(
            "Invalid fused KV projection shape: "
            f"got {tuple(kv.shape)}, expected trailing dim {2 * num_kv_heads * head_dim}."
        )
    if num_shards == 1:
        return kv
    local = num_kv_heads // num_shards * head_dim
    kv = jnp.asarray(kv).reshape(total_ctx, n_layers, 2, num_shards, local)
    return kv.transpose(0, 1, 3, 2, 4).reshape(total_ctx, n_layers, width)


def head_parallel_materializer(
    layers: Sequence[LayerKV],
    mesh: jax.sharding.Mesh,
    axis_name: str,
    *,
    cos_sin_cache: jax.Array | None = None,
    layer_rope_table: jax.Array | None = None,
) -> tuple[FusedKVMaterializer, FusedKVMaterializer]:
    """A materializer for ``jax.shard_map`` over ``axis_name``, each device its own heads, and its in_specs.

    Device ``r`` of the axis (of size ``R``) gets the column-parallel share of every
    layer (:func:`~interop.core.materializer.head_parallel_layers`: the K and V rows, and
    biases, of heads ``[r*H/R, (r+1)*H/R)``); the k_norm weights, eps and cos/sin tables
    (with their ``layer_rope_table``) are replicated. Inside the ``shard_map`` the materializer is the one-device
    materializer of that device's heads: ``materialize`` returns ``[n_layers,
    total_ctx, H/R, head_dim]`` (``out_specs=P(None, None, axis_name)`` assembles the
    heads in order), and ``materialize_into_cache`` writes caches split the same way.

    Returns:
      ``(materializer, specs)``: the materializer, whose projection weight is
      ``[R * n_layers*2*(H/R)*head_dim, hidden]`` split over ``axis_name`` (usable only
      inside the ``shard_map``), and the same pytree holding each leaf's
      ``PartitionSpec``, to pass as its ``in_specs``.
    """
    num_shards = mesh.shape[axis_name]
    shares = [FusedKVMaterializer(head_parallel_layers(layers, rank, num_shards),
                                  cos_sin_cache=cos_sin_cache, layer_rope_table=layer_rope_table)
              for rank in range(num_shards)]
    config = shares[0].config
    by_head = PartitionSpec(axis_name)
    whole = PartitionSpec()
    # The projection weight, bias and weight scales are split by heads; every other array (None where a draft
    # has none) is whole.
    children, _ = shares[0].tree_flatten()
    children = (jnp.concatenate([share.kv_proj_weight for share in shares]),
                jnp.concatenate([share.kv_proj_bias for share in shares]) if config.biased else None,
                jnp.concatenate([share.weight_scale for share in shares]) if config.fp8_weights else None,
                *children[3:])
    child_specs = [None if child is None else by_head if index < 3 else whole for index, child in enumerate(children)]
    placed = [None if child is None else jax.device_put(child, NamedSharding(mesh, spec))
              for child, spec in zip(children, child_specs)]
    return (FusedKVMaterializer.tree_unflatten(config, placed),
            FusedKVMaterializer.tree_unflatten(config, child_specs))
