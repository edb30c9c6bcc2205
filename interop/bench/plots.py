"""PNG plots of a run (matplotlib's Agg renderer, imported only here and only to draw), about
900 x 500 pixels, per shape and dtype, each of a few lines against tokens (log scale):

* ``kernels-*``: the kernels, the Pallas floors and the same-bytes copies as a fraction of
  the device's copy ceiling (a line at 1, the ceiling named in the axis label);
* ``latency-*``: the same rows' device time at decode sizes, where bandwidth means little;
* ``materializers-*``: each materializer's time over its own GEMM call's alone (a line at 1);
* ``baselines-*``: the baselines' device time beside the two kernels'.

The shape grid's configurations get none of these but ``grid-<implementation>.png`` for
each kernel: its fraction of copy (:mod:`interop.bench.grid`) at every configuration
(columns) and token count (rows), about 1400 x 600 pixels.

Host rows are in none: their time is the host's, not the device's.
"""

from __future__ import annotations

import pathlib

from interop.bench import grid
from interop.bench.report import Annotated, Ceiling, groups
from interop.bench.shapes import DECODE_TOKENS, GRID, SHAPES

FIGURE_INCHES = (9, 5)
GRID_FIGURE_INCHES = (14, 6)
DPI = 100
# The grid's colour scale: from half of copy (red) through the bar's 90% to above copy (green).
GRID_SCALE = (0.5, 1.1)
KIND_STYLES = {
    "kernel": dict(linestyle="-", marker="o", linewidth=2.4),
    "floor": dict(linestyle=":", marker="^", linewidth=1.6),
    "baseline": dict(linestyle="--", marker="s", linewidth=1.6),
    "materializer": dict(linestyle="-", marker="D", linewidth=1.8),
}
# One framework's copy against the other's: grey, dashed apart.
COPY_STYLES = (dict(linestyle=(0, (6, 3)), linewidth=1.4, color="dimgray"),
               dict(linestyle=(0, (2, 2)), linewidth=1.4, color="darkgray"))
# The kernels drawn beside the baselines, thin, for scale.
REFERENCE_STYLE = dict(linestyle="-", marker="", linewidth=1.0, color="silver")
OP_KINDS = ("kernel", "floor", "copy")
REFERENCE_KERNELS = ("triton", "pallas")

Series = dict[str, list[tuple[int, float]]]


def _token_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def _series(rows: list[Annotated], value, takes, max_tokens: int | None = None) -> Series:
    """``implementation -> [(tokens, value)]`` for timed device rows that ``takes``, in order of appearance."""
    series: Series = {}
    for row in rows:
        m = row.measurement
        y = value(row)
        if m.clock != "device" or not takes(m) or y is None or (max_tokens is not None and m.tokens > max_tokens):
            continue
        series.setdefault(m.implementation, []).append((m.tokens, y))
    return series


def _microseconds(row: Annotated) -> float | None:
    return None if row.measurement.seconds is None else row.measurement.seconds * 1e6


def kernel_series(rows: list[Annotated]) -> Series:
    return _series(rows, lambda row: row.of_ceiling, lambda m: m.kind in OP_KINDS)


def latency_series(rows: list[Annotated], max_tokens: int = DECODE_TOKENS) -> Series:
    return _series(rows, _microseconds, lambda m: m.kind in OP_KINDS, max_tokens)


def materializer_series(rows: list[Annotated]) -> Series:
    return _series(rows, lambda row: row.over_gemm, lambda m: m.kind == "materializer")


def baseline_series(rows: list[Annotated]) -> Series:
    series = _series(rows, _microseconds, lambda m: m.kind == "baseline")
    return series and dict(series, **_series(rows, _microseconds, lambda m: m.implementation in REFERENCE_KERNELS))


def _style(name: str, kind: str, reference: tuple[str, ...], copies_drawn: int) -> dict:
    if name in reference:
        return REFERENCE_STYLE
    if kind == "copy":
        return COPY_STYLES[copies_drawn % len(COPY_STYLES)]
    return KIND_STYLES.get(kind, {})


def _draw(rows: list[Annotated], series: Series, path: pathlib.Path, *, title: str, ylabel: str, log_y: bool,
          from_zero: bool = False, level: tuple[float, str] | None = None, reference: tuple[str, ...] = ()) -> None:
    """One chart of ``series``; ``from_zero``: the y axis starts at 0; ``level``: a
    horizontal line at this value, labelled; ``reference``: series drawn thin, for scale."""
    # A bare Figure renders through Agg without pyplot: no display, no global state.
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullLocator, StrMethodFormatter

    kinds = {row.measurement.implementation: row.measurement.kind for row in rows}
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI)
    axes = figure.add_subplot()
    copies = 0
    for name, points in series.items():
        points = sorted(points)
        style = _style(name, kinds[name], reference, copies)
        copies += kinds[name] == "copy"
        axes.plot([x for x, _ in points], [y for _, y in points], label=name, markersize=4, **style)
    if level is not None:
        axes.axhline(level[0], color="black", linewidth=0.8, label=level[1])
    ticks = sorted({x for points in series.values() for x, _ in points})
    axes.set_xscale("log", base=2)
    axes.set_xticks(ticks, [_token_label(t) for t in ticks])
    axes.xaxis.set_minor_locator(NullLocator())
    if log_y:
        axes.set_yscale("log")
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(StrMethodFormatter("{x:g}"))
        axes.yaxis.set_minor_locator(NullLocator())
    elif from_zero:
        axes.set_ylim(bottom=0)
    axes.set_xlabel("tokens (total_ctx)")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    figure.subplots_adjust(left=0.09, right=0.76, bottom=0.11, top=0.88)
    figure.savefig(path, format="png")


def _charts(group: list[Annotated], ceiling: Ceiling | None) -> list[tuple[str, Series, dict]]:
    """``(file stem, series, how to draw them)`` of each chart of one shape and dtype."""
    ceiling_label = "of the device copy ceiling" if ceiling is None else \
        f"of the device copy ceiling ({ceiling.gbps:.0f} GB/s)"
    return [
        ("kernels", kernel_series(group), dict(title="the kernels and floors against the device copy ceiling",
                                               ylabel=f"fraction {ceiling_label}", log_y=False, from_zero=True,
                                               level=(1.0, "device copy ceiling"))),
        ("latency", latency_series(group), dict(title="the kernels at decode sizes",
                                                ylabel="µs per call (median, device time)", log_y=True)),
        ("materializers", materializer_series(group), dict(
            title="the materializers against the same GEMM call alone",
            ylabel="time over its GEMM's alone", log_y=False, level=(1.0, "its GEMM alone"))),
        ("baselines", baseline_series(group), dict(title="the baselines beside the kernels",
                                                   ylabel="µs per call (median, device time)", log_y=True,
                                                   reference=REFERENCE_KERNELS)),
    ]


def grid_fractions(rows: list[Annotated], name: str) -> tuple[list[str], list[int], list[list[float | None]]]:
    """The grid's configurations (in grid order), token counts, and ``name``'s fraction of copy
    at each (a list per token count; None where not measured)."""
    found = grid.cells([row.measurement for row in rows])
    configurations = sorted({cell.shape for cell in found})
    tokens = sorted({cell.tokens for cell in found})
    fractions = {(cell.shape, cell.tokens): cell.fraction(name) for cell in found}
    return configurations, tokens, [[fractions.get((shape, count)) for shape in configurations] for count in tokens]


def _draw_grid(rows: list[Annotated], name: str, path: pathlib.Path) -> None:
    """``name``'s fraction of copy as a heatmap, each cell labelled in percent."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    configurations, tokens, fractions = grid_fractions(rows, name)
    values = np.ma.masked_invalid(np.array([[np.nan if v is None else v for v in line] for line in fractions]))
    figure = Figure(figsize=GRID_FIGURE_INCHES, dpi=DPI)
    axes = figure.add_subplot()
    image = axes.imshow(values, cmap=colormaps["RdYlGn"].with_extremes(bad="lightgray"), vmin=GRID_SCALE[0],
                        vmax=GRID_SCALE[1], aspect="auto", interpolation="nearest")
    for y, line in enumerate(fractions):
        for x, value in enumerate(line):
            if value is not None:
                axes.text(x, y, f"{value * 100:.0f}", ha="center", va="center", fontsize=6)
    axes.set_xticks(range(len(configurations)), configurations, rotation=90, fontsize=7)
    for label, shape in zip(axes.get_xticklabels(), configurations):
        label.set_color("black" if GRID[shape].half == "fit" else "tab:blue")
    axes.set_yticks(range(len(tokens)), [_token_label(count) for count in tokens])
    axes.set_ylabel("tokens (total_ctx)")
    axes.set_title(f"{name}: percent of copy per grid configuration (names in blue: the held-out half; "
                   "grey: not measured)", fontsize=9)
    figure.colorbar(image, ax=axes, fraction=0.02, pad=0.01, label="fraction of copy")
    figure.subplots_adjust(left=0.05, right=0.98, bottom=0.34, top=0.94)
    figure.savefig(path, format="png")


def write_plots(rows: list[Annotated], out_dir: pathlib.Path, ceiling: Ceiling | None = None) -> list[pathlib.Path]:
    """``kernels-``, ``latency-``, ``materializers-`` and ``baselines-<shape>-<dtype>.png`` in
    ``out_dir``, each where it has something to draw, and ``grid-<implementation>.png`` for
    each kernel of the grid; returns the files written."""
    written = []
    for (shape, dtype), group in groups(rows).items():
        if shape in GRID:
            continue
        described = f"{shape}: {SHAPES[shape].description}" if shape in SHAPES else shape
        for stem, series, how in _charts(group, ceiling):
            if series:
                path = out_dir / f"{stem}-{shape}-{dtype}.png"
                _draw(group, series, path, **dict(how, title=f"{described}, {dtype}\n{how['title']}"))
                written.append(path)
    for name in grid.fraction_rows(grid.cells([row.measurement for row in rows])):
        path = out_dir / f"grid-{name}.png"
        _draw_grid(rows, name, path)
        written.append(path)
    return written
