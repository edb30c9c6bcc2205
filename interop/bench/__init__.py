"""``fusedkv bench``: every implementation of the op timed on one GPU, as tables, CSV, JSON,
markdown and plots.

Modules, each with one job: :mod:`~interop.bench.shapes` (the shapes, the grid, token counts
and bytes), :mod:`~interop.bench.workload` (random device inputs, rotated past the L2),
:mod:`~interop.bench.check` (the check before timing), :mod:`~interop.bench.baselines`
(the op in plain torch and jnp), :mod:`~interop.bench.timers` (one timer per regime),
:mod:`~interop.bench.rows` (what a row is), :mod:`~interop.bench.registry` (the
implementations), :mod:`~interop.bench.materializers` (the materializers' rows),
:mod:`~interop.bench.floors` (the Pallas kernel's data movement alone),
:mod:`~interop.bench.sweep` (tiles and forms), :mod:`~interop.bench.runner` (the run and
its progress bar), :mod:`~interop.bench.report` and :mod:`~interop.bench.plots` (tables,
CSV, JSON, markdown, PNG), :mod:`~interop.bench.grid` (the shape grid's tables and bars),
:mod:`~interop.bench.command` (the options and the command).

Importing this package imports neither torch, jax, matplotlib nor tqdm; a run imports
what it uses.
"""

from interop.bench.command import add_bench_arguments, run_bench_command

__all__ = ["add_bench_arguments", "run_bench_command"]
