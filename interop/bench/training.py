"""``fusedkv bench``'s rows of a training step through the op, its forward and backward, beside
autodiff of the unfused math in each framework, all of kind ``backward``:

* ``triton-train``: ``fusedkv_torch.fused_kv_norm_rope`` and ``torch.autograd.grad`` of its
  outputs (the Triton forward, then the Triton backward kernel);
* ``torch-compile-train``: the same of the baselines' plain PyTorch math
  (:func:`~interop.bench.baselines.torch_reference_math`) under ``torch.compile``, whose
  AOTAutograd compiles the forward and its derived backward;
* ``pallas-train``: ``jax.vjp`` of ``fusedkv_jax.fused_kv_norm_rope`` inside the chain's jit
  (the Pallas forward, then the Pallas backward kernel);
* ``jnp-jit-train``: ``jax.vjp`` of the baselines' jnp math
  (:func:`~interop.bench.baselines.jnp_reference_math`) in the same jit, which XLA fuses.

Each call differentiates with respect to ``kv`` and ``k_norm_weight``, given random
gradients of K and V (:func:`~interop.bench.backward.output_grads`, contiguous, as the
attention above the op hands them on), and returns K, V and both gradients, so that no
part of the step can be dropped as unused.

Bytes moved: what a forward and a backward cannot avoid, ``5 * kv.nbytes``: the forward
reads ``kv`` and writes K and V (``2 * kv.nbytes``), the backward reads ``kv`` and the
gradients of K and V and writes ``kv``'s gradient (``3 * kv.nbytes``). The weight's
gradient, its partial sums, the small per-layer arrays and the cos/sin rows are not
counted. The check compares K and V with the reference, then the sampled token rows of
``kv``'s gradient with the reference backward
(:func:`~interop.bench.backward.backward_verdict`); the weight's gradient, a sum over
every token, is the tests' to check.
"""

from __future__ import annotations

from typing import Callable

from interop.bench.backward import backward_bytes, backward_verdict, output_grads
from interop.bench.check import op_verdict
from interop.bench.rows import Calls, Steps, nan_pair
from interop.bench.workload import Workload

# forward(kv, k_norm_weight, eps, cos_sin_cache, positions) -> (k, v), the op's outputs.
Forward = Callable[..., tuple]


def training_bytes(workload: Workload) -> int:
    """The forward's ``2 * kv.nbytes`` and the backward's ``3 * kv.nbytes``."""
    return workload.shape.op_bytes(workload.total_ctx, workload.dtype) + backward_bytes(workload)


def _training_verdict(k, v, grad_kv, op_args, grads, *, workload: Workload) -> str:
    """``'ok'``, or what is wrong with the forward's outputs or else with ``kv``'s gradient."""
    static = workload.shape.static()
    forward = op_verdict(k, v, *op_args, static=static)
    if forward != "ok":
        return forward
    return backward_verdict(grad_kv, *op_args, *grads, static=static, dtype=workload.dtype)


def torch_training(workload: Workload, forward: Forward) -> Calls:
    """``forward`` on each set, then ``torch.autograd.grad`` of K and V with respect to
    ``kv`` and ``k_norm_weight``: ``(k, v, grad_kv, grad_k_norm_weight)``."""
    import torch

    sets = workload.sets(training_bytes(workload))
    args = [workload.op_args(i, "torch") for i in range(sets)]
    # Leaves of their own: the workload's tensors stay free of autograd for the other rows.
    weight = args[0][1].detach().requires_grad_()
    leaves = [(kv.detach().requires_grad_(), weight, *rest) for kv, _, *rest in args]
    grads = [tuple(g.contiguous() for g in output_grads(workload, i, "torch")) for i in range(sets)]

    def call(i):
        kv, weight, eps, cos_sin_cache, positions = leaves[i]
        k, v = forward(kv, weight, eps, cos_sin_cache, positions)
        return (k, v, *torch.autograd.grad((k, v), (kv, weight), grads[i]))

    def check():
        k, v, grad_kv, _ = (output.detach() for output in call(0))
        return _training_verdict(k, v, grad_kv, args[0], grads[0], workload=workload)

    return Calls(call, sets, training_bytes(workload), check)


def jax_training(workload: Workload, forward: Forward, *, kernel_target: str | None = None) -> Steps:
    """``jax.vjp`` of ``forward`` with respect to ``kv`` and ``k_norm_weight`` on each set,
    its cotangents applied: ``(k, v, grad_kv, grad_k_norm_weight)``, fresh arrays.
    ``kernel_target``: ``forward`` is a kernel whose backward is one too, each launched
    once a call, custom calls of this target (see :class:`~interop.bench.rows.Steps`)."""
    import jax
    import jax.numpy as jnp

    sets = workload.sets(training_bytes(workload))
    fixed = workload.shared("jax")
    varying = [(*workload.varying(i, "jax"), *output_grads(workload, i, "jax")) for i in range(sets)]

    def step(fixed, varying, outputs):
        kv, positions, grad_k, grad_v = varying
        weight, eps, cos_sin_cache = fixed
        (k, v), vjp = jax.vjp(lambda kv, weight: forward(kv, weight, eps, cos_sin_cache, positions), kv, weight)
        return (k, v, *vjp((grad_k, grad_v)))

    def new_outputs():
        kv, weight = varying[0][0], fixed[0]
        return (*nan_pair(workload, "jax"), jnp.full(kv.shape, jnp.nan, kv.dtype),
                jnp.full(weight.shape, jnp.nan, weight.dtype))

    def check(outputs, index):
        kv, positions, grad_k, grad_v = varying[index]
        return _training_verdict(*outputs[:3], (kv, *fixed, positions), (grad_k, grad_v), workload=workload)

    return Steps(step, fixed, varying, new_outputs, training_bytes(workload), check, fresh_outputs=True,
                 kernel_target=kernel_target, kernel_launches=2)
