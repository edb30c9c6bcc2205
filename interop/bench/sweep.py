"""The kernels' tiles and the Pallas kernel's forms, one row each (``--sweep``, ``--forms``).

A tile is ``BTxBHxNW``: ``block_tokens``, ``block_heads`` and ``num_warps``, the
overrides both public functions take (powers of two), or ``d``, the kernel's own choice.
A form is two letters for the two rules of ``fusedkv_jax.kernel`` that choose the Pallas
kernel's shape of work: whether a program takes every layer (``loops_over_layers``),
then whether K is loaded as whole rows (``loads_k_rows``); each ``1`` (forced on), ``0``
(forced off) or ``p`` (the rule's own answer), so ``pp`` is the production kernel. The
rules are replaced while the call traces: both are static arguments of the kernel's
launch, so each form compiles a kernel of its own.

Rows are named ``triton-TILE``, ``pallas-TILE`` and, with forms, ``pallas-FORM-TILE``.
Their kind is ``sweep``: timed as the ``triton`` and ``pallas`` rows are, tabled apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools

from interop.bench.rows import Calls, Implementation, NotApplicable, Steps
from interop.bench.workload import Workload

DEFAULT_TILES = ("1x1x1", "2x1x1", "1x2x1", "1x8x2", "2x8x4", "4x8x4", "4x8x8")
RULES = {"layer_loop": "loops_over_layers", "k_rows": "loads_k_rows"}
FORM_LETTERS = {"1": True, "0": False, "p": None}
KERNELS = ("triton", "pallas")


def _is_power_of_two(text: str) -> bool:
    return text.isdigit() and int(text) > 0 and int(text) & (int(text) - 1) == 0


def tile_list(text: str) -> tuple[str, ...]:
    """``--sweep``'s comma-separated tiles, each ``d`` or ``BTxBHxNW`` of powers of two."""
    words = tuple(dict.fromkeys(word.strip() for word in text.split(",") if word.strip()))
    bad = [word for word in words
           if word != "d" and not (len(word.split("x")) == 3 and all(map(_is_power_of_two, word.split("x"))))]
    if not words or bad:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated tiles BLOCK_TOKENSxBLOCK_HEADSxNUM_WARPS of powers "
            "of two, or d for the kernel's own, such as d,1x8x2,2x8x4")
    return words


def form_list(text: str) -> tuple[str, ...]:
    """``--forms``' comma-separated two-letter forms, each letter 1, 0 or p."""
    words = tuple(dict.fromkeys(word.strip() for word in text.split(",") if word.strip()))
    if not words or any(len(word) != 2 or set(word) - set(FORM_LETTERS) for word in words):
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated two-letter forms of 1, 0 and p (layer loop, then K as "
            "rows), such as pp,1p,0p")
    return words


def tile_options(tile: str) -> dict:
    """The public functions' tile keywords for ``tile`` (none for ``d``)."""
    if tile == "d":
        return {}
    block_tokens, block_heads, num_warps = (int(part) for part in tile.split("x"))
    return dict(block_tokens=block_tokens, block_heads=block_heads, num_warps=num_warps)


def _kernel_with_rules():
    """``fusedkv_jax.kernel``, or :class:`NotApplicable` where it has not the rules a form forces."""
    from fusedkv_jax import kernel

    missing = [rule for rule in RULES.values() if not hasattr(kernel, rule)]
    if missing:
        raise NotApplicable(f"fusedkv_jax.kernel has no rule {', '.join(missing)} to force")
    return kernel


@contextlib.contextmanager
def forced(form: str):
    """Inside, each rule of ``fusedkv_jax.kernel`` answers the form's letter for it (``p``: its own)."""
    kernel = _kernel_with_rules()
    saved = {rule: getattr(kernel, rule) for rule in RULES.values()}
    for rule, letter in zip(RULES.values(), form):
        if FORM_LETTERS[letter] is not None:
            setattr(kernel, rule, lambda *args, value=FORM_LETTERS[letter], **kwargs: value)
    try:
        yield
    finally:
        for rule, function in saved.items():
            setattr(kernel, rule, function)


def _triton_tile(workload: Workload, *, tile: str) -> Calls:
    from interop.bench.registry import triton_calls

    options = tile_options(tile)
    heads = workload.shape.config.num_kv_heads
    if options and heads % options["block_heads"]:
        raise NotApplicable(f"the Triton kernel's block_heads must divide the {heads} heads")
    return triton_calls(workload, **options)


def _pallas_tile(workload: Workload, *, tile: str, form: str) -> Steps:
    from interop.bench.registry import pallas_steps

    if FORM_LETTERS[form[1]] is False and workload.shape.config.rope_style == "gptj":
        raise NotApplicable("gptj loads K as whole rows only")
    steps = pallas_steps(workload, lowering="triton", **tile_options(tile))
    if form == "pp":
        return steps
    _kernel_with_rules()

    def step(fixed, varying, outputs):
        with forced(form):
            return steps.step(fixed, varying, outputs)

    return dataclasses.replace(steps, step=step)


def implementations(tiles: tuple[str, ...], forms: tuple[str, ...] | None,
                    kernels: tuple[str, ...] = KERNELS) -> list[Implementation]:
    """The sweep's rows: each of ``kernels`` (Triton, Pallas) at every tile, or, with
    ``forms``, Pallas at every form and tile."""
    if forms:
        return [Implementation(f"pallas-{form}-{tile}", "jax", "sweep",
                               functools.partial(_pallas_tile, tile=tile, form=form))
                for form in forms for tile in tiles]
    return ([Implementation(f"triton-{tile}", "torch", "sweep", functools.partial(_triton_tile, tile=tile))
             for tile in tiles if "triton" in kernels]
            + [Implementation(f"pallas-{tile}", "jax", "sweep", functools.partial(_pallas_tile, tile=tile, form="pp"))
               for tile in tiles if "pallas" in kernels])
