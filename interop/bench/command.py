"""``fusedkv bench``: time every implementation of the op on this GPU, print tables, write CSV, JSON,
plots and (``--markdown``) the tables as markdown.

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
import os
import pathlib
import platform
import shlex
import sys

from interop.bench import sweep
from interop.bench.registry import BY_NAME, KINDS, select, unknown_words
from interop.bench.shapes import (
    DEFAULT_TOKENS,
    DTYPES,
    GRID,
    GRID_HALVES,
    GRID_MAX_BYTES,
    GRID_SEED,
    GRID_TOKENS,
    QUICK_TOKENS,
    SHAPES,
    BenchShape,
)
from interop.bench.workload import POSITIONS, SEQUENCE_TOKENS

DESCRIPTION = """\
Time every implementation of the fused KV op on this GPU, in one process: the Triton
kernel (torch) and the Pallas kernel (jax) on its Triton lowering (pallas; pallas-pdl in
a jit compiled with XLA's programmatic dependent launch) and on Mosaic GPU
(pallas-mosaic: n/a where Mosaic GPU has no kernel); the Pallas kernel's data
movement alone (its floors); the reference math in eager PyTorch, under torch.compile
and as jnp under jax.jit (the baselines); a device copy of the same bytes in each
framework; both materializers (each one's GEMM call alone, end to end, into a paged
cache, and the flow it replaces); interop's calls; and eager calls timed on the host,
beside Triton's own launch of the compiled kernel.

Inputs are random, outputs poisoned, and every implementation is checked against the
interop reference (K within tolerance, V bit for bit) before it is timed; one that fails
is marked and not timed. Device time: CUDA-graph replay for torch, many calls inside one
jit for jax (about 1 ms of estimated device work a jit); medians; inputs rotated where
they would fit in L2. Bandwidth counts 2 * kv.nbytes (read kv, write K and V), against a
same-bytes copy ("of copy") and against the device's copy ceiling ("of ceiling": the
highest of a 1 GiB copy and every copy and floor row of the run, named in the output).

--shape grid times a seeded sample of draft configurations, each in its own dtype,
as --quick samples (the kernels and copies unless --only says otherwise), and adds the
grid's tables: each configuration against copy, the worst and median per token bucket,
and the issue's bars, per half of the grid (fit, held-out).

--host times the eager calls alone (16 tokens unless --tokens says otherwise); --sweep
and --forms add the kernels' tiles and the Pallas kernel's forms as rows of their own;
--rounds times every row in alternated rounds. Writes bench.csv, bench.json and PNG
plots (the kernels against the ceiling, their latency at small token counts, the
materializers against their GEMM, the baselines) to --out; prints the tables last."""

HOST_TOKENS = (16,)
ONE_GIB_COPY = "a 1 GiB torch copy (do_bench median)"

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


def _config_list(text: str) -> tuple[int, ...]:
    """``--configs``: grid numbers and ranges of them, such as ``0-9,12``."""
    numbers: set[int] = set()
    try:
        for part in (part.strip() for part in text.split(",") if part.strip()):
            low, _, high = part.partition("-")
            numbers.update(range(int(low), int(high or low) + 1))
    except ValueError:
        numbers = set()
    if not numbers or min(numbers) < 0 or max(numbers) >= len(GRID):
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected comma-separated grid numbers or ranges of them from 0 to {len(GRID) - 1}, "
            "such as 0-9,12")
    return tuple(sorted(numbers))


def _path_list(text: str) -> tuple[str, ...]:
    paths = tuple(part.strip() for part in text.split(",") if part.strip())
    missing = [path for path in paths if not pathlib.Path(path).is_file()]
    if not paths or missing:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected comma-separated bench.json files"
                                         + (f"; not a file: {', '.join(missing)}" if missing else ""))
    return paths


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
    parser.add_argument("--shape", choices=(*SHAPES, "all", "grid"), default="draft",
                        help="; ".join(f"{s.name}: {s.description}" for s in SHAPES.values())
                             + f"; all: the three; grid: {len(GRID)} seeded draft configurations in their own "
                               "dtypes (default: draft)")
    parser.add_argument("--configs", type=_config_list, default=None, metavar="NUMBERS",
                        help="with --shape grid: only these configurations, by number (g07 is 7), comma-separated "
                             "numbers and ranges such as 0-9,12")
    parser.add_argument("--grid-half", choices=GRID_HALVES, default=None,
                        help="with --shape grid: only the configurations of this half (the tile rules' fit half, "
                             "or the half held out from it)")
    parser.add_argument("--positions", choices=POSITIONS, default="uniform",
                        help="the tokens' positions: uniform random (default), consecutive from a random "
                             "start, as a sequence's context is, or sequences: a batch of sequences of 1 to "
                             f"{SEQUENCE_TOKENS} tokens, each consecutive from its own start")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="dtype of kv and outputs (default: bfloat16)")
    parser.add_argument("--only", type=_word_list, default=None,
                        help=f"comma-separated implementations or kinds to run (default: all); kinds: "
                             f"{', '.join(KINDS)}; implementations: {', '.join(BY_NAME)}. What a row is read "
                             "against is always added: its framework's copy, a materializer's GEMM, "
                             "an option row's plain row, Triton's own launch under host rows")
    parser.add_argument("--host", action="store_true",
                        help="the host-cost table: every eager entry point's host wall per call against "
                             "Triton's own launch of the same compiled kernel (the host and interop rows; "
                             f"tokens {','.join(map(str, HOST_TOKENS))} unless --tokens is given)")
    parser.add_argument("--sweep", type=sweep.tile_list, nargs="?", const=sweep.DEFAULT_TILES, default=None,
                        metavar="TILES",
                        help="add a row per tile of each kernel, BLOCK_TOKENSxBLOCK_HEADSxNUM_WARPS or d (the "
                             f"kernel's own), comma-separated (default: {','.join(sweep.DEFAULT_TILES)}); "
                             "without --only, beside the triton and pallas rows alone; with an --only that "
                             "names one of the two kernels, that kernel's tiles alone")
    parser.add_argument("--forms", type=sweep.form_list, default=None, metavar="FORMS",
                        help="add a row per form of the Pallas kernel (at each --sweep tile, else its own), "
                             "two letters each: a program takes every layer, then K is loaded as whole rows; "
                             "1 forced on, 0 off, p the kernel's rule (pp: the production kernel)")
    parser.add_argument("--rounds", type=_positive_int, default=1, metavar="N",
                        help="check every row of a size, then time each N times in alternated order and report "
                             "the median (default: 1); the rows of a size are held ready together, so at the "
                             "largest sizes run fewer of them")
    parser.add_argument("--out", default="bench-results",
                        help="directory for bench.csv, bench.json and the plots (default: bench-results)")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="also write the tables as markdown to PATH, under the command line, devices, "
                             "packages and ceiling that produced them")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the rows the options would run, shape by shape, and the sizes the grid "
                             "leaves out, then exit; needs no GPU")
    parser.add_argument("--from-json", type=_path_list, default=None, metavar="PATHS",
                        help="no run: the tables, plots and markdown of the rows of these bench.json files "
                             "together (comma-separated), such as the parts of a grid run; a later file's row "
                             "replaces an earlier one of the same shape, dtype, implementation and tokens")
    parser.add_argument("--resume", type=_path_list, default=None, metavar="PATHS",
                        help="skip every size (shape and token count) whose rows, each implementation this run "
                             "would measure there, passed in one of these bench.json files (comma-separated, "
                             "earlier parts of the same run: same positions); join the parts with --from-json")
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
    versions = {"python": platform.python_version()}
    for package in ("torch", "triton", "jax", "jaxlib", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def command_line(args: argparse.Namespace) -> str:
    """The ``fusedkv bench`` command that runs as ``args`` do: every option not at its default."""
    defaults = vars(add_bench_arguments(argparse.ArgumentParser()).parse_args([]))
    words = ["fusedkv bench"]
    for dest, default in defaults.items():
        value, option = getattr(args, dest, default), "--" + dest.replace("_", "-")
        if value == default:
            continue
        if value is True or (dest == "sweep" and value == sweep.DEFAULT_TILES):
            words.append(option)
        else:
            words += [option, shlex.quote(",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value))]
    return " ".join(words)


def sweep_rows(args: argparse.Namespace) -> list:
    """``--sweep``'s and ``--forms``' rows: of both kernels, or of the one kernel ``--only`` names."""
    if not (args.sweep or args.forms):
        return []
    named = [kernel for kernel in sweep.KERNELS if kernel in (args.only or ())]
    return sweep.implementations(args.sweep or ("d",), args.forms, kernels=tuple(named) if len(named) == 1
                                 else sweep.KERNELS)


def words_to_run(args: argparse.Namespace) -> list[str] | None:
    """The registry rows to run: ``--only``'s, or those ``--host`` and ``--sweep`` compare, or all."""
    if args.only is None and args.shape == "grid" and not (args.host or args.sweep or args.forms):
        return ["kernel"]
    if args.only is not None or not (args.host or args.sweep or args.forms):
        return args.only
    return (["host", "interop"] if args.host else []) + (["triton", "pallas"] if args.sweep or args.forms else [])


def token_counts(args: argparse.Namespace) -> list[int]:
    """``--tokens``, or the defaults of ``--host`` alone, the grid, ``--quick`` or a full run."""
    if args.tokens:
        return list(args.tokens)
    if args.host and not (args.sweep or args.forms):
        return list(HOST_TOKENS)
    if args.shape == "grid":
        return list(GRID_TOKENS)
    return list(QUICK_TOKENS if args.quick else DEFAULT_TOKENS)


def _copy_ceiling(found: dict[str, str]) -> tuple[float | None, str]:
    """A 1 GiB device copy's GB/s, measured once, where torch sees the GPU (else None), and how."""
    if "torch" not in found:
        return None, ""
    from interop.bench.timers import copy_bytes_per_second

    try:
        return copy_bytes_per_second() / 1e9, ONE_GIB_COPY
    except Exception as error:  # the copy and floor rows of the run still give a ceiling
        print(f"the 1 GiB copy failed ({type(error).__name__}: {error}); the ceiling is the run's copies'",
              file=sys.stderr)
        return None, ""


def bench_shapes(args: argparse.Namespace) -> list[BenchShape]:
    """The shapes ``--shape`` names; of the grid, those ``--configs`` and ``--grid-half`` keep."""
    if args.shape == "all":
        return list(SHAPES.values())
    if args.shape != "grid":
        return [SHAPES[args.shape]]
    return [shape for number, shape in enumerate(GRID.values())
            if (args.configs is None or number in args.configs) and args.grid_half in (None, shape.half)]


def grid_refusal(args: argparse.Namespace) -> str | None:
    """Why the grid options cannot be run as given, or None."""
    if args.shape != "grid" and (args.configs is not None or args.grid_half is not None):
        return "--configs and --grid-half pick configurations of the grid; they need --shape grid"
    if args.shape == "grid" and not bench_shapes(args):
        return f"no grid configuration is both among --configs and of the {args.grid_half} half"
    return None


def over_memory(shapes: list[BenchShape], tokens: list[int], dtype: str) -> list[tuple[BenchShape, int]]:
    """The grid's sizes whose kv and outputs together pass :data:`~interop.bench.shapes.GRID_MAX_BYTES`."""
    return [(shape, total_ctx) for shape in shapes if shape.name in GRID for total_ctx in tokens
            if shape.op_bytes(total_ctx, shape.dtype or dtype) > GRID_MAX_BYTES]


def _grid_meta(shapes: list[BenchShape], tokens: list[int], dtype: str) -> dict:
    """The grid's seed, its configurations in the run and the sizes left out, each a line."""
    skipped = [f"{shape.name} at {total_ctx} tokens ({shape.op_bytes(total_ctx, shape.dtype or dtype) / 2**30:.1f} "
               f"GiB of kv and outputs, over {GRID_MAX_BYTES / 2**30:g} GiB)"
               for shape, total_ctx in over_memory(shapes, tokens, dtype)]
    return dict(seed=GRID_SEED, configurations=[shape.name for shape in shapes], skipped=skipped)


def resume_refusal(args: argparse.Namespace) -> str | None:
    """Why the ``--resume`` files cannot be resumed from, or None: each must be a bench.json
    of this run's positions (rows of other positions time other inputs)."""
    from interop.bench.report import read_data

    for path in args.resume or ():
        try:
            meta, _ = read_data(path)
        except (ValueError, KeyError, TypeError):
            return f"--resume {path} is not a bench.json that fusedkv bench wrote"
        if meta.get("positions", "uniform") != args.positions:
            return (f"--resume {path} has rows of {meta.get('positions')} positions, this run "
                    f"{args.positions} positions")
    return None


def measured_sizes(paths: tuple[str, ...], tasks: list, dtype: str) -> set[tuple[str, int]]:
    """The sizes ``(shape name, tokens)`` of ``tasks`` (:func:`~interop.bench.runner.plan`'s,
    in ``dtype`` where a shape has none of its own) whose every row passed, timed, in the
    same dtype in one of the bench.json files at ``paths`` (``--resume``)."""
    from interop.bench.report import read_data

    passed = set()
    for path in paths:
        _, rows = read_data(path)
        passed |= {(row.shape, row.dtype, row.tokens, row.implementation) for row in rows
                   if row.ok and row.seconds is not None}
    wanted: dict[tuple[str, int], list[tuple]] = {}  # a size's rows, as keys of passed
    for shape, total_ctx, implementation in tasks:
        wanted.setdefault((shape.name, total_ctx), []).append(
            (shape.name, shape.dtype or dtype, total_ctx, implementation.name))
    return {size for size, keys in wanted.items() if all(key in passed for key in keys)}


def _sizes_left_out(args: argparse.Namespace, shapes: list, tokens: list[int], implementations: list) -> set:
    """The sizes ``(shape name, tokens)`` this run does not measure: over the grid's memory
    limit, or measured already (``--resume``, whose count it prints)."""
    from interop.bench.runner import plan

    left_out = {(shape.name, total_ctx) for shape, total_ctx in over_memory(shapes, tokens, args.dtype)}
    if args.resume:
        measured = measured_sizes(args.resume, plan(shapes, tokens, implementations), args.dtype) - left_out
        print(f"resumed: {len(measured)} sizes measured already in {', '.join(args.resume)}", flush=True)
        left_out |= measured
    return left_out


def dry_run(args: argparse.Namespace) -> int:
    """``--dry-run``: the rows each shape would run, as though torch and jax both saw a GPU."""
    from interop.bench.runner import plan

    extra = sweep_rows(args)
    implementations, _ = select(words_to_run(args), {"torch": "", "jax": ""}, extra=extra)
    shapes, tokens = bench_shapes(args), token_counts(args)
    left_out = _sizes_left_out(args, shapes, tokens, implementations)
    tasks = [task for task in plan(shapes, tokens, implementations) if (task[0].name, task[1]) not in left_out]
    print(f"fusedkv bench {'--shape grid ' if args.shape == 'grid' else ''}would run {len(tasks)} rows "
          f"({', '.join(i.name for i in implementations)}) at tokens {','.join(map(str, tokens))}:")
    for shape in shapes:
        sizes = sorted({total_ctx for task_shape, total_ctx, _ in tasks if task_shape is shape})
        print(f"  {shape.name} ({shape.description}, {shape.dtype or args.dtype}): "
              f"{sum(task[0] is shape for task in tasks)} rows at tokens {','.join(map(str, sizes)) or 'none'}")
    for line in _grid_meta(shapes, tokens, args.dtype)["skipped"]:
        print(f"skipped {line}")
    return 0


def latest_rows(parts: list[list]) -> tuple[list, int]:
    """The measurements of ``parts`` (each a run's, in order), a later run's row replacing an
    earlier one of the same shape, dtype, implementation and token count (a row measured
    again, after a change); each row where it first stood. Also how many were replaced."""
    latest: dict[tuple, object] = {}
    for rows in parts:
        for row in rows:  # a key assigned again keeps its place
            latest[(row.shape, row.dtype, row.implementation, row.tokens)] = row
    return list(latest.values()), sum(map(len, parts)) - len(latest)


def from_json(args: argparse.Namespace) -> int:
    """``--from-json``: one report of the rows of earlier runs (:func:`latest_rows`), under the
    first run's devices and packages, the fastest 1 GiB copy of any of them, and each run's command."""
    from interop.bench.report import read_data

    metas, parts = [], []
    for path in args.from_json:
        meta, rows = read_data(path)
        metas.append(meta)
        parts.append(rows)
    measurements, replaced = latest_rows(parts)
    if replaced:
        print(f"{replaced} rows of earlier parts replaced by a later part's row of the same shape, dtype, "
              "implementation and token count", flush=True)
    copies = [tuple(meta["copy_ceiling"]) for meta in metas if meta.get("copy_ceiling", [None])[0] is not None]
    meta = dict(metas[0], command=command_line(args), parts=[meta["command"] for meta in metas],
                shapes=list(dict.fromkeys(name for meta in metas for name in meta["shapes"])))
    grids = [meta["grid"] for meta in metas if "grid" in meta]
    if grids:
        meta["grid"] = dict(seed=grids[0]["seed"], configurations=list(dict.fromkeys(
            name for grid in grids for name in grid["configurations"])),
            skipped=list(dict.fromkeys(line for grid in grids for line in grid["skipped"])))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return _report(measurements, out, meta, max(copies, default=(None, "")), markdown=args.markdown)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the bench with the options of :func:`add_bench_arguments`; returns the exit status."""
    refusal = grid_refusal(args) or resume_refusal(args)
    if refusal is not None:
        print(f"fusedkv bench: {refusal}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args)
    if args.from_json:
        return from_json(args)
    found, reasons = gpu_frameworks()
    if not found:
        print(REFUSAL.format(reasons="; ".join(reasons)), file=sys.stderr)
        return 2
    extra = sweep_rows(args)
    implementations, skipped = select(words_to_run(args), found, extra=extra)
    if not implementations:
        print(f"fusedkv bench: nothing to run: {', '.join(i.name for i in skipped)} need a framework "
              f"that sees no GPU here ({'; '.join(reasons)})", file=sys.stderr)
        return 2

    from interop.bench.runner import FULL, QUICK

    shapes = bench_shapes(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    effort = QUICK if args.quick or args.shape == "grid" else FULL
    if args.max_calls_per_jit is not None:
        effort = dataclasses.replace(effort, max_calls_per_jit=args.max_calls_per_jit)
    meta = dict(command=command_line(args),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                devices=found, versions=_versions(), shapes=[s.name for s in shapes], dtype=args.dtype,
                tokens=token_counts(args), positions=args.positions, quick=args.quick, rounds=args.rounds,
                max_calls_per_jit=effort.max_calls_per_jit, implementations=[i.name for i in implementations],
                xla_flags=os.environ.get("XLA_FLAGS", ""))
    if args.shape == "grid":
        meta["grid"] = _grid_meta(shapes, meta["tokens"], args.dtype)
    what = (f"{len(shapes)} grid configurations, each in its own dtype" if args.shape == "grid"
            else f"{', '.join(meta['shapes'])}, {args.dtype}")
    print(f"fusedkv bench on {', '.join(sorted(set(found.values())))} "
          f"({', '.join(f'{k} {v}' for k, v in meta['versions'].items())}): {what}, "
          f"tokens {','.join(map(str, meta['tokens']))}, {args.positions} positions; results in {out}/", flush=True)
    for line in meta.get("grid", {}).get("skipped", []):
        print(f"skipped {line}", flush=True)
    if skipped:
        print(f"skipped ({'; '.join(reasons)}): {', '.join(i.name for i in skipped)}", flush=True)
    copy = _copy_ceiling(found) if any(i.clock == "device" for i in implementations) else (None, "")
    meta["copy_ceiling"] = list(copy)
    measurements = _measure(shapes, implementations, meta, effort, out, copy,
                            framework="torch" if "torch" in found else "jax",
                            skip=_sizes_left_out(args, shapes, meta["tokens"], implementations))
    return _report(measurements, out, meta, copy, markdown=args.markdown)


def _measure(shapes, implementations, meta: dict, effort, out: pathlib.Path, copy: tuple, *, framework: str,
             skip: set[tuple[str, int]]):
    """Every row but those of the sizes in ``skip`` (shape name, tokens), behind a progress
    bar; the files rewritten after each size."""
    from tqdm import tqdm

    from interop.bench.report import write_data
    from interop.bench.runner import plan, run

    errors_log = out / "errors.log"
    errors_log.unlink(missing_ok=True)
    tasks = [task for task in plan(shapes, meta["tokens"], implementations) if (task[0].name, task[1]) not in skip]
    # Redrawn often on a terminal, rarely into a log (each redraw is a line of it).
    with tqdm(total=len(tasks), unit="row", desc="fusedkv bench", dynamic_ncols=True, file=sys.stderr,
              mininterval=0.5 if sys.stderr.isatty() else 10) as bar:
        def on_error(failed, trace: str) -> None:
            with open(errors_log, "a") as log:
                log.write(f"== {failed.shape}, {failed.tokens} tokens, {failed.implementation} ==\n{trace}\n")
            bar.write(f"{failed.implementation} at {failed.tokens} tokens: {failed.error} (see {errors_log})")

        return run(tasks, dtype=meta["dtype"], framework=framework, effort=effort, rounds=meta["rounds"],
                   positions=meta["positions"],
                   progress=bar, on_error=on_error,
                   on_size_done=lambda so_far: write_data(_annotated(so_far, copy, meta)[0], out, meta))


def _annotated(measurements, copy: tuple, meta: dict):
    """The rows with their derived columns, the ceiling recorded in ``meta``."""
    from interop.bench.report import annotate, device_ceiling

    ceiling = device_ceiling(measurements, *copy)
    meta["ceiling"] = None if ceiling is None else ceiling.describe()
    return annotate(measurements, ceiling), ceiling


def _report(measurements, out: pathlib.Path, meta: dict, copy: tuple, *, markdown: str | None) -> int:
    """Print the tables, write the files, and return the exit status."""
    from interop.bench import grid
    from interop.bench.plots import write_plots
    from interop.bench.report import format_table, groups, markdown_report, sections, write_data

    rows, ceiling = _annotated(measurements, copy, meta)
    descriptions = {name: shape.description for name, shape in (*SHAPES.items(), *GRID.items())}
    print(f"\ndevice copy ceiling: {meta['ceiling'] or 'none measured'}")
    for (shape, dtype), group in groups(rows).items():
        for section, taken in sections(group, in_grid=shape in GRID):
            print(f"\n== {shape}: {descriptions[shape]}, {dtype}: {section.title} ==")
            print(format_table(taken, section.columns, fastest_first=section.fastest_first))
    skipped = meta.get("grid", {}).get("skipped", [])
    grid_text = grid.format_tables(measurements, skipped)
    if grid_text:
        print(grid_text)
    written = write_data(rows, out, meta) + write_plots(rows, out, ceiling)
    if markdown:
        path = pathlib.Path(markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(markdown_report(rows, meta, descriptions, grid.markdown_tables(measurements, skipped)))
        written.append(path)
    print(f"\nwrote {', '.join(str(path) for path in written)}")
    failed = [m for m in measurements if not m.ok]
    if failed:
        print(f"{len(failed)} rows failed their check or raised: "
              f"{', '.join(sorted({m.implementation for m in failed}))}", file=sys.stderr)
    return 1 if failed else 0
