#!/usr/bin/env bash
# The trust run on a GPU machine, from the tree, nothing installed:
#   bash scripts/gpu_trust.sh [all|trust|properties] [gpu_trust.py options, e.g. --tiny]
# trust: scripts/gpu_trust.py (10,000 calls per entry point with memory readings, then
# threads; table last). properties: tests/test_properties.py under the `gpu` hypothesis
# profile (FUSEDKV_HYPOTHESIS_EXAMPLES overrides its examples per test). all (default)
# runs both; each part also runs alone, for a machine that limits a command's time.
# Full logs go to $OUT when it is set, else /tmp/fusedkv-gpu.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# torch and jax share the GPU in one process: stop XLA from taking 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOGS=${OUT:-/tmp/fusedkv-gpu}
mkdir -p "$LOGS"
PART=${1:-all}
case "$PART" in
    all|trust|properties) shift $(( $# > 0 ? 1 : 0 ));;
    *) echo "usage: bash scripts/gpu_trust.sh [all|trust|properties] [gpu_trust.py options]"; exit 2;;
esac

status=0
if [ "$PART" != properties ]; then
    python3 scripts/gpu_trust.py "$@" 2>&1 | tee "$LOGS/gpu_trust.log" || status=1
fi
if [ "$PART" != trust ]; then
    # One worker per property test (two properties x two backends), each compiling its own kernels.
    FUSEDKV_HYPOTHESIS_PROFILE=gpu python3 -m pytest -q -n 4 -p no:cacheprovider \
        tests/test_properties.py 2>&1 | tee "$LOGS/properties.log" | tail -40 || status=1
fi

echo "== summary =="
[ "$PART" != properties ] && tail -1 "$LOGS/gpu_trust.log"
[ "$PART" != trust ] && tail -1 "$LOGS/properties.log"
exit $status
