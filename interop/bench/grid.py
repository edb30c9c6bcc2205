"""The shape grid's report: each configuration's kernels against copy, the worst and median per
token bucket, and the issue's bars, computed from the measured rows.

*Of copy* here is a row's GB/s over the fastest copy row of the run (``torch-copy``,
``xla-copy``, a floor) that moved no more bytes than the row: its own size's copy, or a
faster one of fewer bytes, because a graph-replayed copy of more than about 600 MB reads
slower than smaller ones and a kernel must not pass a bar on that dip. The bars:

* large contexts (4096 tokens or more): Triton and Pallas at 90% of copy or more;
* decode sizes (1 to 1024 tokens): Triton at most 1.15x the same-bytes ``torch-copy``
  (both under graph replay), and Pallas's per-call time in a jit at most 1.25x Triton's.
* every size: the Pallas kernel on Mosaic GPU at most 1.05x its time on the Triton
  lowering, both in jit, where Mosaic GPU serves the configuration (its ``n/a`` rows,
  like every row not applicable, are left out of the grid's cells).

Each bar is judged over every configuration and token count of its bucket, per half of
the grid (``fit``, ``held-out``) and over both: ``held``, ``missed by`` how much at the
worst size, or not shown where a size of it was not measured.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Callable

from interop.bench.report import BANDWIDTH_KINDS, CEILING_KINDS, Measurement, aligned
from interop.bench.shapes import DECODE_TOKENS, GRID, GRID_HALVES

LARGE_TOKENS = 4096
DECODE = "decode (1-1024 tokens)"
LARGE = "large (4096 tokens and more)"
BUCKETS: dict[str, Callable[[int], bool]] = {DECODE: lambda tokens: tokens <= DECODE_TOKENS,
                                             LARGE: lambda tokens: tokens >= LARGE_TOKENS}
EVERY = "every size"
# What a bar takes: a bucket, or every size.
BAR_SIZES: dict[str, Callable[[int], bool]] = {**BUCKETS, EVERY: lambda tokens: True}
# The rows judged against copy: the kernels and the sweep's tiles of them.
FRACTION_KINDS = ("kernel", "sweep")
BOTH_HALVES = "both"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid configuration at one token count: its device rows by implementation, and the
    copy it is read against, ``(GB/s, whether it is this size's own copy)``."""

    shape: str
    half: str
    tokens: int
    rows: dict[str, Measurement]
    copy: tuple[float, bool] | None

    def fraction(self, name: str) -> float | None:
        row = self.rows.get(name)
        return row.gbps / self.copy[0] if row is not None and row.gbps and self.copy else None

    def ratio(self, name: str, over: str) -> float | None:
        row, base = self.rows.get(name), self.rows.get(over)
        return row.seconds / base.seconds if row and base and row.seconds and base.seconds else None


def copy_levels(measurements: list[Measurement]) -> Callable[[Measurement], tuple[float, bool] | None]:
    """For a row, the fastest copy or floor row moving no more bytes (module docstring), and
    whether that copy is of the row's own configuration and token count."""
    copies = sorted((m.bytes_moved, m.gbps, (m.shape, m.tokens)) for m in measurements
                    if m.kind in CEILING_KINDS and m.gbps)

    def level(row: Measurement) -> tuple[float, bool] | None:
        best = None
        for nbytes, gbps, where in copies:
            if nbytes > row.bytes_moved:
                break
            own = where == (row.shape, row.tokens)
            if best is None or gbps > best[0] or (gbps == best[0] and own):
                best = (gbps, own)
        return best
    return level


def cells(measurements: list[Measurement]) -> list[Cell]:
    """Every grid configuration and token count of the run, in order of first appearance."""
    level = copy_levels(measurements)
    found: dict[tuple[str, int], dict[str, Measurement]] = {}
    for m in measurements:
        if m.shape in GRID and m.clock == "device" and not m.check.startswith("n/a"):
            found.setdefault((m.shape, m.tokens), {})[m.implementation] = m
    result = []
    for (shape, tokens), rows in found.items():
        sized = next((m for m in rows.values() if m.bytes_moved), None)
        result.append(Cell(shape, GRID[shape].half, tokens, rows, None if sized is None else level(sized)))
    return result


@dataclasses.dataclass(frozen=True)
class Bar:
    """One of the issue's bars: ``implementation``'s fraction of copy at least ``limit``, or,
    with ``over``, its time over ``over``'s at most ``limit``, at every size of ``bucket``
    (a key of :data:`BAR_SIZES`)."""

    number: int
    text: str
    implementation: str
    bucket: str
    limit: float
    over: str = ""

    def value(self, cell: Cell) -> float | None:
        return cell.ratio(self.implementation, self.over) if self.over else cell.fraction(self.implementation)

    def misses(self, value: float) -> bool:
        return value > self.limit if self.over else value < self.limit

    def shown(self, value: float) -> str:
        return f"{value:.2f}x" if self.over else f"{value:.0%}"

    def gap(self, value: float) -> str:
        return f"{value - self.limit:.2f}x" if self.over else f"{(self.limit - value) * 100:.1f} points"


BARS = (
    Bar(2, "Triton under graph replay at 90% of copy or more", "triton", LARGE, 0.90),
    Bar(2, "Pallas in jit at 90% of copy or more", "pallas", LARGE, 0.90),
    Bar(3, "Triton at most 1.15x the same-bytes copy, both under graph replay", "triton", DECODE, 1.15,
        over="torch-copy"),
    Bar(3, "Pallas's time per call in jit at most 1.25x Triton's under graph replay", "pallas", DECODE, 1.25,
        over="triton"),
    Bar(2, "With XLA's PDL, Pallas in jit at 90% of copy or more", "pallas-pdl", LARGE, 0.90),
    Bar(3, "With XLA's PDL, Pallas's time per call in jit at most 1.25x Triton's under graph replay", "pallas-pdl",
        DECODE, 1.25, over="triton"),
    Bar(5, "Mosaic GPU in jit at most 1.05x the Triton lowering's time in jit, where it serves", "pallas-mosaic",
        EVERY, 1.05, over="pallas"),
)


def _at(cell: Cell) -> str:
    return f"{cell.shape}, {cell.tokens} tokens"


def judge(bar: Bar, taken: list[Cell]) -> tuple[str, str]:
    """``(the worst value and where, the verdict)`` of ``bar`` over the cells ``taken``."""
    judged = [cell for cell in taken if BAR_SIZES[bar.bucket](cell.tokens) and bar.implementation in cell.rows
              and (not bar.over or bar.over in cell.rows)]
    if not judged:
        return "-", "not measured"
    values = [(bar.value(cell), cell) for cell in judged]
    measured = [(value, cell) for value, cell in values if value is not None]
    unmeasured = len(values) - len(measured)
    if not measured:
        return "-", f"not shown: none of {len(values)} sizes measured"
    worst, cell = (max if bar.over else min)(measured, key=lambda pair: pair[0])
    where = f"{bar.shown(worst)} at {_at(cell)}"
    if bar.misses(worst):
        return where, f"missed by {bar.gap(worst)}"
    if unmeasured:
        return where, f"not shown: {unmeasured} of {len(values)} sizes unmeasured"
    return where, "held"


def _halves(found: list[Cell]) -> list[tuple[str, list[Cell]]]:
    """Each half present, then both together."""
    present = [(half, [cell for cell in found if cell.half == half]) for half in GRID_HALVES]
    return [(half, taken) for half, taken in present if taken] + [(BOTH_HALVES, found)]


def bar_lines(found: list[Cell]) -> list[tuple[str, ...]]:
    """The bars' table: bar, what, half, worst, verdict."""
    return [(str(bar.number), bar.text, half, *judge(bar, taken)) for bar in BARS for half, taken in _halves(found)]


def fraction_rows(found: list[Cell]) -> list[str]:
    """The kernel and sweep rows of the grid, in order of first appearance."""
    names: dict[str, None] = {}
    for cell in found:
        names.update((name, None) for name, m in cell.rows.items() if m.kind in FRACTION_KINDS)
    return list(names)


def summary_lines(found: list[Cell]) -> list[tuple[str, ...]]:
    """Per bucket, half and kernel: sizes measured, worst and median of copy, where the worst is."""
    lines = []
    for bucket, takes in BUCKETS.items():
        for half, taken in _halves([cell for cell in found if takes(cell.tokens)]):
            for name in fraction_rows(taken):
                values = [(cell.fraction(name), cell) for cell in taken if name in cell.rows]
                measured = [(value, cell) for value, cell in values if value is not None]
                if not measured:
                    lines.append((bucket, half, name, f"0 of {len(values)}", "-", "-", "-"))
                    continue
                worst, cell = min(measured, key=lambda pair: pair[0])
                median = statistics.median(value for value, _ in measured)
                lines.append((bucket, half, name, f"{len(measured)} of {len(values)}", f"{worst:.0%}",
                              f"{median:.0%}", _at(cell)))
    return lines


def _microseconds(row: Measurement | None) -> str:
    return "-" if row is None or row.seconds is None else f"{row.seconds * 1e6:.2f}"


def _ratio_columns(found: list[Cell]) -> list[tuple[str, str, str]]:
    """The ratio bars' columns, as ``(header, row, over)``, where both rows were run."""
    return [(f"{bar.implementation} x {bar.over}", bar.implementation, bar.over) for bar in BARS
            if bar.over and any(bar.implementation in cell.rows and bar.over in cell.rows for cell in found)]


def _cell_line(cell: Cell, timed: list[str], fractions: list[str], ratios: list[tuple[str, str, str]]) -> tuple:
    sized = next((m for m in cell.rows.values() if m.bytes_moved), None)
    copy = "-" if cell.copy is None else f"{cell.copy[0]:.4g}" + ("" if cell.copy[1] else "*")
    fraction_cells = ("-" if cell.fraction(name) is None else f"{cell.fraction(name):.0%}" for name in fractions)
    ratio_cells = ("-" if cell.ratio(row, over) is None else f"{cell.ratio(row, over):.2f}x" for _, row, over in ratios)
    return (cell.shape, cell.half, str(cell.tokens), "-" if sized is None else f"{sized.bytes_moved / 1e6:.4g}", copy,
            *(_microseconds(cell.rows.get(name)) for name in timed), *fraction_cells, *ratio_cells)


def configuration_lines(found: list[Cell]) -> list[tuple[str, ...]]:
    """The per-configuration table: a line per configuration and token count (header first)."""
    timed: dict[str, None] = {}
    for cell in found:
        timed.update((name, None) for name, m in cell.rows.items() if m.kind in BANDWIDTH_KINDS)
    fractions, ratios = fraction_rows(found), _ratio_columns(found)
    header = ("configuration", "half", "tokens", "MB", "copy GB/s", *(f"{name} us" for name in timed),
              *(f"{name} of copy" for name in fractions), *(header for header, _, _ in ratios))
    return [header, *(_cell_line(cell, list(timed), fractions, ratios) for cell in found)]


COPY_NOTE = ("copy GB/s: the fastest copy of the run that moved no more bytes; * where that is not this size's "
             "own copy (a graph-replayed copy of more than about 600 MB reads slower than smaller ones)")
SUMMARY_HEADER = ("bucket", "half", "implementation", "sizes", "worst of copy", "median of copy", "worst at")
BARS_HEADER = ("bar", "what", "half", "worst", "verdict")


def tables(measurements: list[Measurement], skipped: list[str] = ()) -> list[tuple[str, list[tuple[str, ...]], str]]:
    """The grid's tables as ``(title, lines with the header first, a note under it)``; none
    where the run has no grid rows. ``skipped``: a line per size the run left out."""
    found = cells(measurements)
    if not found:
        return []
    skipped_note = ("Skipped, over the grid's memory limit: " + "; ".join(skipped)) if skipped else ""
    return [("The shape grid: the issue's bars", [BARS_HEADER, *bar_lines(found)], skipped_note),
            ("The shape grid: worst and median of copy per token bucket", [SUMMARY_HEADER, *summary_lines(found)], ""),
            ("The shape grid: each configuration against copy", configuration_lines(found), COPY_NOTE)]


def format_tables(measurements: list[Measurement], skipped: list[str] = ()) -> str:
    """The grid's tables for the terminal."""
    parts = []
    for title, lines, note in tables(measurements, skipped):
        parts += [f"\n== {title} ==", aligned(lines)] + ([note] if note else [])
    return "\n".join(parts)


def markdown_tables(measurements: list[Measurement], skipped: list[str] = ()) -> str:
    """The grid's tables as markdown sections."""
    parts = []
    for title, lines, note in tables(measurements, skipped):
        header = [cell.removesuffix(" us") + " µs" if cell.endswith(" us") else cell for cell in lines[0]]
        rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        rows += ["| " + " | ".join(cell.replace("|", "/") for cell in line) + " |" for line in lines[1:]]
        parts += ["", f"## {title}", "", *rows] + (["", note] if note else [])
    return "\n".join(parts)
