#!/usr/bin/env bash
# One call of the device tool: the test suite compiled on the GPU, then the benchmark.
# Logs and results land in $OUT (the device tool brings them back).
#   bash scripts/device_run.sh [bench options, e.g. --ops cross_entropy]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-device-out}
mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests --device cuda -o addopts="" -q -rf -p no:cacheprovider \
    -p no:logging > "$OUT/tests.log" 2>&1
timeout "${BENCH_TIMEOUT:-330}" python3 -m pintail.bench --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -20
grep -E "^\|" "$OUT/bench.log"
