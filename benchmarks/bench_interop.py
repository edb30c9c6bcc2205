"""Host cost of the backend-neutral call (``interop.fused_kv_norm_rope``) over the bare backend call.

``python -m benchmarks.bench_interop`` on a GPU: at 16 tokens (bf16, 5 layers, 8 KV
heads, head_dim 128; the kernel is far shorter than the host work, so host wall time
per call is what a caller pays), each row times a long loop of calls synchronized
only at its ends (:func:`interop.bench.timers.host_seconds_per_call`); the overhead
column is the row minus the bare call of the same backend.
"""

from __future__ import annotations

import sys

import jax

from benchmarks.measure import DRAFT, DRAFT_STATIC, N_LAYERS
from interop import dispatch
from interop.bench.timers import host_seconds_per_call
from interop.exchange import to_torch
from interop.testing import random_inputs

TOTAL_CTX = 16


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_interop: no GPU; nothing to time.")
        return 0
    inputs = random_inputs(DRAFT, n_layers=N_LAYERS, total_ctx=TOTAL_CTX, seed=0)
    torch_args = [to_torch(a).to("cuda") for a in inputs.arrays()]
    jax_args = [jax.device_put(a) for a in inputs.arrays()]
    fusedkv_torch, fusedkv_jax = dispatch.load_backend("torch"), dispatch.load_backend("jax")

    def wait_jax(outputs):
        jax.block_until_ready(outputs)

    torch_bare, jax_bare = "torch: fusedkv_torch direct", "jax: fusedkv_jax direct"
    rows = [  # (name, the bare call of the backend that runs, call)
        (torch_bare, None, lambda: fusedkv_torch.fused_kv_norm_rope(*torch_args, **DRAFT_STATIC)),
        ("torch: via interop", torch_bare,
         lambda: dispatch.fused_kv_norm_rope(*torch_args, **DRAFT_STATIC, backend="torch")),
        ("jax arrays -> torch backend", torch_bare,
         lambda: dispatch.fused_kv_norm_rope(*jax_args, **DRAFT_STATIC, backend="torch")),
        (jax_bare, None, lambda: fusedkv_jax.fused_kv_norm_rope(*jax_args, **DRAFT_STATIC)),
        ("jax: via interop", jax_bare,
         lambda: dispatch.fused_kv_norm_rope(*jax_args, **DRAFT_STATIC, backend="jax")),
        ("torch tensors -> jax backend", jax_bare,
         lambda: dispatch.fused_kv_norm_rope(*torch_args, **DRAFT_STATIC, backend="jax")),
    ]
    seconds = {}
    for name, _, call in rows:
        seconds[name] = host_seconds_per_call(lambda i, call=call: call(), 1, calls=2000)
        jax.block_until_ready(call())
    print(f"== interop host overhead, {TOTAL_CTX} tokens, torch {torch.__version__}, "
          f"jax {jax.__version__}, {torch.cuda.get_device_name()} ==")
    print(f"{'call':32s} {'us/call':>8s} {'over direct':>12s}")
    for name, bare, _ in rows:
        extra = "-" if bare is None else f"{(seconds[name] - seconds[bare]) * 1e6:+.1f}"
        print(f"{name:32s} {seconds[name] * 1e6:8.1f} {extra:>12s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
