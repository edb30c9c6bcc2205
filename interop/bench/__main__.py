import argparse
import sys

from interop.bench import add_bench_arguments, run_bench_command

sys.exit(run_bench_command(add_bench_arguments(argparse.ArgumentParser(prog="python -m interop.bench"))
                           .parse_args()))
