"""The ``fusedkv`` command line: ``check`` (the main job), ``info``, ``--version``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys

import interop
from interop import registry
from interop.bench import add_bench_arguments, run_bench_command
from interop.command import backends
from interop.registry import BACKENDS
from interop.core.spec import ROPE_TABLE_DTYPES
from interop.command.check import (
    DEFAULT_TOKENS_CPU,
    DEFAULT_TOKENS_CPU_MOSAIC,
    DEFAULT_TOKENS_GPU,
    CheckOptions,
    GradientRow,
    Row,
    gradient_header,
    header,
    row_lines,
    run_check,
    title,
    verdict,
)

# Interpreted (no GPU), a check expected to take longer than this is announced with its
# estimate, and one expected to take longer than the second is refused.
WARN_SECONDS = 60
REFUSE_SECONDS = 30 * 60
# The status of a program stopped by SIGPIPE (128 + 13), when the reader of the output goes away.
READER_GONE = 141
PACKAGES = ("numpy", "ml_dtypes", "torch", "triton", "jax", "jaxlib")


def _integer(text: str, least: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < least:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected {expected}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _non_negative(text: str) -> int:
    return _integer(text, 0, "a non-negative integer")


def _backend_list(text: str) -> tuple[str, ...] | None:
    if text == "all":
        return None
    names = tuple(dict.fromkeys(text.split(",")))
    if not all(name in BACKENDS for name in names):
        raise argparse.ArgumentTypeError(
            f"got {text!r}, expected 'all' or a comma-separated subset of {', '.join(BACKENDS)}")
    return names


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="fusedkv",
        description="fusedkv: the fused K/V materialization op (RMSNorm + RoPE on K, V copied "
                    "bit for bit) as a Triton kernel for PyTorch and a Pallas kernel for JAX.",
    )
    parser.add_argument("--version", action="version", version=f"fusedkv {interop.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    check = commands.add_parser(
        "check",
        help="run every backend on the same random inputs and compare them",
        description=(
            "Run every available backend (the Triton kernel through PyTorch, the Pallas kernel "
            "through JAX) on the same random input bytes, compare each with the NumPy reference "
            "(K within the tolerance table's ulps, V bit for bit) and every pair of backends "
            "with each other, and print each row as it is done. Each backend is called twice: "
            "the first call compiles, the second is the steady cost. Without a GPU the kernels "
            "run in interpret mode, which proves logic, not speed. Exits 1 if anything disagrees."
        ),
    )
    check.add_argument("--layers", type=_positive, default=5, metavar="N", help="draft layers, n_layers (default: 5)")
    check.add_argument("--heads", type=_positive, default=8, metavar="N", help="KV heads, num_kv_heads (default: 8)")
    check.add_argument("--head-dim", type=_positive, default=128, metavar="N", help="head_dim (default: 128)")
    check.add_argument("--rotary-dim", type=_positive, default=None, metavar="N",
                       help="rotated dims of each head: even, at most head_dim (default: head_dim)")
    check.add_argument("--rope-style", choices=("neox", "gptj"), default="neox",
                       help="which dims RoPE rotates together: neox pairs dim i with i + rotary_dim/2 "
                            "(halves), gptj pairs 2i with 2i+1 (interleaved) (default: neox)")
    check.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                       help="dtype of kv and of the outputs (default: bfloat16)")
    check.add_argument("--table-dtype", choices=ROPE_TABLE_DTYPES, default="float32",
                       help="dtype of the cos/sin table, which the kernels read as fp32 (default: float32)")
    check.add_argument("--tables", type=_positive, default=1, metavar="N",
                       help="cos/sin tables of N different RoPE bases, layer l reading table l %% N "
                            "through layer_rope_table; 1 is the one 2-D table (default: 1)")
    check.add_argument("--no-k-norm", action="store_true",
                       help="no K-norm (k_norm_weight and eps None): K is RoPE of the projected K")
    check.add_argument("--v-multiplier", action="store_true",
                       help="a random per-layer v_multiplier in [0.6, 0.72): V is v * v_multiplier[l], "
                            "rounded once")
    check.add_argument("--grad", action="store_true",
                       help="also each backend's gradients (kv's, and k_norm_weight's and v_multiplier's "
                            "where given) for random cotangents of K and V, against the reference backward "
                            "and each other")
    check.add_argument("--tokens", type=_positive, default=None, metavar="N",
                       help=f"total_ctx (default: {DEFAULT_TOKENS_GPU} with a GPU, "
                            f"{DEFAULT_TOKENS_CPU} in CPU interpret mode, {DEFAULT_TOKENS_CPU_MOSAIC} there "
                            "with --lowering mosaic_gpu)")
    check.add_argument("--max-position", type=_positive, default=32768, metavar="N",
                       help="rows of the cos/sin cache; positions are drawn below it (default: 32768)")
    check.add_argument("--seed", type=_non_negative, default=0, help="seed of the random inputs (default: 0)")
    check.add_argument("--backends", type=_backend_list, default=None, metavar="LIST",
                       help="'all' or a comma-separated subset of: torch, jax; the reference always "
                            "runs (default: all)")
    check.add_argument("--lowering", choices=("triton", "mosaic_gpu"), default=None,
                       help="the jax backend's Pallas lowering (default: the op's default, triton); "
                            "mosaic_gpu takes neox, bf16/fp16 kv, and without a GPU multiples of 64 tokens")
    check.add_argument("--json", action="store_true",
                       help="print the result as one JSON document at the end instead of the table")
    info = commands.add_parser(
        "info",
        help="versions, devices, and how each backend runs here",
        description="Print the installed versions, the devices each framework sees, and which "
                    "kernel each backend runs here: compiled or interpreted, and why.",
    )
    bench = commands.add_parser(
        "bench",
        help="time every implementation on this GPU: table, CSV/JSON, plots")
    add_bench_arguments(bench)
    return parser, {"check": check, "info": info, "bench": bench}


SIZE_OPTIONS = ("tokens", "layers", "heads", "head-dim")


def _sizes(options: CheckOptions) -> dict[str, int]:
    return {"tokens": options.tokens(), "layers": options.n_layers, "heads": options.num_kv_heads,
            "head-dim": options.head_dim, "rotary-dim": options.rotary_dim,
            "max-position": options.max_position, "tables": options.tables}


def _named(options: CheckOptions, flags: tuple[str, ...]) -> str:
    """``argument --a/--b``: those of the size options ``flags`` that are above their
    defaults (all of them where none is), so that an error names what to make smaller."""
    sizes, defaults = _sizes(options), _sizes(CheckOptions())
    grown = [flag for flag in flags if sizes[flag] > defaults[flag]]
    return "argument " + "/".join(f"--{flag}" for flag in grown or flags)


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CheckOptions:
    """The options of ``check``, or an argparse error (usage, one line, exit 2) naming the bad one."""
    if args.rotary_dim is None and args.head_dim % 2:
        parser.error(f"argument --head-dim: got {args.head_dim}, expected an even number, or an even "
                     "--rotary-dim below it (rotary_dim defaults to head_dim)")
    rotary_dim = args.head_dim if args.rotary_dim is None else args.rotary_dim
    if rotary_dim > args.head_dim or rotary_dim % 2:
        parser.error(f"argument --rotary-dim: got {rotary_dim}, expected an even number "
                     f"at most --head-dim ({args.head_dim})")
    options = CheckOptions(
        n_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim,
        rotary_dim=rotary_dim, rope_style=args.rope_style, dtype=args.dtype, table_dtype=args.table_dtype,
        tables=args.tables, k_norm=not args.no_k_norm, v_multiplier=args.v_multiplier, grad=args.grad,
        total_ctx=args.tokens, max_position=args.max_position, seed=args.seed,
        backends=args.backends, lowering=args.lowering,
    )
    if options.lowering is not None:
        _check_lowering(parser, options)
    shape = (f"{options.tokens()} tokens x {options.n_layers} layers x {options.num_kv_heads} KV heads "
             f"x head_dim {options.head_dim}")
    kv_bytes, table_bytes = options.host_bytes()
    memory = _physical_memory()
    if memory is not None and kv_bytes + table_bytes > memory:
        if table_bytes > kv_bytes:
            columns = "head-dim" if args.rotary_dim is None else "rotary-dim"
            tables = "a cos/sin table" if options.tables == 1 else f"{options.tables} cos/sin tables"
            need = "needs" if options.tables == 1 else "need"
            culprit = (f"{_named(options, ('max-position', columns, 'tables'))}: {tables} of "
                       f"{options.max_position} rows of {options.rotary_dim} {need}")
        else:
            culprit = f"{_named(options, SIZE_OPTIONS)}: {shape} need"
        parser.error(f"{culprit} about {_gib(kv_bytes + table_bytes)} of host memory for the "
                     f"check; this machine has {_gib(memory)}")
    if backends.gpu_framework() is None:
        seconds = options.interpreted_seconds()
        if seconds > REFUSE_SECONDS:
            parser.error(f"{_named(options, SIZE_OPTIONS + ('max-position', 'tables'))}: {shape} in "
                         f"interpret mode (no GPU here) would take about {_about(seconds)}; a CPU "
                         "run proves logic, not speed: take smaller sizes, or run on a GPU")
        if seconds > WARN_SECONDS:
            print(f"fusedkv check: {shape} in interpret mode (no GPU here): expect about "
                  f"{_about(seconds)}", file=sys.stderr, flush=True)
    return options


def _check_lowering(parser: argparse.ArgumentParser, options: CheckOptions) -> None:
    """An argparse error where ``--lowering`` cannot run: without the jax backend, or on
    Mosaic GPU for a configuration or context it does not take."""
    if "jax" not in options.backend_names:
        parser.error(f"argument --lowering: got {options.lowering}, expected the jax backend among --backends "
                     f"(got {','.join(options.backend_names)}): it picks the jax kernel's lowering")
    if options.lowering != "mosaic_gpu" or not registry.backend_installed("jax"):
        return
    import jax

    from fusedkv_jax import mosaic_kernel

    refused = mosaic_kernel.refused_config(options.config, options.dtype)
    if refused:
        parser.error(f"argument --lowering: {refused}")
    refused = mosaic_kernel.refused_context(options.tokens(), interpret=jax.default_backend() != "gpu")
    if refused:
        parser.error(f"argument --tokens with --lowering mosaic_gpu: {refused}")


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return None


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:,.0f} GiB" if n_bytes >= 10 * 2**30 else f"{n_bytes / 2**30:.1f} GiB"


def _about(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} minutes" if seconds < 7200 else f"{seconds / 3600:.0f} hours"


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    options = _check_options(parser, args)
    if args.json:
        report = run_check(options)
        print(json.dumps(report.as_dict(), indent=2))
        return 0 if report.ok else 1

    gradients_started = []

    def print_row(row: Row | GradientRow) -> None:
        if isinstance(row, GradientRow) and not gradients_started:
            gradients_started.append(True)
            print(gradient_header(), flush=True)
        print("\n".join(row_lines(row)), flush=True)

    print(title(options, options.tokens()), header(), sep="\n", flush=True)
    report = run_check(options, on_row=print_row)
    print(verdict(report.ok))
    return 0 if report.ok else 1


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _devices() -> list[str]:
    lines = []
    if registry.backend_installed("torch"):
        import torch

        cuda = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        lines.append(f"torch: {', '.join(cuda) if cuda else 'cpu only (no CUDA device)'}")
    if registry.backend_installed("jax"):
        import jax

        lines.append(f"jax: {', '.join(str(device) for device in jax.devices())} "
                     f"(default backend {jax.default_backend()})")
    return lines


def _info() -> int:
    lines = [f"fusedkv {interop.__version__} from {os.path.dirname(os.path.dirname(interop.__file__))}",
             f"Python {platform.python_version()} on {platform.machine()} {platform.system()}",
             "packages: " + ", ".join(f"{name} {_version(name)}" for name in PACKAGES),
             "devices:"]
    lines += [f"  {line}" for line in _devices()]
    lines.append("backends:")
    lines += [f"  {name}: {backends.platform(name).how}" for name in BACKENDS]
    if registry.backend_installed("jax"):
        lines.append(f"  jax with --lowering mosaic_gpu: {backends.platform('jax', 'mosaic_gpu').how}")
    lines.append(f"fusedkv check: inputs as {backends.inputs_placement()}, "
                 f"{CheckOptions().tokens()} tokens by default")
    # A plain `pip install jax` is CPU-only: beside a CUDA torch it leaves the Pallas kernel
    # interpreted, so name the jax build that matches torch's CUDA.
    if registry.backend_installed("torch") and registry.backend_installed("jax"):
        import jax
        import torch

        if torch.cuda.is_available() and torch.version.cuda and jax.default_backend() != "gpu":
            cuda = "cuda12" if torch.version.cuda.startswith("12.") else "cuda13"
            lines.append(f"note: jax sees no GPU while torch does: install jax[{cuda}] "
                         f"(pip install 'fusedkv[jax-{cuda}]') for the compiled Pallas kernel")
    # XLA launches a jit's kernels without programmatic dependent launch unless told, which
    # decode-size calls of the Pallas kernel feel most (README, On the GPU).
    if registry.backend_installed("jax"):
        import jax

        if jax.default_backend() == "gpu" and "xla_gpu_enable_pdl" not in os.environ.get("XLA_FLAGS", ""):
            lines.append("note: XLA launches a jit's kernels one after another: compile the jit with "
                         "compiler_options={'xla_gpu_enable_pdl': True} (or set "
                         "XLA_FLAGS=--xla_gpu_enable_pdl=true) to let each start as the one before ends")
    print("\n".join(lines))
    return 0


def _interpret_triton_without_gpu() -> None:
    """Run the Triton kernel in interpret mode where torch sees no CUDA device. Triton
    reads ``TRITON_INTERPRET`` when the kernel is defined, so this comes before
    ``fusedkv_torch`` is imported; a command owns its process's environment, the
    library never sets it."""
    if "fusedkv_torch" in sys.modules or not registry.backend_installed("torch"):
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _run(argv: list[str] | None) -> int:
    parser, subparsers = _parsers()
    args, unknown = parser.parse_known_args(argv)
    command = subparsers[args.command]
    if unknown:
        # argparse would answer with the top-level usage; the command's own is the useful one.
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    _interpret_triton_without_gpu()
    if args.command == "info":
        return _info()
    if args.command == "bench":
        # torch and jax share the GPU in one process: XLA must not claim 75% of it up front.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return run_bench_command(args)
    return _check(command, args)


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run(argv)
        sys.stdout.flush()  # so that a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        # The reader went away (`fusedkv check | head -1`): no traceback, and no exit status
        # of a disagreement. Output still buffered goes nowhere instead of failing at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_GONE
    return status


if __name__ == "__main__":
    sys.exit(main())
