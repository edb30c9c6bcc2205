"""One backend-neutral call: arrays of any framework in, the chosen kernel, arrays of the caller's framework out.

Inputs cross to the backend through DLPack (:mod:`interop.exchange` says what is
zero-copy and what is not), and results cross back, all arrays of a crossing at once
(:func:`interop.exchange.cross`): the consumer's stream waits for the work queued on
the producer's, on the device, never on the host (torch to jax: one event for all the
arrays; jax to torch: each buffer's own ready event, as jax offers no other). Every
input crosses on every call: a crossing kept from call to call reads stale values
once torch rewrites the tensor in place.

A call's route (backend chosen, outputs written in place, whether anything crosses)
depends on its arrays' types alone, so it is kept with the accepted call's signature
(``interop.core.spec.AcceptedCall``) and a repeated call only looks it up.

Given ``k_out``/``v_out`` and where they are written:

* same framework as the backend (torch tensors to the torch backend, NumPy arrays
  on the CPU to the torch backend): written in place, the very buffers returned;
* torch or NumPy outputs with the jax backend: jax writes fresh buffers, copied
  into the caller's (one copy of the outputs);
* jax outputs: jax arrays are immutable, so the caller gets new arrays; under
  ``jax.jit`` use ``fusedkv_jax`` with donated outputs to reuse their memory.

New arrays of another library (CuPy) are made by its module's ``from_dlpack``. Where
results could not be handed back (outputs of another library, which interop cannot
write into, or new arrays of a library without ``from_dlpack``), the route refuses the
call before anything is launched.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from interop.exchange import cross, framework_of, returns_to, to_caller, to_framework
from interop.core.spec import accept_call, check_output_buffers
from interop.registry import BACKENDS, backend_installed, load_backend

def choose_backend(backend: str, caller: str) -> str:
    """``auto``: the caller's own framework when its backend is installed, else the other."""
    if backend != "auto":
        load_backend(backend)
        return backend
    # NumPy arrays live on the host: jax places them on its own device, torch cannot.
    preferred = [caller] if caller in BACKENDS else ["jax"] if caller == "numpy" else []
    for name in preferred + [b for b in BACKENDS if b not in preferred]:
        if backend_installed(name):
            return name
    raise ValueError("No fused KV backend is installed: install fusedkv[torch] or fusedkv[jax].")


def fused_kv_norm_rope(
    kv,
    k_norm_weight,
    eps,
    cos_sin_cache,
    positions,
    *,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    rope_style: str = "neox",
    v_multiplier=None,
    k_out=None,
    v_out=None,
    backend: str = "auto",
    layer_rope_table=None,
):
    """RMSNorm + RoPE on K, V passed through, on any framework's arrays.

    ``kn = k * rsqrt(mean(k*k) + eps[l]) * k_norm_weight[l]``, RoPE on the first
    ``rotary_dim`` dims of ``kn``, ``v_out = v``; CONTRACT.md, Math.

    Args:
      kv: bf16/fp16/fp32[total_ctx, n_layers, 2*kv_size], any object with ``__dlpack__``.
      k_norm_weight: float[n_layers, head_dim], or None (no K-norm).
      eps: fp32[n_layers]; None exactly when ``k_norm_weight`` is.
      cos_sin_cache: fp32/bf16/fp16[max_pos, rotary_dim], read as fp32.
      positions: int32/int64[total_ctx].
      v_multiplier: optional fp32[n_layers]: V is ``v * v_multiplier[l]``, rounded once.
      k_out, v_out: optional dtype-of-kv[n_layers, total_ctx, num_kv_heads, head_dim]
        (see the module docstring for when they are written in place).
      backend: ``"torch"``, ``"jax"`` or ``"auto"``.
      layer_rope_table: int32[n_layers], each layer's table, exactly with a 3-D
        ``cos_sin_cache`` (``[n_tables, max_pos, rotary_dim]``, one table per RoPE).

    Returns:
      ``(k_out, v_out)`` as arrays of ``kv``'s framework.
    """
    outputs = (("k_out", k_out), ("v_out", v_out))
    accepted = accept_call(kv, k_norm_weight, eps, cos_sin_cache, positions, k_out, v_out,
                           num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
                           rope_style=rope_style, v_multiplier=v_multiplier, takes="any",
                           layer_rope_table=layer_rope_table)
    check_output_buffers(kv, outputs)
    # The route depends on the arrays' types only, which the accepted call's signature holds.
    route = accepted.prepared.get(("interop", backend)) if isinstance(backend, str) else None
    if route is None:  # the route raises for a backend that is not one
        route = _Route(backend, (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table,
                                 k_out, v_out))
        accepted.prepared[("interop", backend)] = route
    arrays = (kv, k_norm_weight, eps, cos_sin_cache, positions, v_multiplier, layer_rope_table)
    if route.crosses:  # per call: grad mode, requires_grad and tracing are no part of the signature
        _check_crossable((*zip(_ARRAY_NAMES, arrays), *outputs), route.backend)
    in_place = {name: out for name, out in outputs if name in route.in_place}
    # Validated above on the caller's arrays, whose shapes, dtypes and devices crossing keeps.
    if not route.crosses:
        # Everything is the backend's already: nothing crosses either way, and its results
        # (the outputs given, written in place, or new arrays) are the caller's.
        return tuple(route.module.fused_kv_norm_rope_accepted(accepted, *arrays[:5], v_multiplier=arrays[5],
                                                              layer_rope_table=arrays[6], **in_place))
    inputs = cross(arrays, route.backend, one_launch=True)  # read by the backend's launch alone
    in_place = {name: to_framework(out, route.backend) for name, out in in_place.items()}
    results = route.module.fused_kv_norm_rope_accepted(accepted, *inputs[:5], v_multiplier=inputs[5],
                                                       layer_rope_table=inputs[6], **in_place)
    return _deliver((k_out, v_out), results, route.caller, route.backend)


class _Route:
    """Where a call of one signature goes: the caller's framework, the backend chosen and
    its module, which outputs it writes in place, and whether any array crosses. Made
    once per accepted call and backend argument (a refused route raises every time)."""

    __slots__ = ("caller", "backend", "module", "in_place", "crosses")

    def __init__(self, backend: str, arrays: tuple):
        kv, k_out, v_out = arrays[0], arrays[-2], arrays[-1]
        self.caller = framework_of(kv)
        self.backend = choose_backend(backend, self.caller)
        self.module = load_backend(self.backend)
        if self.backend == "torch" and self.caller == "numpy" and _torch_on_gpu():
            raise ValueError("NumPy arrays live on the host and the Triton kernel runs on the GPU "
                             "here: pass torch CUDA tensors, or use backend='jax'.")
        self.in_place = tuple(name for name, out in (("k_out", k_out), ("v_out", v_out))
                              if _written_in_place(out, self.backend))
        self.crosses = any(array is not None and framework_of(array) != self.backend for array in arrays)
        _check_deliverable(kv, self.caller, (("k_out", k_out), ("v_out", v_out)), self.in_place)


_ARRAY_NAMES = ("kv", "k_norm_weight", "eps", "cos_sin_cache", "positions", "v_multiplier", "layer_rope_table")
# The arrays a call's gradients are taken with respect to (CONTRACT.md, Gradients).
_DIFFERENTIATED = ("kv", "k_norm_weight", "v_multiplier")


def _check_crossable(named_arrays, backend: str) -> None:
    """Refuse, before anything crosses, an array whose meaning crossing would lose: a torch
    tensor autograd records (its gradient would be dropped on the way) and a traced jax array
    (inside ``jax.jit``, ``jax.grad``... it has no values for another framework's kernel)."""
    for name, array in named_arrays:
        framework = None if array is None else framework_of(array)
        if framework in (None, backend):
            continue
        if framework == "torch" and name in _DIFFERENTIATED and _records_grad(array):
            raise ValueError(
                f"Invalid {name} for fused KV materialization: got a torch tensor that requires grad for the "
                f"{backend} backend, expected one that does not (gradients do not cross frameworks: "
                "backend='torch' differentiates, or detach the tensor).")
        if framework == "jax" and _traced(array):
            raise TypeError(
                f"Invalid {name} for fused KV materialization: got a traced jax array (inside jax.jit, "
                f"jax.grad or another jax transformation) for the {backend} backend, expected a concrete array "
                "(another framework's kernel cannot run on values that do not exist yet: backend='jax' runs "
                "inside jax transformations).")


def _records_grad(tensor) -> bool:
    import torch

    return torch.is_grad_enabled() and tensor.requires_grad


def _traced(array) -> bool:
    import jax

    return isinstance(array, jax.core.Tracer)


@functools.cache
def _torch_on_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _written_in_place(out, backend: str) -> bool:
    return out is not None and backend == "torch" and framework_of(out) in ("torch", "numpy")


_WRITTEN_INTO = ("numpy", "torch", "jax")  # the given outputs' frameworks _deliver writes (or replaces)


def _check_deliverable(kv, caller: str, outputs, in_place) -> None:
    """Refuse, before anything is launched, a call whose results :func:`_deliver` could not
    hand back: a given output it cannot write into, or a result bound for ``kv``'s
    framework (an output not given, or a jax one) when that has no ``from_dlpack``."""
    to_kv_framework = False
    for name, out in outputs:
        if name in in_place:
            continue
        framework = None if out is None else framework_of(out)
        if out is not None and framework not in _WRITTEN_INTO:
            raise TypeError(
                f"Invalid {name} for fused KV materialization: got {framework}.{type(out).__qualname__}, "
                f"expected a NumPy, torch or jax array (interop writes results into those), or no "
                f"{name} for a new array of kv's framework."
            )
        to_kv_framework = to_kv_framework or out is None or framework == "jax"
    if to_kv_framework and not returns_to(caller):
        raise TypeError(
            f"Invalid kv for fused KV materialization: got {caller}.{type(kv).__qualname__}, "
            "whose module has no from_dlpack to return results through, expected an array of "
            "NumPy, torch, jax or a library with from_dlpack (or NumPy or torch k_out and v_out "
            "to write results into)."
        )


def _deliver(givens, results, caller: str, backend: str) -> tuple:
    """The results as the caller should see them: its own buffers (written in place, or
    copied into), or new arrays of its framework; one crossing for both."""
    if framework_of(results[0]) == caller and all(
            given is None or _written_in_place(given, backend) for given in givens):
        return tuple(result if given is None else given for given, result in zip(givens, results))
    delivered = list(givens)
    moving = {}  # framework -> indices of the results going there
    for index, given in enumerate(givens):
        if not _written_in_place(given, backend):
            target = caller if given is None or framework_of(given) == "jax" else framework_of(given)
            moving.setdefault(target, []).append(index)
    for target, indices in moving.items():
        if target in ("torch", "jax"):
            arrays = cross([results[i] for i in indices], target)
        else:
            arrays = [to_caller(results[i], target) for i in indices]
        for index, array in zip(indices, arrays):
            given = givens[index]
            if given is None or framework_of(given) == "jax":
                delivered[index] = array
            elif target == "numpy":
                np.copyto(given, array)
            else:
                given.copy_(array)
    return tuple(delivered)
