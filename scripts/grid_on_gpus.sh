#!/usr/bin/env bash
# The shape grid (`fusedkv bench --shape grid`) split over the host's GPUs, one part a GPU, all
# parts at once, then one report of every part's rows (`fusedkv bench --from-json`):
#   bash scripts/grid_on_gpus.sh [CONFIGS [BENCH OPTION ...]]
# CONFIGS: grid numbers and ranges, such as 0-39 (the default) or 1,3,5-9, dealt to the GPUs in
# turn; the bench options go to every part (default: --only triton,pallas,torch-copy,xla-copy).
# A configuration's rows, its copies included, are all timed on one GPU, and no GPU runs two
# parts, so each row is read against a copy of its own device. FUSEDKV_GPUS caps the GPUs used.
# Files go to $OUT/grid when OUT is set, else /tmp/fusedkv-grid: part N's under part-N/ (its log
# part-N.log), the report's tables, heatmaps and grid.md in the folder itself.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# torch and jax share each GPU in one process: stop XLA from taking 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
CONFIGS=${1:-0-39}
shift $(( $# > 0 ? 1 : 0 ))
OPTIONS=("$@")
[ ${#OPTIONS[@]} -gt 0 ] || OPTIONS=(--only triton,pallas,torch-copy,xla-copy)
DIR=${OUT:+$OUT/grid}
DIR=${DIR:-/tmp/fusedkv-grid}
mkdir -p "$DIR"

numbers=()
for word in ${CONFIGS//,/ }; do
    if [[ $word =~ ^([0-9]+)-([0-9]+)$ ]]; then
        numbers+=($(seq "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"))
    elif [[ $word =~ ^[0-9]+$ ]]; then
        numbers+=("$word")
    else
        echo "grid_on_gpus.sh: CONFIGS: expected numbers and ranges such as 0-39 or 1,3,5-9, got '$word'" >&2
        exit 2
    fi
done
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
gpus=$(( gpus < ${FUSEDKV_GPUS:-$gpus} ? gpus : ${FUSEDKV_GPUS:-$gpus} ))
gpus=$(( gpus < ${#numbers[@]} ? gpus : ${#numbers[@]} ))
if [ "$gpus" -lt 1 ]; then
    echo "grid_on_gpus.sh: nvidia-smi lists no GPU here" >&2
    exit 2
fi

parts=()
for (( part = 0; part < gpus; part++ )); do
    mine=()
    for (( i = part; i < ${#numbers[@]}; i += gpus )); do mine+=("${numbers[i]}"); done
    list=$(IFS=,; echo "${mine[*]}")
    echo "part $part on GPU $part: configurations $list"
    CUDA_VISIBLE_DEVICES=$part python3 -m interop bench --shape grid --configs "$list" "${OPTIONS[@]}" \
        --out "$DIR/part-$part" --markdown "$DIR/part-$part/part-$part.md" > "$DIR/part-$part.log" 2>&1 &
    parts+=("$!")
done
status=0
for (( part = 0; part < gpus; part++ )); do
    wait "${parts[part]}" || { echo "part $part failed: $DIR/part-$part.log" >&2; status=1; }
done
jsons=$(for (( part = 0; part < gpus; part++ )); do
    [ -f "$DIR/part-$part/bench.json" ] && echo "$DIR/part-$part/bench.json"; done | paste -sd,)
[ -n "$jsons" ] || { echo "grid_on_gpus.sh: no part wrote its rows" >&2; exit 1; }
python3 -m interop bench --from-json "$jsons" --out "$DIR" --markdown "$DIR/grid.md" || status=1
exit $status
