#!/usr/bin/env bash
# Everything a GPU machine must show, run from the tree with nothing installed:
#   bash scripts/gpu_suite.sh [PART ...]      PART: tests, check, trust, bench[:TOKENS], host (default: all five)
# tests: the pytest suite on the GPU (property tests with their CI examples);
# check: `fusedkv check` on nine configurations, three with the gradients (--grad), three with
#        the jax kernel on Mosaic GPU (--lowering mosaic_gpu, one of them gptj);
# trust: scripts/gpu_trust.sh (many calls per entry point, memory, threads, then the
#        property tests with the GPU's examples);
# bench: `fusedkv bench --quick`: tables, CSV, JSON, plots and the tables as markdown;
#        bench:16,256 runs it at those token counts alone, so that it can run in parts;
# host:  `fusedkv bench --host`: every eager entry point's host cost against Triton's own launch.
# Logs go to $OUT when it is set, else /tmp/fusedkv-gpu; a summary comes last.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# torch and jax share the GPU in one process: stop XLA from taking 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-/tmp/fusedkv-gpu}
mkdir -p "$LOGS"
PARTS=${*:-tests check trust bench host}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$LOGS/device.txt"
python3 -m interop info 2>&1 | tee -a "$LOGS/device.txt"

# `fusedkv bench` with these options, its files under $LOGS/NAME.
bench() {
    local name=$1
    shift
    python3 -m interop bench "$@" --out "$LOGS/$name" --markdown "$LOGS/$name/$name.md" \
        2>"$LOGS/$name.err" | tee "$LOGS/$name.log"
    return "${PIPESTATUS[0]}"
}

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
            configurations=("--grad" "--rotary-dim 64" "--head-dim 256 --rotary-dim 256" "--dtype float16"
                            "--rope-style gptj" "--grad --tables 2 --no-k-norm --v-multiplier --table-dtype bfloat16"
                            "--lowering mosaic_gpu --grad" "--lowering mosaic_gpu --tables 2 --no-k-norm --v-multiplier"
                            "--lowering mosaic_gpu --rope-style gptj --rotary-dim 64")
            for options in "${configurations[@]}"; do
                python3 -m interop check $options 2>&1 | tee -a "$LOGS/check.log" || status=1
            done
            summary+=("check: $(grep -cE '^ALL PASS' "$LOGS/check.log") of ${#configurations[@]} configurations ALL PASS");;
        trust)
            FUSEDKV_HYPOTHESIS_EXAMPLES=${FUSEDKV_HYPOTHESIS_EXAMPLES:-120} bash scripts/gpu_trust.sh all 2>&1 \
                | tee "$LOGS/trust.log" | tail -45 || status=1
            summary+=("trust: $(grep -E 'passed|failed' "$LOGS/trust.log" | tail -1)");;
        bench|bench:*)
            tokens=${part#bench}
            tokens=${tokens#:}
            name=bench${tokens:+-${tokens//,/-}}
            bench "$name" --quick ${tokens:+--tokens "$tokens"}; code=$?
            [ "$code" = 0 ] || status=1
            summary+=("$part: exit $code, tables in $LOGS/$name/$name.md");;
        host)
            bench host --host; code=$?
            [ "$code" = 0 ] || status=1
            summary+=("host: exit $code, table in $LOGS/host/host.md");;
        *) echo "unknown part $part (expected tests, check, trust, bench[:TOKENS], host)"; exit 2;;
    esac
    summary+=("  ($part took $((SECONDS - start)) s)")
done

echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $status
