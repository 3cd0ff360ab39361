#!/usr/bin/env bash
# One call of the device tool (600 s at most): half the CUDA test suite, or the benchmark.
# Logs and results land in $OUT (the device tool brings them back).
#   bash scripts/device_run.sh tests-a     # api, cross_entropy, norm (~5 min)
#   bash scripts/device_run.sh tests-b     # rotary, softmax, fuzz (~2.5 min)
#   bash scripts/device_run.sh bench [bench options, e.g. --ops cross_entropy]   (~3.5 min)
#   bash scripts/device_run.sh experiments        # prepared experiments of docs/perf-notes.md: host time,
#                                                 # two-pass long rows (~5 min)
#   bash scripts/device_run.sh experiments-norm   # the norm backward's blocks variants (~4 min)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-device-out}
mkdir -p "$OUT"
mode=$1
shift
pytest_cuda() {
    timeout 540 python3 -m pytest "$@" --device cuda -o addopts="" -q -rf -p no:cacheprovider -p no:warnings \
        > "$OUT/tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -20
}
case $mode in
    tests-a) pytest_cuda tests/test_api.py tests/test_cross_entropy.py tests/test_norm.py ;;
    tests-b) pytest_cuda tests/test_rotary.py tests/test_softmax.py tests/test_fuzz.py ;;
    bench)
        timeout 540 python3 -m pintail.bench --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
        grep -E "^\|" "$OUT/bench.log" ;;
    experiments | experiments-norm)
        scripts="exp_kept_slots exp_ce_check_host exp_backward_timeline exp_two_pass_eviction"
        [ "$mode" = experiments-norm ] && scripts="exp_norm_blocks_deep exp_norm_blocks_backward"
        for script in $scripts; do
            timeout 250 python3 scripts/$script.py > "$OUT/$script.log" 2>&1
            echo "== $script (exit $?)"; grep -v "^ " "$OUT/$script.log" | tail -60
        done ;;
    *) echo "usage: bash scripts/device_run.sh tests-a | tests-b | bench [bench options] | experiments[-norm]"; exit 2 ;;
esac
