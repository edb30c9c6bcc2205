"""Cross-backend equivalence: every backend against the reference and against each other."""

from __future__ import annotations

import dataclasses
import itertools
import time

from interop.backends import BackendUnavailable, gpu_framework, place_inputs, run_backend
from interop.dispatch import BACKENDS
from interop.inputs import random_inputs
from interop.reference import fused_kv_norm_rope_reference
from interop.spec import FusedKVConfig
from interop.tolerance import bit_mismatches, compare

DEFAULT_TOKENS_GPU = 4096
DEFAULT_TOKENS_CPU = 16


@dataclasses.dataclass(frozen=True)
class CheckOptions:
    n_layers: int = 5
    num_kv_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 128
    rope_style: str = "neox"
    dtype: str = "bfloat16"
    total_ctx: int | None = None
    max_position: int = 32768
    seed: int = 0
    backends: tuple[str, ...] | None = None

    @property
    def config(self) -> FusedKVConfig:
        return FusedKVConfig(self.num_kv_heads, self.head_dim, self.rotary_dim, self.rope_style)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: a backend against the reference, or two backends."""

    subject: str
    device: str
    against: str
    k_max_ulps: float | None
    v_mismatches: int | None
    ok: bool | None
    seconds: float | None
    detail: str


@dataclasses.dataclass(frozen=True)
class CheckReport:
    options: CheckOptions
    total_ctx: int
    rows: tuple[Row, ...]

    @property
    def ok(self) -> bool:
        return all(row.ok is not False for row in self.rows)

    def as_dict(self) -> dict:
        return {
            "options": dataclasses.asdict(self.options) | {"total_ctx": self.total_ctx},
            "ok": self.ok,
            "rows": [dataclasses.asdict(row) for row in self.rows],
        }

    def table(self) -> str:
        o = self.options
        title = (f"fusedkv check: {o.n_layers} layers, {o.num_kv_heads} KV heads, head_dim "
                 f"{o.head_dim}, rotary_dim {o.rotary_dim} ({o.rope_style}), {o.dtype}, "
                 f"{self.total_ctx} tokens, seed {o.seed}")
        header = ("backend", "device", "against", "K max ulp", "V", "result", "time")
        lines = [header]
        for row in self.rows:
            lines.append((
                row.subject,
                row.device,
                row.against,
                "-" if row.k_max_ulps is None else f"{row.k_max_ulps:.2f}",
                "-" if row.v_mismatches is None else
                ("bit-exact" if row.v_mismatches == 0 else f"{row.v_mismatches} differ"),
                {True: "PASS", False: "FAIL", None: "-" if row.subject == "reference" else "skipped"}[row.ok],
                "-" if row.seconds is None else f"{row.seconds * 1e3:.2f} ms",
            ))
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [title] + ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        text += [f"  {row.subject} vs {row.against}: {row.detail}" for row in self.rows
                 if row.detail]
        text.append("ALL PASS" if self.ok else "DISAGREEMENT FOUND")
        return "\n".join(text)


def _compare_row(subject, device, against, k, v, k_expected, v_expected, seconds, tolerance=None):
    k_result = compare(k, k_expected, name=f"{subject} k", tolerance=tolerance)
    v_count, v_first = bit_mismatches(v, v_expected)
    detail = k_result.report() if not k_result.ok else ""
    if v_count:
        detail += f"{'; ' if detail else ''}{subject} v: {v_count} elements differ bitwise, first at {v_first}"
    return Row(subject, device, against, k_result.max_ulps, v_count,
               k_result.ok and v_count == 0, seconds, detail)


def run_check(options: CheckOptions, runners=None) -> CheckReport:
    """Run the reference and the chosen backends on one set of inputs and compare them all.

    ``runners`` maps backend names to callables ``(name, placed_inputs, config) ->
    BackendRun`` (default: :func:`interop.backends.run_backend`); tests pass a
    corrupted one to see the check fail.
    """
    runners = runners or {name: run_backend for name in (options.backends or BACKENDS)}
    total_ctx = options.total_ctx
    if total_ctx is None:
        total_ctx = DEFAULT_TOKENS_CPU if gpu_framework() is None else DEFAULT_TOKENS_GPU
    config = options.config
    inputs = random_inputs(config, n_layers=options.n_layers, total_ctx=total_ctx,
                           dtype=options.dtype, max_position=options.max_position, seed=options.seed)
    start = time.perf_counter()
    k_ref, v_ref = fused_kv_norm_rope_reference(
        *inputs.arrays(), num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rotary_dim=config.rotary_dim, rope_style=config.rope_style)
    rows = [Row("reference", "CPU (NumPy)", "-", None, None, None, time.perf_counter() - start, "")]
    placed = place_inputs(inputs)
    runs = []
    for name, runner in runners.items():
        try:
            run = runner(name, placed, config)
        except BackendUnavailable as reason:
            rows.append(Row(name, "-", "-", None, None, None, None, str(reason)))
            continue
        runs.append(run)
        rows.append(_compare_row(run.name, run.device, "reference", run.k, run.v,
                                 k_ref, v_ref, run.seconds))
    for first, second in itertools.combinations(runs, 2):
        rows.append(_compare_row(first.name, first.device, second.name, first.k, first.v,
                                 second.k, second.v, None))
    return CheckReport(options, total_ctx, tuple(rows))
