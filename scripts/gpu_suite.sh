#!/usr/bin/env bash
# Everything the H200 must show, in one call (device tool):
#   GPU tests, `fusedkv check` on five configurations, the three benchmarks; tables last.
# Run from the tree, nothing installed:  bash scripts/gpu_suite.sh [--quick]
# Full logs go to $OUT (the device tool's folder) or /tmp/fusedkv-gpu.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# torch and jax share the GPU in one process: stop XLA from taking 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-/tmp/fusedkv-gpu}
mkdir -p "$LOGS"
QUICK=${1:-}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$LOGS/device.txt"
python3 - <<'PY' | tee -a "$LOGS/device.txt"
import sys, numpy, torch, triton, jax
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
      f"jax {jax.__version__}, numpy {numpy.__version__}, jax backend {jax.default_backend()}")
PY

status=0
python3 -m pytest -q -n 8 -p no:cacheprovider tests 2>&1 | tee "$LOGS/pytest.log" | tail -25 || status=1

: > "$LOGS/check.log"
for options in "" "--rotary-dim 64" "--head-dim 256 --rotary-dim 256" "--dtype float16" "--rope-style gptj"; do
    python3 -m interop check $options 2>&1 | tee -a "$LOGS/check.log" || status=1
done

# The record run leaves out the torch tile sweep (`python3 -m benchmarks.bench_torch
# --sections sweep` runs it); --quick shortens every benchmark.
if [ "$QUICK" = "--quick" ]; then
    TORCH_ARGS=(--quick); JAX_ARGS=(--quick); MATERIALIZER_ARGS=(--quick)
else
    TORCH_ARGS=(--sections draft,floor,baselines,variants,host); JAX_ARGS=(--quick); MATERIALIZER_ARGS=()
fi
python3 -m benchmarks.bench_torch "${TORCH_ARGS[@]}" 2>&1 | tee "$LOGS/bench_torch.log" || status=1
python3 -m benchmarks.bench_jax "${JAX_ARGS[@]}" 2>&1 | tee "$LOGS/bench_jax.log" || status=1
python3 -m benchmarks.bench_materializer "${MATERIALIZER_ARGS[@]}" 2>&1 | tee "$LOGS/bench_materializer.log" || status=1
python3 -m benchmarks.bench_interop 2>&1 | tee "$LOGS/bench_interop.log" || status=1

echo "== summary =="
tail -1 "$LOGS/pytest.log"
grep -E "ALL PASS|DISAGREEMENT" "$LOGS/check.log" | sort | uniq -c
exit $status
