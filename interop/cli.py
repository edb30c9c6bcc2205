"""``fusedkv``: the project's command line; ``fusedkv check`` is its main job."""

from __future__ import annotations

import argparse
import json
import sys

from interop.equivalence import CheckOptions, run_check


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedkv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="run every available backend on the same random inputs and compare them",
        description=(
            "Run every available backend (the NumPy reference, the Triton kernel through "
            "PyTorch, the Pallas kernel through JAX; on a machine without a GPU the kernels "
            "run in interpret mode) on the same random inputs, compare each with the "
            "reference and with each other, and print a table. Exits 1 if anything disagrees."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    check.add_argument("--layers", type=int, default=5, help="draft layers (n_layers)")
    check.add_argument("--heads", type=int, default=8, help="KV heads (num_kv_heads)")
    check.add_argument("--head-dim", type=int, default=128, help="head_dim")
    check.add_argument("--rotary-dim", type=int, default=None,
                       help="rotary_dim (default: head_dim, full rotary)")
    check.add_argument("--rope-style", choices=("neox", "gptj"), default="neox")
    check.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                       help="dtype of kv and of the outputs")
    check.add_argument("--tokens", type=int, default=None,
                       help="total_ctx (default: 4096 with a GPU, 16 in CPU interpret mode)")
    check.add_argument("--max-position", type=int, default=32768,
                       help="rows of the cos/sin cache; positions are drawn below it")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.add_argument("--backends", default="all",
                       help="comma-separated subset of: torch, jax (the reference always runs)")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = CheckOptions(
        n_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        rotary_dim=args.rotary_dim if args.rotary_dim is not None else args.head_dim,
        rope_style=args.rope_style,
        dtype=args.dtype,
        total_ctx=args.tokens,
        max_position=args.max_position,
        seed=args.seed,
        backends=None if args.backends == "all" else tuple(args.backends.split(",")),
    )
    report = run_check(options)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
