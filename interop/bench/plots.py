"""PNG plots of a run (matplotlib's Agg renderer, no display needed), about 900 x 500 pixels.

* bandwidth: achieved GB/s against tokens (log scale) for every implementation timed on
  the device, the copy of the same bytes in each framework as a dashed line;
* latency: device time against tokens at the small token counts (decode sizes).

Host rows are left out of both: their time is the host's, not the device's.
"""

from __future__ import annotations

import pathlib

from interop.bench.report import Annotated, groups
from interop.bench.shapes import DECODE_TOKENS, SHAPES

FIGURE_INCHES = (9, 5)
DPI = 100
KIND_STYLES = {
    "kernel": dict(linestyle="-", marker="o", linewidth=2.4),
    "baseline": dict(linestyle="--", marker="s", linewidth=1.4),
    "materializer": dict(linestyle=":", marker="^", linewidth=1.4),
    "interop": dict(linestyle="-.", marker="v", linewidth=1.2),
    "copy": dict(linestyle=(0, (6, 3)), marker="", linewidth=1.6),
}
COPY_COLORS = ("black", "dimgray")


def _token_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _series(rows: list[Annotated], value, max_tokens: int | None = None) -> dict[str, list[tuple[int, float]]]:
    """``implementation -> [(tokens, value)]`` for timed device rows, in order of appearance."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        m = row.measurement
        y = value(row)
        if m.clock != "device" or y is None or (max_tokens is not None and m.tokens > max_tokens):
            continue
        series.setdefault(m.implementation, []).append((m.tokens, y))
    return series


def _draw(rows: list[Annotated], series: dict, path: pathlib.Path, *, title: str, ylabel: str, log_y: bool):
    if not series:
        return
    # A bare Figure renders through Agg without pyplot: no display, no global state.
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullLocator, StrMethodFormatter

    kinds = {row.measurement.implementation: row.measurement.kind for row in rows}
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI)
    axes = figure.add_subplot()
    copies = 0
    for name, points in series.items():
        points = sorted(points)
        style = dict(KIND_STYLES.get(kinds[name], {}))
        if kinds[name] == "copy":
            style["color"] = COPY_COLORS[copies % len(COPY_COLORS)]
            copies += 1
        axes.plot([x for x, _ in points], [y for _, y in points], label=name, markersize=4, **style)
    ticks = sorted({x for points in series.values() for x, _ in points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(ticks, [_token_label(t) for t in ticks])
    axes.xaxis.set_minor_locator(NullLocator())
    if log_y:
        axes.set_yscale("log")
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        axes.yaxis.set_minor_locator(NullLocator())
    else:
        axes.set_ylim(bottom=0)
    axes.set_xlabel("tokens (total_ctx)")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.subplots_adjust(left=0.08, right=0.76, bottom=0.11, top=0.91)
    figure.savefig(path, format="png")


def plot_bandwidth(rows: list[Annotated], path: pathlib.Path, *, title: str) -> dict[str, list[tuple[int, float]]]:
    """Achieved GB/s against tokens; returns the series drawn."""
    series = _series(rows, lambda row: row.gbps)
    _draw(rows, series, path, title=title, ylabel="GB/s (bytes read + written / median time)", log_y=False)
    return series


def plot_latency(rows: list[Annotated], path: pathlib.Path, *, title: str,
                 max_tokens: int = DECODE_TOKENS) -> dict[str, list[tuple[int, float]]]:
    """Device time per call (µs) against tokens, up to ``max_tokens``; returns the series drawn."""
    def microseconds(row: Annotated) -> float | None:
        return None if row.measurement.seconds is None else row.measurement.seconds * 1e6

    series = _series(rows, microseconds, max_tokens)
    _draw(rows, series, path, title=title, ylabel="µs per call (median)", log_y=True)
    return series


def write_plots(rows: list[Annotated], out_dir: pathlib.Path) -> list[pathlib.Path]:
    """``bandwidth-<shape>-<dtype>.png`` and ``latency-<shape>-<dtype>.png`` per shape and dtype
    in ``out_dir``, each where it has something to draw; returns the files written."""
    written = []
    for (shape, dtype), group in groups(rows).items():
        described = f"{shape}: {SHAPES[shape].description}" if shape in SHAPES else shape
        bandwidth = out_dir / f"bandwidth-{shape}-{dtype}.png"
        if plot_bandwidth(group, bandwidth, title=f"{described}, {dtype}: achieved bandwidth"):
            written.append(bandwidth)
        latency = out_dir / f"latency-{shape}-{dtype}.png"
        if plot_latency(group, latency, title=f"{described}, {dtype}: device time at small token counts"):
            written.append(latency)
    return written
