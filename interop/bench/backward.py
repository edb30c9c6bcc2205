"""``fusedkv bench``'s rows of the backward pass: ``triton-bwd`` (the Triton backward kernel,
with its small reduction of the weight's partial sums), ``pallas-bwd`` (the Pallas one on
its Triton lowering) and ``pallas-mosaic-bwd`` (the Mosaic GPU lowering's), each on random
gradients of the op's outputs.

Bytes moved: read ``kv``, the gradients of K and V (together ``kv``'s size), write ``kv``'s
gradient: ``3 * kv.nbytes`` (the partial sums, a row of ``head_dim`` fp32 a program, are
not counted). The check compares the sampled token rows of ``kv``'s gradient with the
reference backward on those rows (each token's gradient is its own); the weight's
gradient, a sum over every token, is the tests' to check.
"""

from __future__ import annotations

import functools

from interop.bench.check import checked_rows, take_rows
from interop.bench.rows import Calls, Steps
from interop.bench.workload import Workload
from interop.core.arrays import as_numpy
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference
from interop.core.spec import CallShape
from interop.testing import gradient_mismatch

# The custom call of a Pallas kernel on its Triton lowering: XLA's own Triton call (what jax
# 0.11.2 compiles to on an H200), or jaxlib's FFI call, which some jaxlib versions emit instead.
PALLAS_TRITON_TARGET = r"__gpu\$xla\.gpu\.triton|triton_kernel_call_ffi"


def backward_bytes(workload: Workload) -> int:
    """Read kv and the two output gradients, write kv's gradient."""
    return 3 * workload.shape.kv_nbytes(workload.total_ctx, workload.dtype)


def backward_verdict(grad_kv, kv, k_norm_weight, eps, cos_sin_cache, positions, grad_k, grad_v, *,
                     static: dict, dtype: str) -> str:
    """``'ok'``, or what is wrong with ``grad_kv`` (of ``dtype``) on the sampled token rows."""
    rows = checked_rows(int(kv.shape[0]))
    expected, _, _ = fused_kv_norm_rope_backward_reference(
        take_rows(kv, rows, 0), as_numpy(k_norm_weight), as_numpy(eps), as_numpy(cos_sin_cache),
        take_rows(positions, rows, 0), take_rows(grad_k, rows, 1), take_rows(grad_v, rows, 1), **static)
    mismatch = gradient_mismatch(take_rows(grad_kv, rows, 0), expected, dtype)
    return "FAIL: " + mismatch if mismatch else "ok"


def output_grads(workload: Workload, index: int, framework: str) -> tuple:
    """Random gradients of K and V for set ``index``: the next sets' ``kv``, reshaped and
    transposed to the outputs' layout (as random, and already in both frameworks)."""
    shape = workload.shape.output_shape(workload.total_ctx)
    grads = []
    for offset in (1, 2):
        kv, _ = workload.varying((index + offset) % workload.set_count, framework)
        flat = kv.reshape(workload.total_ctx, workload.shape.n_layers, -1)[:, :, :workload.shape.config.kv_size]
        grads.append(flat.reshape(shape[1], shape[0], *shape[2:]).swapaxes(0, 1))
    return tuple(grads)


def triton_backward(workload: Workload) -> Calls:
    """The Triton backward kernel (``fusedkv::fused_kv_norm_rope_backward``) on each set."""
    import torch

    import fusedkv_torch.backward  # noqa: F401  (registers the op)

    static = workload.shape.static()
    sets = workload.sets(backward_bytes(workload))
    args = [workload.op_args(i, "torch") for i in range(sets)]
    grads = [tuple(g.contiguous() for g in output_grads(workload, i, "torch")) for i in range(sets)]

    def call(i):
        return torch.ops.fusedkv.fused_kv_norm_rope_backward(*args[i], *grads[i], *static.values(), None)

    return Calls(call, sets, backward_bytes(workload),
                 lambda: backward_verdict(call(0)[0], *args[0], *grads[0], static=static, dtype=workload.dtype))


def pallas_backward(workload: Workload, *, lowering: str = "triton", kernel_target=PALLAS_TRITON_TARGET) -> Steps:
    """The Pallas backward kernel of ``lowering``'s forward on each set, its outputs fresh
    arrays (one custom call a call): on the Triton lowering on the tile jax.grad's backward
    takes, or the Mosaic GPU one (``"mosaic_gpu"``)."""
    import jax.numpy as jnp

    from fusedkv_jax import backward, mosaic_backward, ops

    static = workload.shape.static()
    sets = workload.sets(backward_bytes(workload))
    fixed = workload.shared("jax")
    varying = [(*workload.varying(i, "jax"), *output_grads(workload, i, "jax")) for i in range(sets)]
    kv = varying[0][0]
    call = CallShape(workload.shape.config, workload.total_ctx, workload.shape.n_layers, int(fixed[2].shape[0]))
    options = ops._launch_options(call, kv, None, None, None, None)
    interpret = options["interpret"]
    if lowering == "mosaic_gpu":
        launch = functools.partial(mosaic_backward.backward, config=options["config"], interpret=interpret)
    else:
        # The tile jax.grad's backward takes, from the forward's.
        block_tokens, block_heads, num_warps = backward.backward_tile(
            options["block_tokens"], options["block_heads"], workload.shape.config.head_dim)
        launch = functools.partial(backward._pallas_backward, config=options["config"], block_tokens=block_tokens,
                                   block_heads=block_heads, num_warps=num_warps, interpret=interpret)

    def step(fixed, varying, outputs):
        kv, positions, grad_k, grad_v = varying
        return launch(kv, fixed[0], fixed[1], fixed[2], positions, None, grad_k, grad_v)[:2]

    def new_outputs():
        return jnp.zeros(kv.shape, kv.dtype), jnp.zeros(fixed[0].shape, fixed[0].dtype)

    def check(outputs, index):
        kv, positions, grad_k, grad_v = varying[index]
        return backward_verdict(outputs[0], kv, *fixed, positions, grad_k, grad_v, static=static,
                                dtype=workload.dtype)

    return Steps(step, fixed, varying, new_outputs, backward_bytes(workload), check, fresh_outputs=True,
                 kernel_target=None if interpret else kernel_target)
