"""The kernels as ``fusedkv check`` runs them: the same input bytes, through DLPack, to each.

The inputs are placed once, in one framework (torch on a GPU when it is installed,
else jax on a GPU, else NumPy on the CPU), and every backend is called on those
very buffers through :func:`interop.dispatch.fused_kv_norm_rope`, so a difference
between backends is a difference of kernels, not of inputs.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from interop import dispatch, registry
from interop.core.arrays import as_numpy
from interop.exchange import to_jax, to_torch
from interop.core.spec import FusedKVConfig


@dataclasses.dataclass(frozen=True)
class BackendRun:
    name: str
    device: str
    k: np.ndarray
    v: np.ndarray
    first_call_seconds: float
    second_call_seconds: float


class BackendUnavailable(Exception):
    """The backend's framework or kernel is not installed here; the message says which."""


def gpu_framework() -> str | None:
    """The framework that will hold the shared inputs on a GPU, or None without a GPU."""
    if registry.backend_installed("torch"):
        import torch

        if torch.cuda.is_available():
            return "torch"
    if registry.backend_installed("jax"):
        import jax

        if jax.default_backend() == "gpu":
            return "jax"
    return None


def place_inputs(arrays: tuple) -> tuple:
    """The host ``arrays`` (None where an optional one is not given) on the device every
    backend will read them from."""
    framework = gpu_framework()
    if framework == "torch":
        return tuple(None if a is None else to_torch(a).to("cuda") for a in arrays)
    if framework == "jax":
        return tuple(None if a is None else to_jax(a) for a in arrays)
    return arrays


@dataclasses.dataclass(frozen=True)
class Platform:
    """Where and how a backend's kernel runs here.

    ``device``: the short label of ``fusedkv check``'s table; ``how``: the kernel, its
    lowering, and whether it is compiled or interpreted, and why.
    """

    name: str
    device: str
    how: str


def platform(name: str, lowering: str | None = None) -> Platform:
    """What backend ``name`` runs on here, read from the frameworks without running anything;
    ``lowering``: the jax backend's Pallas lowering, None for its default."""
    if not registry.backend_installed(name):
        needs = "torch and triton" if name == "torch" else "jax"
        return Platform(name, "-", f"not installed: needs {needs} (pip install fusedkv[{name}])")
    if name == "torch":
        import torch

        if not torch.cuda.is_available():
            return Platform(name, "CPU (Triton interpret)",
                            "Triton kernel, interpreted (TRITON_INTERPRET=1) because torch sees no "
                            "CUDA device")
        gpu = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        if os.environ.get("TRITON_INTERPRET") == "1":
            return Platform(name, "GPU (Triton interpret)",
                            f"Triton kernel, interpreted because TRITON_INTERPRET=1 is set (GPU: {gpu})")
        return Platform(name, f"GPU ({gpu})",
                        f"Triton kernel, compiled for {gpu} (compute capability {major}.{minor})")
    import jax

    mosaic = lowering == "mosaic_gpu"
    kernel = f"Pallas kernel ({'Mosaic GPU' if mosaic else 'Triton'} lowering)"
    if jax.default_backend() != "gpu":
        return Platform(name, "CPU (Mosaic GPU interpret)" if mosaic else "CPU (Pallas interpret)",
                        f"{kernel}, interpret mode because jax has no GPU "
                        f"(its default backend is {jax.default_backend()})")
    kind = jax.devices()[0].device_kind
    return Platform(name, f"GPU ({kind})", f"{kernel}, compiled for {kind}")


def triton_interpreted() -> bool:
    """Whether the torch backend runs Triton's interpreter here (as :func:`platform` says)."""
    import torch

    return not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def inputs_placement() -> str:
    """Where :func:`place_inputs` puts the inputs, in words."""
    framework = gpu_framework()
    if framework == "torch":
        return "torch tensors on cuda:0"
    if framework == "jax":
        import jax

        return f"jax arrays on {jax.devices()[0]}"
    return "NumPy arrays on the CPU"


def _wait(outputs):
    for output in outputs:
        if hasattr(output, "block_until_ready"):
            output.block_until_ready()
        elif type(output).__module__.startswith("torch") and output.is_cuda:
            import torch

            torch.cuda.synchronize(output.device)
    return outputs


def run_backend(name: str, placed: tuple, config: FusedKVConfig, lowering: str | None = None) -> BackendRun:
    """Call backend ``name`` twice on ``placed`` and time both calls (the first compiles).

    ``placed``: the op's five arrays, then ``v_multiplier`` and ``layer_rope_table`` (or None).
    ``lowering``: the jax backend's Pallas lowering, None for its default; given, the jax
    kernel is called from ``fusedkv_jax`` on the same buffers (as the gradients are), since
    :mod:`interop.dispatch` is the same for every backend and takes no lowering.
    """
    try:
        registry.load_backend(name)
    except ImportError as error:
        raise BackendUnavailable(f"{name} backend not installed ({error})") from error

    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
                  rope_style=config.rope_style)

    def call():
        if lowering is not None:
            import fusedkv_jax

            arrays = [None if a is None else to_jax(a) for a in placed]
            return _wait(fusedkv_jax.fused_kv_norm_rope(*arrays[:5], **static, v_multiplier=arrays[5],
                                                        layer_rope_table=arrays[6], lowering=lowering))
        return _wait(dispatch.fused_kv_norm_rope(*placed[:5], **static, v_multiplier=placed[5], backend=name,
                                                 layer_rope_table=placed[6]))

    start = time.perf_counter()
    call()
    first = time.perf_counter()
    k, v = call()
    second = time.perf_counter()
    return BackendRun(name, platform(name, lowering).device, as_numpy(k), as_numpy(v), first - start,
                      second - first)


@dataclasses.dataclass(frozen=True)
class GradientRun:
    """A backend's gradients: ``grad_kv``, then ``grad_k_norm_weight`` and ``grad_v_multiplier``
    where the call has a K-norm, a multiplier (the names of :data:`GRADIENT_NAMES`)."""

    name: str
    device: str
    grads: dict


GRADIENT_NAMES = ("grad_kv", "grad_k_norm_weight", "grad_v_multiplier")


def run_backend_gradients(name: str, placed: tuple, cotangents: tuple, config: FusedKVConfig,
                          lowering: str | None = None) -> GradientRun:
    """Backend ``name``'s gradients of its op on ``placed`` (as :func:`run_backend`'s) for the
    outputs' cotangents ``(grad_k, grad_v)``: torch's autograd through
    ``fusedkv_torch.fused_kv_norm_rope``, ``jax.vjp`` of ``fusedkv_jax.fused_kv_norm_rope``
    (its forward on ``lowering``, as for :func:`run_backend`)."""
    try:
        registry.load_backend(name)
    except ImportError as error:
        raise BackendUnavailable(f"{name} backend not installed ({error})") from error
    static = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, rotary_dim=config.rotary_dim,
                  rope_style=config.rope_style)
    kv, k_norm_weight, eps, table, positions, v_multiplier, layer_rope_table = placed
    # The differentiated inputs, by gradient name: kv always, the weight and the multiplier where given.
    wrt = {grad: array for grad, array in zip(GRADIENT_NAMES, (kv, k_norm_weight, v_multiplier))
           if array is not None}
    if name == "torch":
        import torch

        import fusedkv_torch

        tensors = {grad: to_torch(array).detach().requires_grad_() for grad, array in wrt.items()}
        rest = [None if a is None else to_torch(a) for a in (eps, table, positions, layer_rope_table)]
        k, v = fusedkv_torch.fused_kv_norm_rope(
            tensors["grad_kv"], tensors.get("grad_k_norm_weight"), rest[0], rest[1], rest[2], **static,
            v_multiplier=tensors.get("grad_v_multiplier"), layer_rope_table=rest[3])
        grads = torch.autograd.grad((k, v), list(tensors.values()), [to_torch(g) for g in cotangents])
    else:
        import jax

        import fusedkv_jax

        rest = [None if a is None else to_jax(a) for a in (eps, table, positions, layer_rope_table)]

        def op(differentiated):
            return fusedkv_jax.fused_kv_norm_rope(
                differentiated["grad_kv"], differentiated.get("grad_k_norm_weight"), rest[0], rest[1], rest[2],
                **static, v_multiplier=differentiated.get("grad_v_multiplier"), layer_rope_table=rest[3],
                lowering=lowering)

        _, vjp = jax.vjp(op, {grad: to_jax(array) for grad, array in wrt.items()})
        by_name, = vjp(tuple(to_jax(g) for g in cotangents))
        grads = [by_name[grad] for grad in wrt]
    return GradientRun(name, platform(name, lowering).device, {grad: as_numpy(g) for grad, g in zip(wrt, grads)})
