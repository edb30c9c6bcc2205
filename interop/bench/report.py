"""What a run found: one :class:`Measurement` per row, the derived columns, the tables (terminal
and markdown), CSV and JSON.

Derived columns (:func:`annotate`), each taken within one shape, dtype and token count:

* GB/s: the bytes the row's work cannot avoid (``2 * kv.nbytes`` for the op) over its
  median time; device rows of the op, its copies and floors only (a host row's time is
  not the device's, and a materializer's GEMM is compute-bound: it has no bandwidth to
  compare);
* of copy: that bandwidth over the copy row of the same framework (the same bytes
  copied, measured the same way);
* of ceiling: that bandwidth over the device's copy ceiling (:class:`Ceiling`: the
  highest of a large copy measured once in the run and every copy and floor row, named,
  so that no one copy size's artefact sets it);
* speed-up: the fastest baseline's time over the row's, for rows that compute the op,
  against baselines timed by the same clock (device rows against device baselines,
  host rows against the baselines' eager calls);
* x its GEMM: a materializer's time over its GEMM row's, the same GEMM call alone;
* over launch: a host row's time less that of Triton's own launch of the compiled kernel
  (the ``triton-launch`` row).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from typing import Callable

from interop.bench.shapes import GRID

LAUNCH_FLOOR = "triton-launch"
CEILING_KINDS = ("copy", "floor")
BANDWIDTH_KINDS = ("kernel", "backward", "baseline", "copy", "floor", "sweep", "options")


def on_gemm(kind: str, does_op: bool) -> bool:
    """Whether a row is read against a GEMM rather than a copy, with no bandwidth: the
    materializers' rows, and the options rows of FP8 weights (which do more than the op)."""
    return kind == "materializer" or (kind == "options" and not does_op)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One implementation at one shape, dtype and token count; ``seconds`` is None when it
    failed its check (``check`` says why) or raised (``error``). ``gemm``: the row its time
    is compared with (materializers); ``rounds``: each round's seconds, ``seconds`` their
    median, where rows were timed in alternated rounds; ``wall_seconds``: the host time the
    run spent on the row, its inputs' upload aside (check, compiles and timing: where a
    run's time goes)."""

    shape: str
    dtype: str
    implementation: str
    framework: str
    kind: str
    clock: str
    tokens: int
    seconds: float | None
    bytes_moved: int
    method: str = "-"
    input_sets: int = 0
    check: str = "-"
    error: str = ""
    baseline: bool = False
    does_op: bool = True
    gemm: str = ""
    rounds: tuple = ()
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and not self.check.startswith("FAIL")

    @property
    def gbps(self) -> float | None:
        """Achieved GB/s, for rows whose bandwidth means something (module docstring)."""
        timed = (self.seconds and self.clock == "device" and self.bytes_moved and self.kind in BANDWIDTH_KINDS
                 and not on_gemm(self.kind, self.does_op))
        return self.bytes_moved / self.seconds / 1e9 if timed else None


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """The device's copy ceiling: GB/s, and where it was measured."""

    gbps: float
    source: str

    def describe(self) -> str:
        return f"{self.gbps:.0f} GB/s, {self.source}"


def device_ceiling(measurements: list[Measurement], copy_gbps: float | None = None,
                   copy_source: str = "") -> Ceiling | None:
    """The highest of ``copy_gbps`` (a large copy measured once, ``copy_source`` saying how)
    and every copy and floor row of the run; None where there is none."""
    candidates = [] if copy_gbps is None else [Ceiling(copy_gbps, copy_source)]
    candidates += [Ceiling(m.gbps, f"{m.implementation} at {m.tokens} tokens ({m.shape}, {m.dtype})")
                   for m in measurements if m.kind in CEILING_KINDS and m.gbps]
    return max(candidates, key=lambda ceiling: ceiling.gbps, default=None)


@dataclasses.dataclass(frozen=True)
class Annotated:
    measurement: Measurement
    gbps: float | None = None
    of_copy: float | None = None
    of_ceiling: float | None = None
    speedup: float | None = None
    over_gemm: float | None = None
    over_launch: float | None = None

    def record(self) -> dict:
        """The flat dictionary written to CSV and JSON (times in microseconds)."""
        record = dataclasses.asdict(self.measurement)
        seconds, rounds = record.pop("seconds"), record.pop("rounds")
        return dict(record, us=None if seconds is None else seconds * 1e6, gbps=self.gbps, of_copy=self.of_copy,
                    of_ceiling=self.of_ceiling, speedup=self.speedup, x_gemm=self.over_gemm,
                    over_launch_us=None if self.over_launch is None else self.over_launch * 1e6,
                    us_rounds=[value * 1e6 for value in rounds])


def _key(m: Measurement) -> tuple:
    return (m.shape, m.dtype, m.tokens)


def annotate(measurements: list[Measurement], ceiling: Ceiling | None = None) -> list[Annotated]:
    """Each measurement with its derived columns (module docstring)."""
    copies = {(*_key(m), m.framework): m.gbps for m in measurements if m.kind == "copy" and m.gbps}
    seconds = {(*_key(m), m.implementation): m.seconds for m in measurements if m.seconds}
    best_baseline: dict = {}
    for m in measurements:
        if m.baseline and m.seconds:
            key = (*_key(m), m.clock)
            best_baseline[key] = min(best_baseline.get(key, m.seconds), m.seconds)
    rows = []
    for m in measurements:
        rate, copy_rate = m.gbps, copies.get((*_key(m), m.framework))
        best = best_baseline.get((*_key(m), m.clock))
        gemm = seconds.get((*_key(m), m.gemm)) if m.gemm and m.clock == "device" else None
        launch = seconds.get((*_key(m), LAUNCH_FLOOR)) if m.clock == "host" and m.implementation != LAUNCH_FLOOR \
            else None
        rows.append(Annotated(
            m, rate, rate / copy_rate if rate and copy_rate else None,
            rate / ceiling.gbps if rate and ceiling else None,
            best / m.seconds if best and m.seconds and m.does_op else None,
            m.seconds / gemm if gemm and m.seconds else None,
            m.seconds - launch if launch and m.seconds else None))
    return rows


@dataclasses.dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[Annotated], str]
    measured: bool = True  # "-" where the row has no time


def _value(get, form: str) -> Callable[[Annotated], str]:
    def cell(row: Annotated) -> str:
        value = get(row)
        return "-" if value is None else form.format(value)
    return cell


def _check_cell(row: Annotated) -> str:
    m = row.measurement
    if m.seconds is None:
        return ("ERROR: " if m.error else "") + (m.error or m.check)[:120]
    return m.check


NAME = Column("implementation", lambda row: row.measurement.implementation, measured=False)
KIND = Column("kind", lambda row: row.measurement.kind, measured=False)
TOKENS = Column("tokens", lambda row: str(row.measurement.tokens), measured=False)
MICROSECONDS = Column("us", _value(lambda row: row.measurement.seconds and row.measurement.seconds * 1e6, "{:.2f}"))
SPEEDUP = Column("speed-up", _value(lambda row: row.speedup, "{:.2f}x"))
METHOD = Column("method", lambda row: row.measurement.method, measured=False)
CHECK = Column("check", _check_cell, measured=False)
DEVICE_COLUMNS = (NAME, KIND, TOKENS, MICROSECONDS, Column("GB/s", _value(lambda row: row.gbps, "{:.0f}")),
                  Column("of copy", _value(lambda row: row.of_copy, "{:.0%}")),
                  Column("of ceiling", _value(lambda row: row.of_ceiling, "{:.0%}")), SPEEDUP, METHOD, CHECK)
MATERIALIZER_COLUMNS = (NAME, TOKENS, MICROSECONDS, Column("x its GEMM", _value(lambda row: row.over_gemm, "{:.3f}x")),
                        METHOD, CHECK)
HOST_COLUMNS = (NAME, KIND, TOKENS, MICROSECONDS, SPEEDUP,
                Column("over launch", _value(lambda row: row.over_launch and row.over_launch * 1e6, "{:+.2f}")),
                METHOD, CHECK)


@dataclasses.dataclass(frozen=True)
class Section:
    """One table of a shape and dtype: its title, which rows, which columns."""

    title: str
    takes: Callable[[Measurement], bool]
    columns: tuple[Column, ...]
    fastest_first: bool = False


OP_SECTION = Section("Kernels, floors, copies and baselines: device time per call",
                     lambda m: m.clock == "device" and m.kind in ("kernel", "backward", "floor", "copy", "baseline",
                                                                  "options") and not on_gemm(m.kind, m.does_op),
                     DEVICE_COLUMNS)
SECTIONS = (
    OP_SECTION,
    Section("Tiles and forms: device time per call, fastest first", lambda m: m.kind == "sweep", DEVICE_COLUMNS,
            fastest_first=True),
    Section("Materializers: device time per call against the same GEMM call alone",
            lambda m: m.clock == "device" and on_gemm(m.kind, m.does_op), MATERIALIZER_COLUMNS),
    Section("Host wall time per eager call, against Triton's own launch of the compiled kernel",
            lambda m: m.clock == "host", HOST_COLUMNS),
)


def _cells(row: Annotated, columns) -> tuple[str, ...]:
    timed = row.measurement.seconds is not None
    return tuple(column.cell(row) if timed or not column.measured else "-" for column in columns)


def _by_tokens(rows: list[Annotated], fastest_first: bool) -> list[list[Annotated]]:
    """The rows in runs of one token count, in order (``fastest_first``: sorted within each)."""
    runs: list[list[Annotated]] = []
    for row in rows:
        if not runs or runs[-1][0].measurement.tokens != row.measurement.tokens:
            runs.append([])
        runs[-1].append(row)
    if fastest_first:
        runs = [sorted(run, key=lambda row: (row.measurement.seconds is None, row.measurement.seconds or 0.0))
                for run in runs]
    return runs


def aligned(lines: list[tuple[str, ...]]) -> str:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)


def format_table(rows: list[Annotated], columns=DEVICE_COLUMNS, *, fastest_first: bool = False) -> str:
    """One terminal table, a blank line between token counts."""
    lines, blank = [tuple(column.header for column in columns)], ("",) * len(columns)
    for index, run in enumerate(_by_tokens(rows, fastest_first)):
        lines += ([blank] if index else []) + [_cells(row, columns) for row in run]
    return aligned(lines)


def markdown_table(rows: list[Annotated], columns=DEVICE_COLUMNS, *, fastest_first: bool = False) -> str:
    """One markdown table, rows in token order."""
    headers = ["µs" if column.header == "us" else column.header for column in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(columns)]
    for run in _by_tokens(rows, fastest_first):
        lines += ["| " + " | ".join(cell.replace("|", "/") for cell in _cells(row, columns)) + " |" for row in run]
    return "\n".join(lines)


def groups(rows: list[Annotated]) -> dict[tuple[str, str], list[Annotated]]:
    """The rows of each (shape, dtype), in order of first appearance."""
    grouped: dict[tuple[str, str], list[Annotated]] = {}
    for row in rows:
        grouped.setdefault((row.measurement.shape, row.measurement.dtype), []).append(row)
    return grouped


def sections(rows: list[Annotated], *, in_grid: bool = False) -> list[tuple[Section, list[Annotated]]]:
    """Each :data:`SECTIONS` table of one shape and dtype that has rows, with its rows;
    ``in_grid``: a grid configuration's, whose :data:`OP_SECTION` the grid's tables replace."""
    found = [(section, [row for row in rows if section.takes(row.measurement)]) for section in SECTIONS
             if not (in_grid and section is OP_SECTION)]
    return [(section, taken) for section, taken in found if taken]


CSV_NAME = "bench.csv"
JSON_NAME = "bench.json"


def write_data(rows: list[Annotated], out_dir: pathlib.Path, meta: dict) -> list[pathlib.Path]:
    """``bench.csv`` (one line per row) and ``bench.json`` (``meta`` and the rows) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [row.record() for row in rows]
    csv_path, json_path = out_dir / CSV_NAME, out_dir / JSON_NAME
    fields = list((records or [Annotated(Measurement("", "", "", "", "", "", 0, None, 0)).record()])[0])
    with open(csv_path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: "" if v is None else " ".join(f"{x:.3f}" for x in v) if isinstance(v, list) else v
                          for k, v in record.items()} for record in records)
    with open(json_path, "w") as file:
        json.dump(dict(meta=meta, rows=records), file, indent=1)
    return [csv_path, json_path]


def read_data(path: pathlib.Path) -> tuple[dict, list[Measurement]]:
    """The ``meta`` and the measurements of a ``bench.json`` that :func:`write_data` wrote."""
    document = json.loads(pathlib.Path(path).read_text())
    fields = [field for field in dataclasses.fields(Measurement) if field.name not in ("seconds", "rounds")]
    # A field added since a file was written takes its default.
    measurements = [Measurement(**{field.name: record[field.name] for field in fields
                                   if field.name in record or field.default is dataclasses.MISSING},
                                seconds=None if record["us"] is None else record["us"] * 1e-6,
                                rounds=tuple(value * 1e-6 for value in record["us_rounds"]))
                    for record in document["rows"]]
    return document["meta"], measurements


METHOD = (
    "Every implementation is checked against the interop reference (K within the tolerance table, V bit "
    "for bit) on random inputs before it is timed. Device time per call, median: torch by CUDA-graph replay, "
    "JAX as a `jax.jit` user runs it, many calls inside one jit; input sets rotated past the L2 where one set "
    "fits in it. GB/s counts the bytes a row's work cannot avoid (`2 * kv.nbytes` for the op); *of copy* is "
    "against a copy of the same bytes in the same framework, timed the same way; *of ceiling* against the "
    "device copy ceiling above; *speed-up* is the fastest baseline's time over the row's; *x its GEMM* a "
    "materializer's time over the same GEMM call alone. Host rows: host wall time per eager call, *over "
    "launch* their time above Triton's own launch of the compiled kernel.")


def markdown_report(rows: list[Annotated], meta: dict, descriptions: dict[str, str], grid: str = "") -> str:
    """The run's tables as markdown: the command that made them (and, for ``--from-json``, the
    commands that measured the rows), the devices and packages, the ceiling and the method,
    then ``grid`` (the grid's tables, where the run has them) and every table of each shape
    and dtype (``descriptions``: a line per shape name)."""
    devices = "; ".join(f"{framework}: {device}" for framework, device in meta["devices"].items())
    packages = ", ".join(f"{name} {version}" for name, version in meta["versions"].items())
    ceiling = meta.get("ceiling") or "none measured"
    parts = ["# fusedkv bench", "", "```sh", meta["command"], "```", ""]
    if meta.get("parts"):  # a report of earlier runs' rows: the commands that measured them
        parts += ["Rows of:", "", "```sh", *meta["parts"], "```", ""]
    parts += [f"- Devices: {devices}", f"- Packages: {packages}"]
    if meta.get("xla_flags"):  # they change how XLA compiles every JAX row
        parts.append(f"- XLA_FLAGS: `{meta['xla_flags']}`")
    parts += [f"- Device copy ceiling: {ceiling}", "", METHOD]
    if grid:
        parts.append(grid)
    for (shape, dtype), group in groups(rows).items():
        shown = sections(group, in_grid=shape in GRID)
        if shown:
            parts += ["", f"## {shape}: {descriptions.get(shape, shape)}, {dtype}"]
        for section, taken in shown:
            parts += ["", f"### {section.title}", "",
                      markdown_table(taken, section.columns, fastest_first=section.fastest_first)]
    return "\n".join(parts) + "\n"
