"""How ``jax.jit`` splits the fused KV kernel over devices: by tokens and by layers, never kv's columns.

A ``pallas_call`` is a custom call XLA knows nothing about: given inputs sharded over a
mesh, XLA would gather ``kv`` onto every device and run the whole op everywhere. The
kernel's work is independent per token and per layer (each token brings its own
position, each layer its own norm weight and eps), so a shard of tokens and layers is
the same op on smaller arrays, and :func:`partitioned` runs it so on each device:

* over mesh axes of type ``Explicit`` (``jax.make_mesh``'s default), where the
  shardings are part of the traced types, by ``jax.shard_map`` over the mesh, each
  device given its tokens and layers of ``kv`` and the small operands resharded to
  what the kernel needs;
* over ``Auto`` axes (``jax.sharding.Mesh``'s default), whose shardings XLA decides
  after tracing, by ``custom_partitioning``: a Shardy sharding rule over the operands'
  dimensions and a partition callback that runs the kernel on each device's shard.

What is split, and what is not:

* ``kv[total_ctx, n_layers, 2*kv_size]`` along tokens and/or layers, the outputs
  ``[n_layers, total_ctx, heads, head_dim]`` the same way; ``positions`` follow the
  tokens, ``k_norm_weight``, ``eps`` (and fp8 scales, a V multiplier, the layers' table indices) the
  layers; ``cos_sin_cache`` is replicated (a slice of it per device would need every position's row).
* Never ``kv``'s last dimension: per token and layer it holds every K head, then every
  V head, so a split of it is not a split by heads (the first half of the devices
  would get only K). Heads are split by ``jax.shard_map`` over ``kv`` laid out shard
  by shard (README, "Beyond one GPU"). Such a ``kv`` is refused with a ``ValueError``
  (while tracing over Explicit axes, while compiling over Auto ones) rather than
  gathered.
* The paged-cache entry point splits by layers only: token ``t`` writes slot
  ``cache_loc[t]`` anywhere in the cache, so a device holding some tokens would have
  to write into every device's part of the cache. A ``kv`` split along tokens is
  refused the same way; split the caches by layers or heads, or give each device its
  own cache pool and its own tokens inside ``jax.shard_map``.

On one device (every single-device ``jax.jit``) and inside ``jax.shard_map`` none of
this applies: JAX lowers the kernel directly, with nothing added. Under ``jax.vmap``
the kernel is batched as before, unpartitioned (``custom_partitioning`` has no batching
rule of its own).
"""

from __future__ import annotations

import functools
import re

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# The launcher's array arguments, in its order, and the dimensions of each as factors
# of the sharding rule: t tokens, l layers, c kv columns, d head_dim, h heads, n cos/sin
# tables, m rows of a table, r rotary_dim, s cache slots.
_OPERANDS = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "slots",
             "k_dest", "v_dest", "k_scale", "v_scale", "v_multiplier", "layer_rope_table")
_FACTORS = {"kv": "t l c", "k_norm_weight": "l d", "eps": "l", "cos_sin_cache": "m r",
            "positions": "t", "slots": "t", "k_scale": "l", "v_scale": "l", "v_multiplier": "l",
            "layer_rope_table": "l"}
_TABLES_FACTORS = "n m r"  # a cos_sin_cache of one table per RoPE
# Factors no device may hold a part of: the kernel needs whole heads, the whole table
# and (for a cache) every slot. kv's columns ``c`` are left out so that the partition
# callback sees, and refuses, a kv split along them instead of XLA gathering it.
_WHOLE = ("d", "h", "n", "m", "r", "s")


def partitioned(launch, arrays, **static):
    """``launch(*arrays, **static)``, each device on its tokens and layers under a sharded jit.

    ``arrays`` are the launcher's twelve array arguments in :data:`_OPERANDS` order, None
    where absent (no ``slots``: the plain op; ``slots``: the op into a paged cache).
    """
    # Each operand's rank (0: absent), which the sharding rule's factors follow.
    present = tuple(0 if array is None else array.ndim for array in arrays)
    call = _partitioned_launch(launch, present, tuple(sorted(static.items())))
    split = _explicit_split(arrays)
    if split is None:
        return call(*arrays)
    mesh, specs, output = split
    given = [i for i, array in enumerate(arrays) if array is not None]

    def per_device(*shards):
        full = [None] * len(arrays)
        for i, shard in zip(given, shards):
            full[i] = shard
        return call(*full)

    shards = [jax.sharding.reshard(arrays[i], NamedSharding(mesh, specs[i])) for i in given]
    # check_vma=False: the outputs vary over exactly kv's axes by construction, and Pallas
    # interpret mode cannot yet run on values that carry varying manual axes.
    return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs[i] for i in given),
                         out_specs=(output, output), check_vma=False)(*shards)


def _explicit_split(arrays):
    """``(mesh, specs, output spec)`` where some array is split over Explicit mesh axes, else None."""
    shardings = [jax.typeof(array).sharding for array in arrays if array is not None]
    split = [sharding for sharding in shardings if any(axis is not None for axis in sharding.spec)]
    if not split:
        return None
    tokens, layers, columns = _padded(shardings[0].spec, 3)
    slotted = arrays[_OPERANDS.index("slots")] is not None
    specs, output = _specs(tokens, layers, columns, slotted)
    return split[0].mesh, [specs[name] for name in _OPERANDS], output


def _padded(spec, ndim: int) -> tuple:
    """The mesh axes of each of ``ndim`` dimensions (None: not split)."""
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def _specs(tokens, layers, columns, slotted):
    """Each operand's PartitionSpec and the outputs', for kv split as ``(tokens, layers, columns)``."""
    if columns is not None:
        raise ValueError(
            "Invalid kv sharding for fused KV materialization: got its last dim split over "
            f"mesh axes {columns!r}, expected it whole: per token and layer it holds all K "
            "heads then all V heads, so a split of it is not a split by heads. Split tokens "
            "or layers under jax.jit, or heads with jax.shard_map over kv laid out shard by "
            "shard (fusedkv_jax.sharding.head_major_kv)."
        )
    if slotted and tokens is not None:
        raise ValueError(
            "Invalid kv sharding for fused KV materialization into a paged cache: got tokens "
            f"split over mesh axes {tokens!r}, expected tokens whole: a token may write any "
            "slot, so a device holding some tokens would write into every device's part of "
            "the cache. Split layers (kv, caches and scales along n_layers) under jax.jit, "
            "or heads with jax.shard_map, or give each device its own cache and tokens "
            "inside jax.shard_map."
        )
    output = PartitionSpec(layers, tokens, None, None)
    by_layer = PartitionSpec(layers)
    specs = {"kv": PartitionSpec(tokens, layers, None), "k_norm_weight": PartitionSpec(layers, None),
             "eps": by_layer, "cos_sin_cache": PartitionSpec(None, None),
             "positions": PartitionSpec(tokens), "slots": PartitionSpec(tokens),
             "k_dest": output, "v_dest": output, "k_scale": by_layer, "v_scale": by_layer, "v_multiplier": by_layer,
             "layer_rope_table": by_layer}
    return specs, output


@functools.lru_cache(maxsize=None)
def _partitioned_launch(launch, present, static_items):
    """The launcher, once per configuration, as ``custom_partitioning`` (the rule for Auto
    axes) inside ``custom_vmap`` (so that ``jax.vmap`` still batches the kernel itself)."""
    static = dict(static_items)

    def per_shard(*arrays):  # positional only: custom_partitioning binds no keywords
        return launch(*arrays, **static)

    slotted = bool(present[_OPERANDS.index("slots")])
    output = "l s h d" if slotted else "l t h d"
    rule = (", ".join(_TABLES_FACTORS if name == "cos_sin_cache" and given == 3 else _FACTORS.get(name, output)
                      for name, given in zip(_OPERANDS, present) if given)
            + f" -> {output}, {output}")
    factors = list(dict.fromkeys(re.findall(r"\w+", rule)))
    split = custom_partitioning(per_shard)
    split.def_partition(
        partition=functools.partial(_partition, per_shard, slotted),
        sharding_rule=rule,
        # In the order the factors first appear, as Shardy requires.
        need_replication_factors=tuple(factor for factor in factors if factor in _WHOLE),
    )

    @custom_vmap
    def call(*arrays):
        return split(*arrays)

    @call.def_vmap
    def _batched(axis_size, in_batched, *arrays):
        del axis_size
        in_axes = [0 if batched else None for batched in in_batched]
        return jax.vmap(per_shard, in_axes=in_axes)(*arrays), (True, True)

    return call


def _partition(per_shard, slotted, mesh, arg_shapes, result_shape):
    """custom_partitioning's callback: the kernel per device, and the shardings it needs."""
    del result_shape
    kv_sharding = arg_shapes[0].sharding
    if not isinstance(kv_sharding, NamedSharding):
        raise ValueError(
            "Invalid kv sharding for fused KV materialization: got "
            f"{kv_sharding}, expected a NamedSharding (shard the inputs over a jax.sharding.Mesh)."
        )
    specs, output = _specs(*_padded(kv_sharding.spec, 3), slotted)
    arg_shardings = tuple(None if shape is None else NamedSharding(mesh, specs[name])
                          for name, shape in zip(_OPERANDS, arg_shapes))
    output = NamedSharding(mesh, output)
    return mesh, per_shard, (output, output), arg_shardings
