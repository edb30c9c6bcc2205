"""The check every measured implementation passes before it is timed, on outputs of any framework.

The inputs are random with every position inside the cos/sin table, so a correct
output holds no NaN: outputs are poisoned with NaN before the checked call, and a NaN
left anywhere is an element the implementation never wrote. Then a sample of token
rows (the first and last eight and 64 drawn at random) is compared with the interop
reference run on those rows alone (the op treats each token on its own), which keeps
the check cheap at 65536 tokens: K within the tolerance table, V bit for bit.
"""

from __future__ import annotations

import numpy as np

from interop.core.arrays import as_numpy
from interop.exchange import framework_of
from interop.core.materializer import materializer_reference, projection_reference
from interop.core.reference import fused_kv_norm_rope_reference
from interop.testing import END_TO_END_TOLERANCE, bit_mismatches, compare

CHECKED_ROWS = 64


def checked_rows(total_ctx: int) -> np.ndarray:
    """The token rows a check compares: the first and last eight, and a seeded random sample."""
    rng = np.random.default_rng(total_ctx)
    edges = np.r_[0:min(8, total_ctx), max(0, total_ctx - 8):total_ctx]
    return np.unique(np.r_[edges, rng.integers(0, total_ctx, CHECKED_ROWS)])


def take_rows(array, rows: np.ndarray, axis: int) -> np.ndarray:
    """``array``'s entries ``rows`` along ``axis``, gathered on its own device, as a host array."""
    framework = framework_of(array)
    if framework == "torch":
        import torch

        return as_numpy(array.index_select(axis, torch.as_tensor(rows, device=array.device)))
    if framework == "jax":
        import jax.numpy as jnp

        return np.asarray(jnp.take(array, jnp.asarray(rows), axis=axis))
    return np.take(as_numpy(array), rows, axis=axis)


def count_nan(array) -> int:
    """NaN elements of ``array``, counted on its own device."""
    framework = framework_of(array)
    if framework == "torch":
        import torch

        return int(torch.isnan(array).sum())
    if framework == "jax":
        import jax.numpy as jnp

        return int(jnp.isnan(array).sum())
    return int(np.isnan(as_numpy(array).astype(np.float32)).sum())


def verdict(k, v, k_expected, v_expected, *, v_exact: bool = True) -> str:
    """A row's check column: ``'ok'``, or ``'FAIL: '`` and the worst K element or V's count.

    K is held to the tolerance table; V bit for bit, or (``v_exact`` False, for an fp8
    cache the GPU quantizes with its own division) to the table too.
    """
    k_result = compare(k, k_expected)
    v_bad = bit_mismatches(v, v_expected)[0] if v_exact else compare(v, v_expected, name="v").n_bad
    if k_result.ok and not v_bad:
        return "ok"
    return "FAIL: " + (k_result.report() if not k_result.ok else f"v: {v_bad} elements differ")


def _sampled(k, v, rows, slots) -> tuple[tuple, int]:
    """``(k, v)``'s token ``rows`` on the host, and the NaN elements left unwritten: in the
    whole outputs, or (``slots``: paged caches) in the sampled tokens' slots only."""
    if slots is None:
        return (take_rows(k, rows, 1), take_rows(v, rows, 1)), count_nan(k) + count_nan(v)
    at = take_rows(slots, rows, 0)
    got = take_rows(k, at, 1), take_rows(v, at, 1)
    return got, count_nan(got[0]) + count_nan(got[1])


def op_verdict(k, v, kv, k_norm_weight, eps, cos_sin_cache, positions, *, static: dict, options: dict | None = None,
               v_exact: bool = True, slots=None) -> str:
    """``'ok'``, or what is wrong with ``(k, v)``, the op's outputs for these inputs.

    ``k, v``: [n_layers, total_ctx, num_kv_heads, head_dim] and the inputs, arrays of
    any framework on any device (``k_norm_weight`` and ``eps`` None for no K-norm);
    ``static``: the op's ``num_kv_heads``, ``head_dim``, ``rotary_dim`` and ``rope_style``;
    ``options``: the call's ``v_multiplier`` and ``layer_rope_table``, if any; ``v_exact``:
    see :func:`verdict`. ``slots``: ``k`` and ``v`` are paged caches holding token ``t``
    at slot ``slots[t]``; only the sampled tokens' slots are read.
    """
    rows = checked_rows(int(kv.shape[0]))
    got, unwritten = _sampled(k, v, rows, slots)
    if unwritten:
        return f"FAIL: {unwritten} elements unwritten (NaN)"
    k_expected, v_expected = fused_kv_norm_rope_reference(
        take_rows(kv, rows, 0), k_norm_weight, eps, as_numpy(cos_sin_cache), take_rows(positions, rows, 0),
        **static, **(options or {}))
    return verdict(*got, k_expected, v_expected, v_exact=v_exact)


def projection_verdict(kv, ctx_hidden, layers, *, tolerance=END_TO_END_TOLERANCE) -> str:
    """``'ok'``, or what is wrong with ``kv``, a materializer's GEMM output for ``ctx_hidden``.

    The GEMM rounds to kv's dtype after accumulating in its own order, so it is held to
    :data:`~interop.testing.END_TO_END_TOLERANCE`, whose reason covers that rounding,
    rather than bit for bit (FP8 weights: ``tolerance``
    :data:`~interop.testing.FP8_GEMM_TOLERANCE`, for the FP8 GEMM's quantized activations).
    """
    unwritten = count_nan(kv)
    if unwritten:
        return f"FAIL: {unwritten} elements unwritten (NaN)"
    rows = checked_rows(int(kv.shape[0]))
    got = take_rows(kv, rows, 0)
    expected = projection_reference(layers, take_rows(ctx_hidden, rows, 0)).astype(got.dtype)
    result = compare(got, expected, name="kv", tolerance=tolerance)
    return "ok" if result.ok else "FAIL: " + result.report()


def end_to_end_verdict(k, v, layers, ctx_hidden, positions, *, slots=None, tolerance=END_TO_END_TOLERANCE) -> str:
    """``'ok'``, or what is wrong with ``(k, v)``, a materializer's outputs for ``ctx_hidden``.

    Against the materializer's fp32 NumPy path (:func:`interop.core.materializer.materializer_reference`)
    under :data:`~interop.testing.END_TO_END_TOLERANCE`: checking against the op's reference
    on a second GEMM of the same inputs would hold the GEMM to its own rounding, which XLA
    may reach by another algorithm in another compilation. ``slots``: ``k`` and ``v`` are
    paged caches holding token ``t`` at slot ``slots[t]``; only the sampled tokens' slots
    are read (the other slots are the cache's, not the call's). FP8 weights: ``tolerance``
    :data:`~interop.testing.FP8_GEMM_TOLERANCE`, as in :func:`projection_verdict`.
    """
    rows = checked_rows(int(ctx_hidden.shape[0]))
    got, unwritten = _sampled(k, v, rows, slots)
    if unwritten:
        return f"FAIL: {unwritten} elements unwritten (NaN)"
    k_expected, v_expected = materializer_reference(layers, take_rows(ctx_hidden, rows, 0),
                                                    take_rows(positions, rows, 0))
    for name, sampled, expected in (("k", got[0], k_expected), ("v", got[1], v_expected)):
        result = compare(sampled, expected, name=name, tolerance=tolerance)
        if not result.ok:
            return "FAIL: " + result.report()
    return "ok"


def kv_copy_verdict(outputs, kv, *, num_kv_heads: int, head_dim: int) -> str:
    """``'ok'`` when the sampled token rows of ``outputs`` hold K and V of ``kv``, bit for bit."""
    rows = checked_rows(int(kv.shape[0]))
    sampled = take_rows(kv, rows, 0)
    halves = sampled.reshape(len(rows), sampled.shape[1], 2, num_kv_heads, head_dim).transpose(2, 1, 0, 3, 4)
    mismatches = sum(bit_mismatches(take_rows(out, rows, 1), np.ascontiguousarray(expected))[0]
                     for out, expected in zip(outputs, halves))
    return "ok" if not mismatches else f"FAIL: {mismatches} elements differ from kv"


def copy_verdict(destination, source, *, negated: bool = False) -> str:
    """``'ok'`` when the sampled rows of ``destination`` hold ``source``'s bits (or its negation)."""
    rows = checked_rows(int(source.shape[0]))
    expected = take_rows(source, rows, 0)
    if negated:
        expected = -expected
    mismatches = bit_mismatches(take_rows(destination, rows, 0), expected)[0]
    return "ok" if not mismatches else f"FAIL: {mismatches} elements differ from the source"
