"""``fusedkv bench``: time every implementation of the op on this GPU, print a table, write CSV, JSON and plots.

The console command wires it in with :func:`add_bench_arguments` (on its ``bench``
subparser) and :func:`run_bench_command`; ``python -m interop.bench`` runs it alone.
Exit status: 0 when every row passed its check and was timed, 1 when some row failed
or raised (the table says which), 2 when it refused (no GPU, a bad option).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import logging
import pathlib
import sys

from interop.bench.registry import BY_NAME, KINDS, select, unknown_words
from interop.bench.shapes import DEFAULT_TOKENS, DTYPES, QUICK_TOKENS, SHAPES

DESCRIPTION = """\
Time every implementation of the fused KV op on this GPU, in one process: the Triton
kernel (torch) and the Pallas kernel (jax) on its Triton lowering (pallas) and on Mosaic
GPU (pallas-mosaic: n/a where Mosaic GPU has no kernel); the reference math in eager
PyTorch, under torch.compile and as jnp under jax.jit; a device copy of the same bytes
in each framework (the ceiling); both materializers (GEMM alone, and end to end);
interop's calls, in one framework and crossing; and eager calls timed on the host.

Inputs are random, outputs poisoned, and every implementation is checked against the
interop reference (K within tolerance, V bit for bit) before it is timed; one that fails
is marked and not timed. Device time: CUDA-graph replay for torch, many calls inside one
jit for jax (about 1 ms of estimated device work a jit); medians; inputs rotated where
they would fit in L2. Bandwidth counts 2 * kv.nbytes (read kv, write K and V).

Writes bench.csv, bench.json and PNG plots (bandwidth against tokens, latency at small
token counts) to --out; prints the table last."""

REFUSAL = "fusedkv bench: no GPU here ({reasons}); it times GPU kernels, so there is nothing to measure."


def _token_list(text: str) -> tuple[int, ...]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated positive token counts such as 16,256,4096")
    return tuple(sorted(set(values)))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a positive whole number")
    return value


def _word_list(text: str) -> list[str]:
    words = [word.strip() for word in text.split(",") if word.strip()]
    unknown = unknown_words(words)
    if not words or unknown:
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated implementations or kinds; "
            f"{'unknown: ' + ', '.join(unknown) if unknown else 'none given'}; "
            f"kinds: {', '.join(KINDS)}; implementations: {', '.join(BY_NAME)}")
    return words


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give ``parser`` (the ``bench`` subparser, or a parser of its own) the bench's options."""
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--tokens", type=_token_list, default=None,
                        help=f"comma-separated token counts (default: {','.join(map(str, DEFAULT_TOKENS))}; "
                             f"with --quick: {','.join(map(str, QUICK_TOKENS))})")
    parser.add_argument("--shape", choices=(*SHAPES, "all"), default="draft",
                        help="; ".join(f"{s.name}: {s.description}" for s in SHAPES.values())
                             + "; all: the three (default: draft)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="dtype of kv and outputs (default: bfloat16)")
    parser.add_argument("--only", type=_word_list, default=None,
                        help=f"comma-separated implementations or kinds to run (default: all); kinds: "
                             f"{', '.join(KINDS)}; implementations: {', '.join(BY_NAME)}. The copy of each "
                             "framework timed on the device is always added (the fraction-of-copy column)")
    parser.add_argument("--out", default="bench-results",
                        help="directory for bench.csv, bench.json and the plots (default: bench-results)")
    parser.add_argument("--quick", action="store_true",
                        help="four token counts and fewer samples per row (a few minutes for one shape)")
    parser.add_argument("--max-calls-per-jit", type=_positive_int, default=None, metavar="N",
                        help="at most N calls in one jit of a JAX row (default: 512); fewer compile faster "
                             "but may leave the smallest sizes host-bound")
    return parser


def gpu_frameworks() -> tuple[dict[str, str], list[str]]:
    """The frameworks that see a GPU (name -> device), and why each other one does not."""
    found, reasons = {}, []
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        reasons.append("torch and triton are not both installed")
    else:
        import torch

        if torch.cuda.is_available():
            found["torch"] = torch.cuda.get_device_name()
        else:
            reasons.append("torch sees no CUDA device")
    if importlib.util.find_spec("jax") is None:
        reasons.append("jax is not installed")
    else:
        # jax warns on the logger when it finds no GPU plugin; the refusal says it in one line.
        bridge = logging.getLogger("jax._src.xla_bridge")
        level = bridge.level
        bridge.setLevel(logging.ERROR)
        try:
            import jax

            backend = jax.default_backend()
        finally:
            bridge.setLevel(level)
        if backend == "gpu":
            found["jax"] = jax.devices()[0].device_kind
        else:
            reasons.append(f"jax's backend is {backend}")
    return found, reasons


def _versions() -> dict[str, str]:
    versions = {}
    for package in ("torch", "triton", "jax", "jaxlib", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the bench with the options of :func:`add_bench_arguments`; returns the exit status."""
    found, reasons = gpu_frameworks()
    if not found:
        print(REFUSAL.format(reasons="; ".join(reasons)), file=sys.stderr)
        return 2
    implementations, skipped = select(args.only, found)
    if not implementations:
        print(f"fusedkv bench: nothing to run: {', '.join(i.name for i in skipped)} need a framework "
              f"that sees no GPU here ({'; '.join(reasons)})", file=sys.stderr)
        return 2

    from tqdm import tqdm

    from interop.bench.report import annotate, write_data
    from interop.bench.runner import FULL, QUICK, plan, run

    shapes = list(SHAPES.values()) if args.shape == "all" else [SHAPES[args.shape]]
    tokens = list(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    errors_log = out / "errors.log"
    errors_log.unlink(missing_ok=True)
    devices = sorted(set(found.values()))
    effort = QUICK if args.quick else FULL
    if args.max_calls_per_jit is not None:
        effort = dataclasses.replace(effort, max_calls_per_jit=args.max_calls_per_jit)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                devices=found, versions=_versions(), shapes=[s.name for s in shapes], dtype=args.dtype,
                tokens=tokens, quick=args.quick, max_calls_per_jit=effort.max_calls_per_jit,
                implementations=[i.name for i in implementations])
    print(f"fusedkv bench on {', '.join(devices)} ({', '.join(f'{k} {v}' for k, v in meta['versions'].items())}): "
          f"{', '.join(meta['shapes'])}, {args.dtype}, tokens {','.join(map(str, tokens))}; "
          f"results in {out}/", flush=True)
    if skipped:
        print(f"skipped ({'; '.join(reasons)}): {', '.join(i.name for i in skipped)}", flush=True)

    tasks = plan(shapes, tokens, implementations)
    # Redrawn often on a terminal, rarely into a log (each redraw is a line of it).
    with tqdm(total=len(tasks), unit="row", desc="fusedkv bench", dynamic_ncols=True, file=sys.stderr,
              mininterval=0.5 if sys.stderr.isatty() else 10) as bar:
        def on_error(failed, trace: str) -> None:
            with open(errors_log, "a") as log:
                log.write(f"== {failed.shape}, {failed.tokens} tokens, {failed.implementation} ==\n{trace}\n")
            bar.write(f"{failed.implementation} at {failed.tokens} tokens: {failed.error} (see {errors_log})")

        measurements = run(tasks, dtype=args.dtype, framework="torch" if "torch" in found else "jax",
                           effort=effort, progress=bar, on_error=on_error,
                           on_size_done=lambda so_far: write_data(annotate(so_far), out, meta))

    return _report(measurements, out, meta)


def _report(measurements, out: pathlib.Path, meta: dict) -> int:
    """Print the tables, write the files, and return the exit status."""
    from interop.bench.plots import write_plots
    from interop.bench.report import annotate, format_table, groups, write_data

    rows = annotate(measurements)
    for (shape, dtype), group in groups(rows).items():
        print(f"\n== {shape}: {SHAPES[shape].description}, {dtype} ==")
        print(format_table(group))
    written = write_data(rows, out, meta) + write_plots(rows, out)
    print(f"\nwrote {', '.join(str(path) for path in written)}")
    failed = [m for m in measurements if not m.ok]
    if failed:
        print(f"{len(failed)} rows failed their check or raised: "
              f"{', '.join(sorted({m.implementation for m in failed}))}", file=sys.stderr)
    return 1 if failed else 0
