"""The op's rows of kind ``options``: the op with one of a draft's options, each run beside the
plain op's row (``triton``, ``pallas``) on the same workload, checked against the reference
given the same option:

* ``*-v-multiplier``: a per-layer ``v_multiplier`` (V scaled in fp32, rounded once);
* ``*-tables``: two cos/sin tables, the layers alternating between them (``layer_rope_table``);
* ``*-no-k-norm``: no K-norm (``k_norm_weight`` and ``eps`` None);
* ``pallas-cache``, ``pallas-mosaic-cache``: the plain op into paged caches
  (``fused_kv_norm_rope_into_cache``) on each lowering, every token to a distinct random
  slot of caches of twice the tokens, beside ``pallas`` and ``pallas-mosaic``.

The option arrays are the workload's (:meth:`~interop.bench.workload.Workload.options`). The
materializers' FP8 weights rows, of the same kind, are in :mod:`interop.bench.materializers`.
"""

from __future__ import annotations

import dataclasses
import functools

from interop.bench.check import op_verdict
from interop.bench.rows import Calls, Steps, nan_pair, op_calls, op_steps, with_options
from interop.bench.workload import Workload

# Each option's arguments to the op, by name, from the workload's option arrays.
OPTIONS = {
    "v-multiplier": lambda arrays: dict(v_multiplier=arrays["v_multiplier"]),
    "tables": lambda arrays: dict(cos_sin_cache=arrays["cos_sin_tables"], layer_rope_table=arrays["layer_rope_table"]),
    "no-k-norm": lambda arrays: dict(k_norm_weight=None, eps=None),
}


def option_arguments(workload: Workload, framework: str, option: str) -> dict:
    """``option``'s arguments to the op, arrays of ``framework``."""
    return OPTIONS[option](workload.options(framework))


def triton_option(workload: Workload, *, option: str) -> Calls:
    """The Triton kernel with ``option``, writing into outputs of each set, as ``triton`` does."""
    from fusedkv_torch import fused_kv_norm_rope

    # Triton's interpreter rounds a scaled bf16 V by truncation (README): held to the table there.
    v_exact = not (option == "v-multiplier" and workload.torch_device == "cpu" and workload.dtype == "bfloat16")
    return op_calls(workload, "torch", functools.partial(fused_kv_norm_rope, **workload.shape.static()),
                    given_outputs=True, options=option_arguments(workload, "torch", option), v_exact=v_exact)


def pallas_option(workload: Workload, *, option: str) -> Steps:
    """The Pallas kernel (Triton lowering) with ``option``, writing into the outputs it is given
    (donated through the chain), as ``pallas`` does; the option's arrays travel with the fixed ones."""
    from fusedkv_jax import fused_kv_norm_rope

    static = workload.shape.static()
    arrays, keywords = with_options(workload.op_args(0, "jax"), option_arguments(workload, "jax", option))

    def step(fixed, varying, outputs):
        (k_norm_weight, eps, cos_sin_cache), options = fixed
        kv, positions = varying
        return fused_kv_norm_rope(kv, k_norm_weight, eps, cos_sin_cache, positions, **static, k_out=outputs[0],
                                  v_out=outputs[1], lowering="triton", **options)

    def check(outputs, index):
        kv, positions = workload.varying(index, "jax")
        return op_verdict(*outputs, kv, *arrays[1:4], positions, static=static, options=keywords)

    return dataclasses.replace(op_steps(workload, step), fixed=(arrays[1:4], keywords), check=check)


def pallas_cache(workload: Workload, *, lowering: str, kernel_target: str | None = None) -> Steps:
    """The Pallas kernel on ``lowering`` into paged caches chained through the calls (donated,
    each updated in place), a set's slots travelling with its ``kv`` and positions;
    ``kernel_target``: see :class:`~interop.bench.rows.Steps`."""
    from fusedkv_jax import fused_kv_norm_rope_into_cache

    static = workload.shape.static()

    def step(fixed, varying, caches):
        kv, positions, slots = varying
        return fused_kv_norm_rope_into_cache(kv, *fixed, positions, slots, *caches, **static, lowering=lowering)

    def check(caches, index):
        return op_verdict(*caches, *workload.op_args(index, "jax"), static=static, slots=workload.slots(index, "jax"))

    plain = op_steps(workload, step, kernel_target=kernel_target)
    return dataclasses.replace(
        plain, varying=[(*varying, workload.slots(index, "jax")) for index, varying in enumerate(plain.varying)],
        new_outputs=lambda: nan_pair(workload, "jax", rows=workload.num_slots), check=check)
