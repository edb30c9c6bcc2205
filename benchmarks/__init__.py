"""Benchmarks: run on a GPU machine from the tree, e.g. ``python -m benchmarks.bench_torch``."""
