#!/usr/bin/env bash
# Everything the H200 must show, from the tree, nothing installed (device tool):
#   bash scripts/gpu_suite.sh [PART ...]      PART: tests, check, trust, bench, host (default: all five)
# tests: the whole pytest suite on the GPU (property tests under their CI budget);
# check: `fusedkv check` on five configurations; trust: scripts/gpu_trust.sh (10,000 calls
# per entry point, memory, threads, then the property tests under the gpu budget);
# bench: `fusedkv bench --quick` (table, CSV, JSON and plots under $LOGS/bench);
# host: benchmarks/host_path.py, the host cost of every eager entry point and its pieces.
# One device call holds at most 10 minutes: run the parts as two calls when all do not fit.
# Full logs go to $OUT (the device tool's folder) or /tmp/fusedkv-gpu; a summary comes last.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# torch and jax share the GPU in one process: stop XLA from taking 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-/tmp/fusedkv-gpu}
mkdir -p "$LOGS"
PARTS=${*:-tests check trust bench host}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$LOGS/device.txt"
python3 -m interop info 2>&1 | tee -a "$LOGS/device.txt"

status=0
summary=()
for part in $PARTS; do
    start=$SECONDS
    case "$part" in
        tests)
            python3 -m pytest -q -n 8 -p no:cacheprovider tests 2>&1 | tee "$LOGS/pytest.log" | tail -25 || status=1
            summary+=("tests: $(tail -1 "$LOGS/pytest.log")");;
        check)
            : > "$LOGS/check.log"
            for options in "" "--rotary-dim 64" "--head-dim 256 --rotary-dim 256" "--dtype float16" "--rope-style gptj"; do
                python3 -m interop check $options 2>&1 | tee -a "$LOGS/check.log" || status=1
            done
            summary+=("check: $(grep -cE '^ALL PASS' "$LOGS/check.log") of 5 configurations ALL PASS");;
        trust)
            FUSEDKV_HYPOTHESIS_EXAMPLES=${FUSEDKV_HYPOTHESIS_EXAMPLES:-120} bash scripts/gpu_trust.sh all 2>&1 \
                | tee "$LOGS/trust.log" | tail -45 || status=1
            summary+=("trust: $(grep -E 'passed|failed' "$LOGS/trust.log" | tail -1)");;
        bench)
            python3 -m interop bench --quick --out "$LOGS/bench" 2>"$LOGS/bench.err" | tee "$LOGS/bench.log" || status=1
            summary+=("bench: exit ${PIPESTATUS[0]}, results in $LOGS/bench");;
        host)
            python3 benchmarks/host_path.py --calls 500 2>&1 | tee "$LOGS/host.log" | sed -n '/^## summary/,$p' || status=1
            summary+=("host: $(grep -c 'NOT met' "$LOGS/host.log") of 5 host bars not met (table in $LOGS/host.log)");;
        *) echo "unknown part $part (expected tests, check, trust, bench, host)"; exit 2;;
    esac
    summary+=("  ($part took $((SECONDS - start)) s)")
done

echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $status
