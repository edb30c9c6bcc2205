"""What a run found: one :class:`Measurement` per row, the derived columns, the terminal table, CSV and JSON.

Derived columns (:func:`annotate`), each taken within one shape, dtype and token count:

* GB/s: the bytes the row's work cannot avoid (``2 * kv.nbytes`` for the op) over its
  median time; device rows only (a host row's time is not the device's);
* of copy: that bandwidth over the bandwidth of the copy row of the same framework
  (the same bytes copied, measured the same way);
* speed-up: the fastest baseline's time over the row's, for rows that compute the op,
  against baselines timed by the same clock (device rows against device baselines,
  host rows against the baselines' eager calls).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One implementation at one shape, dtype and token count; ``seconds`` is None when it
    failed its check (``check`` says why) or raised (``error``)."""

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

    @property
    def ok(self) -> bool:
        return not self.error and not self.check.startswith("FAIL")


@dataclasses.dataclass(frozen=True)
class Annotated:
    measurement: Measurement
    gbps: float | None
    of_copy: float | None
    speedup: float | None

    def record(self) -> dict:
        """The flat dictionary written to CSV and JSON (times in microseconds)."""
        m = self.measurement
        record = dataclasses.asdict(m)
        seconds = record.pop("seconds")
        return dict(record, us=None if seconds is None else seconds * 1e6, gbps=self.gbps,
                    of_copy=self.of_copy, speedup=self.speedup)


def annotate(measurements: list[Measurement]) -> list[Annotated]:
    """Each measurement with its GB/s, fraction of copy and speed-up (module docstring)."""
    def group(m: Measurement) -> tuple:
        return (m.shape, m.dtype, m.tokens)

    def gbps(m: Measurement) -> float | None:
        timed = m.seconds and m.clock == "device" and m.bytes_moved
        return m.bytes_moved / m.seconds / 1e9 if timed else None

    copies = {(*group(m), m.framework): gbps(m) for m in measurements if m.kind == "copy" and gbps(m)}
    best_baseline: dict = {}
    for m in measurements:
        if m.baseline and m.seconds:
            key = (*group(m), m.clock)
            best_baseline[key] = min(best_baseline.get(key, m.seconds), m.seconds)
    rows = []
    for m in measurements:
        rate = gbps(m)
        copy_rate = copies.get((*group(m), m.framework))
        best = best_baseline.get((*group(m), m.clock))
        rows.append(Annotated(m, rate, rate / copy_rate if rate and copy_rate else None,
                              best / m.seconds if best and m.seconds and m.does_op else None))
    return rows


def aligned(lines: list[tuple[str, ...]]) -> str:
    """Rows of cells as left-aligned columns, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in lines)


TABLE_HEADER = ("implementation", "kind", "tokens", "us", "GB/s", "of copy", "speed-up", "method", "check")


def _cells(row: Annotated) -> tuple[str, ...]:
    m = row.measurement
    if m.seconds is None:
        problem = m.error or m.check
        return (m.implementation, m.kind, str(m.tokens), "-", "-", "-", "-", m.method,
                ("ERROR: " if m.error else "") + problem[:120])
    return (m.implementation, m.kind, str(m.tokens), f"{m.seconds * 1e6:.2f}",
            "-" if row.gbps is None else f"{row.gbps:.0f}",
            "-" if row.of_copy is None else f"{row.of_copy:.0%}",
            "-" if row.speedup is None else f"{row.speedup:.2f}x", m.method, m.check)


def format_table(rows: list[Annotated]) -> str:
    """One table, rows in the order given, a blank line between token counts."""
    lines, blank = [TABLE_HEADER], ("",) * len(TABLE_HEADER)
    for index, row in enumerate(rows):
        if index and row.measurement.tokens != rows[index - 1].measurement.tokens:
            lines.append(blank)
        lines.append(_cells(row))
    return aligned(lines)


def groups(rows: list[Annotated]) -> dict[tuple[str, str], list[Annotated]]:
    """The rows of each (shape, dtype), in order of first appearance."""
    grouped: dict[tuple[str, str], list[Annotated]] = {}
    for row in rows:
        grouped.setdefault((row.measurement.shape, row.measurement.dtype), []).append(row)
    return grouped


CSV_NAME = "bench.csv"
JSON_NAME = "bench.json"


def write_data(rows: list[Annotated], out_dir: pathlib.Path, meta: dict) -> list[pathlib.Path]:
    """``bench.csv`` (one line per row) and ``bench.json`` (``meta`` and the rows) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [row.record() for row in rows]
    csv_path, json_path = out_dir / CSV_NAME, out_dir / JSON_NAME
    fields = list(records[0]) if records else [f.name for f in dataclasses.fields(Measurement)]
    with open(csv_path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in record.items()} for record in records)
    with open(json_path, "w") as file:
        json.dump(dict(meta=meta, rows=records), file, indent=1)
    return [csv_path, json_path]
