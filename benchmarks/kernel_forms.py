"""The Pallas kernel's forms timed against each other, in jit, beside torch's copy (a GPU machine).

    PYTHONPATH=. python3 benchmarks/kernel_forms.py SHAPE TOKENS FORMS TILES [--rounds N] [--out FILE]

SHAPE is a ``fusedkv bench`` shape (draft, hd256, rotary64); TOKENS a comma list. FORMS
is a comma list of two-letter words: whether programs take every layer
(``fusedkv_jax.kernel.loops_over_layers``), then whether K is loaded as whole rows
(``loads_k_rows``), each ``1`` (forced on), ``0`` (forced off) or ``p`` (the production
rule); ``pp`` is the default kernel (``gptj`` needs whole rows: forced off, its rows fail
their check). TILES is a comma list of ``d`` (the default tile) or
``BLOCK_TOKENSxNUM_WARPS``. Every form and tile is one row, checked against the NumPy
reference on poisoned outputs and timed as ``fusedkv bench`` times the ``pallas`` row
(:mod:`interop.bench.runner`, quick effort); rounds alternate the rows' order, the copy
first and then last. Each round's rows print when it ends and go to ``--out`` as JSON lines.

The forms are forced by replacing the two rule functions while the jit traces: both are
static arguments of the kernel's launch, so each form compiles a kernel of its own.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from fusedkv_jax import kernel  # noqa: E402
from interop.bench.registry import BY_NAME, Implementation, _pallas  # noqa: E402
from interop.bench.runner import QUICK, run  # noqa: E402
from interop.bench.shapes import SHAPES  # noqa: E402

RULES = {"layer_loop": "loops_over_layers", "k_rows": "loads_k_rows"}


@contextlib.contextmanager
def forced(**forms):
    """Inside, each rule named (``layer_loop``, ``k_rows``) answers its value; None keeps the rule."""
    saved = {rule: getattr(kernel, rule) for rule in RULES.values()}
    for name, value in forms.items():
        if value is not None:
            setattr(kernel, RULES[name], lambda *args, value=value, **kwargs: value)
    try:
        yield
    finally:
        for rule, function in saved.items():
            setattr(kernel, rule, function)


def _formed(workload, *, forms, tile):
    options = {} if tile is None else dict(block_tokens=tile[0], num_warps=tile[1])
    steps = _pallas(workload, lowering="triton", **options)

    def step(fixed, varying, outputs):
        with forced(**forms):
            return steps.step(fixed, varying, outputs)
    return dataclasses.replace(steps, step=step)


def _form(word: str) -> dict:
    return {name: None if letter == "p" else letter == "1" for name, letter in zip(RULES, word)}


def _tile(word: str):
    return None if word == "d" else tuple(int(part) for part in word.split("x"))


def implementations(form_words: list[str], tile_words: list[str]) -> list[Implementation]:
    return [Implementation(f"{form}-{tile}", "jax", "kernel",
                           functools.partial(_formed, forms=_form(form), tile=_tile(tile)))
            for form in form_words for tile in tile_words]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("tokens")
    parser.add_argument("forms")
    parser.add_argument("tiles")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "kernel_forms.jsonl"))
    options = parser.parse_args()
    rows = [BY_NAME["torch-copy"]] + implementations(options.forms.split(","), options.tiles.split(","))
    tokens = [int(count) for count in options.tokens.split(",")]
    with open(options.out, "a") as out:
        for round_index in range(options.rounds):
            order = rows if round_index % 2 == 0 else rows[::-1]
            tasks = [(SHAPES[options.shape], count, row) for count in tokens for row in order]
            for found in run(tasks, dtype="bfloat16", framework="torch", effort=QUICK,
                             on_error=lambda failed, trace: print(failed.implementation, failed.error, trace)):
                seconds = found.seconds
                out.write(json.dumps(dict(round=round_index, shape=found.shape, tokens=found.tokens,
                                          form=found.implementation, us=seconds and seconds * 1e6,
                                          check=found.check)) + "\n")
                timing = "" if seconds is None else f"{seconds * 1e6:9.2f} us {found.bytes_moved / seconds / 1e9:6.0f} GB/s"
                print(f"round {round_index} {found.shape:9s} {found.tokens:6d} {found.implementation:12s} {timing} "
                      f"{found.check}", flush=True)


if __name__ == "__main__":
    main()
