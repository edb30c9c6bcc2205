"""Cross-backend equivalence: every backend against the reference and against each other."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from typing import Callable

import numpy as np

from interop.command.backends import (GRADIENT_NAMES, BackendUnavailable, gpu_framework, place_inputs,
                                      run_backend, run_backend_gradients, triton_interpreted)
from interop.core.arrays import numpy_dtype
from interop.registry import BACKENDS, backend_installed
from interop.core.reference import fused_kv_norm_rope_reference, rope_cos_sin_cache
from interop.core.reference_backward import fused_kv_norm_rope_backward_reference
from interop.core.spec import FusedKVConfig
from interop.testing import bit_mismatches, compare, gradient_mismatch, random_inputs

DEFAULT_TOKENS_GPU = 4096
DEFAULT_TOKENS_CPU = 16
DEFAULT_TOKENS_CPU_MOSAIC = 64  # Mosaic GPU's interpreter copies whole blocks of 64 tokens

# What a check holds on the host at its peak, per element of kv: the inputs, the fp32
# reference, each backend's outputs and the comparisons' fp64 copies; per element of the
# cos/sin table, the fp64 angles, cos and sin it is built from before its fp32 copy.
HOST_BYTES_PER_KV_ELEMENT = 48
HOST_BYTES_PER_TABLE_ELEMENT = 32
# What --grad adds per element of kv: the reference backward's fp64 intermediates (about 42
# bytes at its peak), its fp64 gradient, and each comparison's fp64 copies.
HOST_BYTES_PER_KV_ELEMENT_GRADIENTS = 64

# What a check costs in interpret mode (no GPU), fitted to checks timed on a CPU: the
# inputs and the reference per element of kv, each comparison of two backends per element,
# the cos/sin table per element; then what each backend adds (INTERPRETED_COSTS).
INTERPRETED_SECONDS_PER_KV_ELEMENT = 50e-9
INTERPRETED_SECONDS_PER_PAIR_ELEMENT = 40e-9
INTERPRETED_SECONDS_PER_TABLE_ELEMENT = 15e-9

# Table t of ``--tables`` has base ROPE_BASE * (t + 1): distinct bases, all finite, table 0 the
# one of the 2-D default.
ROPE_BASE = 10000.0
# The range of MiMo's per-layer attention_value_scale, which ``--v-multiplier`` draws from.
V_MULTIPLIER_RANGE = (0.6, 0.72)


@dataclasses.dataclass(frozen=True)
class InterpretedCost:
    """Seconds one backend adds to an interpreted check, its two calls and its comparison
    with the reference: once, per element of kv, per program of its grid, and per program
    and element of kv."""

    once: float
    per_element: float
    per_program: float
    per_program_element: float


# Triton's interpreter runs each program of the grid in Python; Pallas's interpret mode
# loops over the grid in XLA, each step touching the whole arrays, after compiling once.
# The Triton interpreter's cost per program differs severalfold between the CPUs checks
# were timed on (more than the rest of a check does): its figure is the geometric mean of
# theirs.
INTERPRETED_COSTS = {
    "torch": InterpretedCost(once=0.0, per_element=270e-9, per_program=45e-3, per_program_element=0.0),
    "jax": InterpretedCost(once=0.8, per_element=80e-9, per_program=0.0, per_program_element=2e-9),
}


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    n_layers: int = 5
    num_kv_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 128
    rope_style: str = "neox"
    dtype: str = "bfloat16"
    table_dtype: str = "float32"
    tables: int = 1
    k_norm: bool = True
    v_multiplier: bool = False
    grad: bool = False
    total_ctx: int | None = None
    max_position: int = 32768
    seed: int = 0
    backends: tuple[str, ...] | None = None
    lowering: str | None = None  # the jax backend's Pallas lowering; None: its default

    @property
    def config(self) -> FusedKVConfig:
        return FusedKVConfig(self.num_kv_heads, self.head_dim, self.rotary_dim, self.rope_style)

    @property
    def backend_names(self) -> tuple[str, ...]:
        return self.backends or BACKENDS

    def tokens(self) -> int:
        """``total_ctx``, or its default: 4096 tokens with a GPU, 16 in CPU interpret mode (64
        with the jax kernel on Mosaic GPU)."""
        if self.total_ctx is not None:
            return self.total_ctx
        if gpu_framework() is not None:
            return DEFAULT_TOKENS_GPU
        return DEFAULT_TOKENS_CPU_MOSAIC if self.lowering == "mosaic_gpu" else DEFAULT_TOKENS_CPU

    def kv_elements(self) -> int:
        return self.tokens() * self.n_layers * 2 * self.num_kv_heads * self.head_dim

    def host_bytes(self) -> tuple[int, int]:
        """About the most host memory the check holds at once, for kv and what is made from
        it, and for the cos/sin table (see the constants above)."""
        per_element = HOST_BYTES_PER_KV_ELEMENT + (HOST_BYTES_PER_KV_ELEMENT_GRADIENTS if self.grad else 0)
        return per_element * self.kv_elements(), HOST_BYTES_PER_TABLE_ELEMENT * self.table_elements()

    def table_elements(self) -> int:
        return self.tables * self.max_position * self.rotary_dim

    def interpreted_programs(self, backend: str) -> int:
        """The programs of one interpreted call of ``backend``, from its own tile rule."""
        tokens, heads = self.tokens(), self.num_kv_heads
        if backend == "torch":
            from fusedkv_torch.kernel import default_tile

            block_tokens, block_heads, _ = default_tile(tokens, heads, self.head_dim, interpret=True)
        else:
            from fusedkv_jax.kernel import default_tile

            block_tokens, block_heads, _ = default_tile(
                tokens, self.n_layers, heads, self.head_dim, rotary_dim=self.rotary_dim,
                rope_style=self.rope_style, interpret=True)
        return -(-tokens // block_tokens) * self.n_layers * -(-heads // block_heads)

    def interpreted_seconds(self) -> float:
        """About how long the check takes in interpret mode (no GPU), startup aside: a
        function of every size and of the installed backends it runs (see the constants
        above); with ``grad`` more than twice that: a backward pass runs the forward again,
        and each of its interpreted programs does more than a forward one."""
        names = [name for name in self.backend_names if backend_installed(name)]
        elements = self.kv_elements()
        seconds = (INTERPRETED_SECONDS_PER_KV_ELEMENT * elements
                   + INTERPRETED_SECONDS_PER_PAIR_ELEMENT * elements * math.comb(len(names), 2)
                   + INTERPRETED_SECONDS_PER_TABLE_ELEMENT * self.table_elements())
        for name in names:
            try:
                programs = self.interpreted_programs(name)
            except ImportError:  # its row will say why it did not run
                continue
            cost = INTERPRETED_COSTS[name]
            seconds += (cost.once + cost.per_element * elements
                        + programs * (cost.per_program + cost.per_program_element * elements))
        return 2.6 * seconds if self.grad else seconds


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a backend against the reference, or two backends.

    A backend is called twice on the same inputs: ``first_call_seconds`` includes
    compiling (or, interpreted, the interpreter's own start-up), ``second_call_seconds``
    is the steady cost. The reference has one call, counted as its first.
    """

    subject: str
    device: str
    against: str
    k_max_ulps: float | None
    v_mismatches: int | None
    ok: bool | None
    first_call_seconds: float | None
    second_call_seconds: float | None
    detail: str


# Fixed widths, so that a row can be printed the moment it is known; a longer cell (a long
# GPU name) pushes the rest of its own line only.
_COLUMNS = (("backend", 9), ("device", 22), ("against", 9), ("K max ulp", 9), ("V", 9),
            ("result", 6), ("first call (compiles)", 21), ("second call", 11))


def _line(cells) -> str:
    return "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _COLUMNS)).rstrip()


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"


def title(options: CheckOptions, total_ctx: int) -> str:
    o = options
    dtype = "" if o.table_dtype == "float32" else f"{o.table_dtype} "
    if o.tables > 1:
        table = f", {o.tables} {dtype}cos/sin tables (layer l: table l % {o.tables})"
    else:
        table = f", {dtype}cos/sin table" if dtype else ""
    variants = table + ("" if o.k_norm else ", no K-norm") + (", v_multiplier" if o.v_multiplier else "")
    lowering = "" if o.lowering is None else f", jax on {o.lowering}"
    return (f"fusedkv check: {o.n_layers} layers, {o.num_kv_heads} KV heads, head_dim "
            f"{o.head_dim}, rotary_dim {o.rotary_dim} ({o.rope_style}), {o.dtype}{variants}, "
            f"{total_ctx} tokens, seed {o.seed}{lowering}")


def header() -> str:
    return _line([name for name, _ in _COLUMNS])


def row_lines(row: Row | GradientRow) -> list[str]:
    """The row as printed: its table line, then what went wrong, if anything did."""
    if isinstance(row, GradientRow):
        return _gradient_line(row)
    result = {True: "PASS", False: "FAIL", None: "-" if row.subject == "reference" else "skipped"}
    lines = [_line((
        row.subject,
        row.device,
        row.against,
        "-" if row.k_max_ulps is None else f"{row.k_max_ulps:.2f}",
        "-" if row.v_mismatches is None else
        ("bit-exact" if row.v_mismatches == 0 else f"{row.v_mismatches} differ"),
        result[row.ok],
        _duration(row.first_call_seconds),
        _duration(row.second_call_seconds),
    ))]
    if row.detail:
        lines.append(f"  {row.subject}{'' if row.against == '-' else ' vs ' + row.against}: {row.detail}")
    return lines


@dataclasses.dataclass(frozen=True)
class GradientRow:
    """One line of the gradients' table (``--grad``): a backend's gradients against the
    reference backward's, or two backends'; ``detail`` says what differs."""

    subject: str
    device: str
    against: str
    gradients: tuple[str, ...]
    ok: bool | None
    detail: str


_GRADIENT_COLUMNS = (("backend", 9), ("device", 22), ("against", 9), ("gradients", 46), ("result", 6))


def gradient_header() -> str:
    return "  ".join(name.ljust(width) for name, width in _GRADIENT_COLUMNS).rstrip()


def _gradient_line(row: GradientRow) -> list[str]:
    result = {True: "PASS", False: "FAIL", None: "-" if row.subject == "reference" else "skipped"}
    cells = (row.subject, row.device, row.against, ", ".join(row.gradients), result[row.ok])
    lines = ["  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _GRADIENT_COLUMNS)).rstrip()]
    if row.detail:
        lines.append(f"  {row.subject}{'' if row.against == '-' else ' vs ' + row.against}: {row.detail}")
    return lines


def verdict(ok: bool) -> str:
    return "ALL PASS" if ok else "DISAGREEMENT FOUND"


@dataclasses.dataclass(frozen=True)
class CheckReport:
    options: CheckOptions
    total_ctx: int
    rows: tuple[Row, ...]
    gradient_rows: tuple[GradientRow, ...] = ()

    @property
    def ok(self) -> bool:
        return all(row.ok is not False for row in (*self.rows, *self.gradient_rows))

    def as_dict(self) -> dict:
        """The report as ``--json`` prints it: the options under the names of the flags
        that set them (``tokens`` and ``backends`` as they ran), then the rows."""
        o = self.options
        return {
            "options": {"layers": o.n_layers, "heads": o.num_kv_heads, "head_dim": o.head_dim,
                        "rotary_dim": o.rotary_dim, "rope_style": o.rope_style, "dtype": o.dtype,
                        "table_dtype": o.table_dtype, "tables": o.tables, "no_k_norm": not o.k_norm,
                        "v_multiplier": o.v_multiplier, "grad": o.grad, "tokens": self.total_ctx,
                        "max_position": o.max_position, "seed": o.seed,
                        "backends": list(o.backend_names), "lowering": o.lowering},
            "ok": self.ok,
            "rows": [dataclasses.asdict(row) for row in self.rows],
            "gradient_rows": [dataclasses.asdict(row) for row in self.gradient_rows],
        }

    def table(self) -> str:
        lines = [title(self.options, self.total_ctx), header()]
        lines += [line for row in self.rows for line in row_lines(row)]
        if self.gradient_rows:
            lines.append(gradient_header())
            lines += [line for row in self.gradient_rows for line in row_lines(row)]
        lines.append(verdict(self.ok))
        return "\n".join(lines)


def _compare_row(subject, device, against, k, v, k_expected, v_expected, seconds=(None, None),
                 tolerance=None, v_exact=True):
    """``v_exact`` False: V is held to the tolerance table, as K is, not bit for bit."""
    k_result = compare(k, k_expected, name=f"{subject} k", tolerance=tolerance)
    v_count, v_first = bit_mismatches(v, v_expected)
    v_result = None if v_exact else compare(v, v_expected, name=f"{subject} v", tolerance=tolerance)
    notes = [] if k_result.ok else [k_result.report()]
    if v_result is not None and not v_result.ok:
        notes.append(v_result.report())
    elif v_result is not None and v_count:
        notes.append(f"{subject} v: {v_count} elements within the tolerance table, not bit for bit: "
                     "Triton's interpreter rounds fp32 to bf16 by truncation")
    elif v_count:
        notes.append(f"{subject} v: {v_count} elements differ bitwise, first at {v_first}")
    v_ok = v_count == 0 if v_result is None else v_result.ok
    return Row(subject, device, against, k_result.max_ulps, v_count,
               k_result.ok and v_ok, *seconds, "; ".join(notes))


def _v_exact(options: CheckOptions, name: str) -> bool:
    """Whether backend ``name``'s V must match bit for bit: not a V scaled by v_multiplier to
    bf16 in Triton's interpreter, which rounds by truncation (README, the CPU section)."""
    return not (options.v_multiplier and options.dtype == "bfloat16" and name == "torch"
                and triton_interpreted())


def check_arrays(options: CheckOptions, total_ctx: int) -> tuple:
    """The host arrays of the check's call: the op's five (``k_norm_weight`` and ``eps``
    None without a K-norm), then ``v_multiplier`` and ``layer_rope_table`` (None unless
    their options ask for them)."""
    o = options
    inputs = random_inputs(o.config, n_layers=o.n_layers, total_ctx=total_ctx, dtype=o.dtype,
                           max_position=o.max_position, table_dtype=o.table_dtype, seed=o.seed)
    kv, k_norm_weight, eps, table, positions = inputs.arrays()
    if not o.k_norm:
        k_norm_weight = eps = None
    layer_rope_table = None
    if o.tables > 1:
        table = np.stack([rope_cos_sin_cache(o.max_position, o.rotary_dim, ROPE_BASE * (t + 1))
                          for t in range(o.tables)]).astype(table.dtype)
        layer_rope_table = (np.arange(o.n_layers) % o.tables).astype(np.int32)
    v_multiplier = None
    if o.v_multiplier:
        # A generator of its own, so that the other inputs are those of the same seed without it.
        rng = np.random.default_rng((o.seed, 1))
        v_multiplier = rng.uniform(*V_MULTIPLIER_RANGE, size=o.n_layers).astype(np.float32)
    return kv, k_norm_weight, eps, table, positions, v_multiplier, layer_rope_table


def check_cotangents(options: CheckOptions, total_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """``--grad``'s cotangents of K and V: standard normal, of ``kv``'s dtype and the outputs' shape."""
    # A generator of its own, so that the inputs are those of the same seed without --grad.
    rng = np.random.default_rng((options.seed, 2))
    shape = options.config.output_shape(options.n_layers, total_ctx)
    return tuple(rng.standard_normal(shape).astype(numpy_dtype(options.dtype)) for _ in range(2))


def _gradient_compare(subject, device, against, got: dict, expected: dict, dtype: str) -> GradientRow:
    """``got`` against ``expected``, gradient by gradient: a gradient one of them lacks differs too."""
    notes = [f"{against} has no {name}" for name in got if name not in expected]
    for name, want in expected.items():
        if name not in got:
            notes.append(f"no {name}")
        elif mismatch := gradient_mismatch(got[name], np.asarray(want, np.float64), dtype, name=f"{subject} {name}"):
            notes.append(mismatch)
    return GradientRow(subject, device, against, tuple(dict.fromkeys([*expected, *got])), not notes,
                       "; ".join(notes))


def _gradient_rows(options: CheckOptions, arrays: tuple, placed: tuple, runners: dict, emit) -> None:
    """``--grad``: the reference backward, each backend's gradients against it, then every pair."""
    config, total_ctx = options.config, options.tokens()
    cotangents = check_cotangents(options, total_ctx)
    reference = fused_kv_norm_rope_backward_reference(
        *arrays[:5], *cotangents, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, v_multiplier=arrays[5],
        layer_rope_table=arrays[6])
    expected = {name: grad for name, grad in zip(GRADIENT_NAMES, reference) if grad is not None}
    emit(GradientRow("reference", "CPU (NumPy)", "-", tuple(expected), None, ""))
    placed_cotangents = place_inputs(cotangents)
    runs = []
    for name, runner in runners.items():
        try:
            run = runner(name, placed, placed_cotangents, config)
        except BackendUnavailable as reason:
            emit(GradientRow(name, "-", "-", (), None, str(reason)))
            continue
        runs.append(run)
        emit(_gradient_compare(run.name, run.device, "reference", run.grads, expected, options.dtype))
    for first, second in itertools.combinations(runs, 2):
        emit(_gradient_compare(first.name, first.device, second.name, first.grads, second.grads, options.dtype))


def _lowered(runner, name: str, options: CheckOptions):
    """``runner`` for backend ``name``, the jax one on ``options.lowering`` where given."""
    if name == "jax" and options.lowering is not None:
        return functools.partial(runner, lowering=options.lowering)
    return runner


def run_check(options: CheckOptions, runners=None, on_row: Callable[[Row], None] | None = None,
              gradient_runners=None) -> CheckReport:
    """Run the reference and the chosen backends on one set of inputs and compare them all.

    Rows come in this order: the reference, each backend against the reference, then
    every pair of backends that ran. ``on_row`` is called with each row as soon as it
    is known (the command line prints it then). ``runners`` maps backend names to
    callables ``(name, placed_inputs, config) -> BackendRun`` (default:
    :func:`interop.command.backends.run_backend`); tests pass a corrupted one to see the check fail.
    With ``options.grad``, the gradients' rows follow, in the same order, from ``gradient_runners``
    (``(name, placed_inputs, placed_cotangents, config) -> GradientRun``, default
    :func:`interop.command.backends.run_backend_gradients`).
    """
    runners = runners or {name: _lowered(run_backend, name, options) for name in options.backend_names}
    gradient_runners = gradient_runners or {name: _lowered(run_backend_gradients, name, options)
                                            for name in options.backend_names}
    rows, gradient_rows = [], []

    def emit(row: Row | GradientRow) -> None:
        (gradient_rows if isinstance(row, GradientRow) else rows).append(row)
        if on_row is not None:
            on_row(row)

    total_ctx = options.tokens()
    config = options.config
    arrays = check_arrays(options, total_ctx)
    start = time.perf_counter()
    k_ref, v_ref = fused_kv_norm_rope_reference(
        *arrays[:5], num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style, v_multiplier=arrays[5],
        layer_rope_table=arrays[6])
    emit(Row("reference", "CPU (NumPy)", "-", None, None, None, time.perf_counter() - start, None, ""))
    placed = place_inputs(arrays)
    runs = []
    for name, runner in runners.items():
        try:
            run = runner(name, placed, config)
        except BackendUnavailable as reason:
            emit(Row(name, "-", "-", None, None, None, None, None, str(reason)))
            continue
        runs.append(run)
        emit(_compare_row(run.name, run.device, "reference", run.k, run.v, k_ref, v_ref,
                          (run.first_call_seconds, run.second_call_seconds),
                          v_exact=_v_exact(options, run.name)))
    for first, second in itertools.combinations(runs, 2):
        emit(_compare_row(first.name, first.device, second.name, first.k, first.v, second.k, second.v,
                          v_exact=_v_exact(options, first.name) and _v_exact(options, second.name)))
    if options.grad:
        _gradient_rows(options, arrays, placed, gradient_runners, emit)
    return CheckReport(options, total_ctx, tuple(rows), tuple(gradient_rows))
