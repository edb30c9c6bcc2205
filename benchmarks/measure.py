"""The benchmark scripts' rows and their table, and the draft shape they measure.

The timers (:mod:`interop.bench.timers`), the check before timing
(:mod:`interop.bench.check`), the L2 rotation (:mod:`interop.bench.workload`) and the
shapes (:mod:`interop.bench.shapes`) are the ones ``fusedkv bench`` uses; these
scripts keep the sections, sweeps and probes the command does not run. Rows and their
table know nothing of torch, so the JAX benchmark prints the same.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from typing import Callable

from interop.bench.report import aligned
from interop.bench.shapes import DRAFT_SHAPE

# The draft every script measures (``interop.bench.shapes.DRAFT_SHAPE``): a 5-layer draft of a
# Qwen3-8B-sized target, bf16.
DRAFT = DRAFT_SHAPE.config
N_LAYERS = DRAFT_SHAPE.n_layers
DRAFT_STATIC = DRAFT_SHAPE.static()


@dataclasses.dataclass(frozen=True)
class Row:
    """One measured configuration; ``error`` set when it failed."""

    name: str
    total_ctx: int
    tile: str
    seconds: float | None
    bytes_moved: int
    method: str
    input_sets: int = 1
    check: str = "-"
    error: str = ""

    def gbps(self) -> float | None:
        return None if not self.seconds else self.bytes_moved / self.seconds / 1e9


def guarded(name: str, total_ctx: int, tile: str, measure: Callable[[], Row]) -> Row:
    """``measure()``, or an error row (traceback on stderr) so one failure does not end the run."""
    try:
        return measure()
    except Exception as error:  # a benchmark reports every failure and goes on
        traceback.print_exc(file=sys.stderr)
        return Row(name, total_ctx, tile, None, 0, "-", error=f"{type(error).__name__}: {error}")


def format_table(rows: list[Row], copy_bytes_per_second: float) -> str:
    lines = [("impl", "tokens", "config", "us", "GB/s", "of copy", "method", "sets", "check")]
    for row in rows:
        if row.error:
            lines.append((row.name, str(row.total_ctx), row.tile, "ERROR", "-", "-", "-", "-",
                          row.error[:100]))
            continue
        gbps = row.gbps()
        bandwidth = (f"{gbps:.0f}", f"{gbps * 1e9 / copy_bytes_per_second:.0%}") if row.bytes_moved else ("-", "-")
        lines.append((row.name, str(row.total_ctx), row.tile, f"{row.seconds * 1e6:.2f}", *bandwidth,
                      row.method, str(row.input_sets), row.check))
    return aligned(lines)
