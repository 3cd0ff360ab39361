#!/usr/bin/env bash
# One call of the device tool (600 s at most): the CUDA test suite or a part of it, the benchmark, experiments.
# Logs and results land in $OUT (the device tool brings them back).
#   bash scripts/device_run.sh tests-norm  # all of test_norm (351 s cold with 14 workers, session 36; 555 s in session 43;
#                                          # session 44: 971 of 982 done at the 560 s cut: use tests-n + tests-nc)
#   bash scripts/device_run.sh tests-rest  # every other test file (242 s cold with 14 workers): the whole suite in two calls
#   bash scripts/device_run.sh tests-a     # api, cross_entropy (~3 min)
#   bash scripts/device_run.sh tests-n     # norm without the cluster tests
#   bash scripts/device_run.sh tests-nc    # norm's cluster tests
#   bash scripts/device_run.sh tests-nk EXPR  # norm's tests that pytest -k EXPR selects  (PYTEST_TIMEOUT=s: pytest's limit, 560)
#   bash scripts/device_run.sh tests-b     # rotary, softmax, fuzz (~3-6.5 min)
#   bash scripts/device_run.sh tests-sk EXPR  # softmax's tests that pytest -k EXPR selects
#   bash scripts/device_run.sh bench [bench options, e.g. --ops cross_entropy]   (~3 min)
#   bash scripts/device_run.sh experiments [i ...] # steps i (from 0), or all: the next steps of docs/perf-notes.md:
#                                                  # compile's kernels at RMSNorm / LayerNorm 32768 and rotary;
#                                                  # the rotary sweep (~2 min); the bench's spread (exp_bench_spread.py);
#                                                  # RMSNorm's blocks backward waiting before it publishes;
#                                                  # the same with x and dy through TMA, rows ahead in shared memory;
#                                                  # softmax's split forward with warp-local partials (step 5);
#                                                  # the norms' long forward at 32 warps (step 6, session 13);
#                                                  # softmax's / log_softmax's two-pass forward at 16-32 warps (steps 7, 8);
#                                                  # RMSNorm's backward sweep with the blocks plan at 8-16 warps (step 9);
#                                                  # softmax's forward with the row held as packed words (step 10);
#                                                  # the norms across a thread-block cluster, with and without the next
#                                                  # row loaded ahead (step 11, sessions 15-16);
#                                                  # softmax's cluster forward: one block reduction a row (12),
#                                                  # log_softmax's held to 96 registers (13), pipelined at 262144 (14);
#                                                  # one row a cluster on a grid of M clusters (15, session 16);
#                                                  # float32's cluster plans against the split ones (16);
#                                                  # the forward across a cluster at 32768 (17, session 17);
#                                                  # the norms' backward across a cluster, the library's (18, 19),
                                                 # past 32768 (20 RMSNorm, 21 LayerNorm; session 19, prepared);
                                                 # softmax's one-row forward over k rows a cluster (22, session 19: lost)
                                                 # softmax's forward past 131072: slices of 32768 or 16384 against
                                                 # the fill and the clusters that fit (23, session 22; run in 23)
                                                 # the row-shift plan (odd rows one a program, 1-D ends)
                                                 # against the rows plan per warps (24, sessions 23-24);
                                                 # cross-entropy's odd vocabularies from 16-byte
                                                 # boundaries, off / on (25, run in session 24);
                                                 # SHIFT from 16- or 128-byte boundaries (26, session 24; run in 25)
                                                 # RMSNorm / LayerNorm at hidden sizes no power of two
                                                 # (2560-6144) with chunks that fill the row (27, 28; session 25);
                                                 # softmax there, the two-pass forward in such chunks (29);
                                                 # softmax over short odd rows as flat 16-byte spans (30)
                                                 # cross-entropy's forward with weights and smoothing, rows
                                                 # sharing each weight chunk (31, session 26); every option (32); weights alone (33);
                                                 # the softcap forward about c, no running max (34)
                                                 # softmax's one-row forward as words with the late wait (35, session 29)
#   bash scripts/device_run.sh ab DIR SCRIPT [args] # A/B: a tune script (its --out set to /tmp) twice each, alternating,
#                                                  # with PYTHONPATH=DIR (made here by `git archive REF pintail | tar -x -C DIR`;
#                                                  # ab_dir is git-ignored: name it in the device call's carry)
#                                                  # and the tree; prints the lines with the default config
#   bash scripts/device_run.sh profile ["case N" ...] # ncu on one launch of each long-row plan (~1.5 min),
#                                                  # or of the cases given (scripts/profile_kernel.py)
#   bash scripts/device_run.sh profile-source ["case N" ...] # ncu's warp-stall samples per SASS instruction:
#                                                  # RMSNorm blocks backward, rotary, softmax split forward, or the
#                                                  # cases given (scripts/top_stalls.py)
#   bash scripts/device_run.sh sanitize           # compute-sanitizer memcheck on the cross-program plans' tests (~1.2 min)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
# The image has no pytest-xdist and reaches no package index: its wheels (pure Python) go in
# device-wheels/ (git-ignored; here: `pip download --no-deps -d device-wheels pytest-xdist==3.8.0
# execnet==2.1.2`), named in the device call's carry, and are imported from the zips. The
# tests then run in 14 processes (the machine has 16 cores): their Triton compiles are most of
# a cold run's time. With 8 the whole suite ran past 540 s (session 33: 98 % done; norm's
# cluster tests at 32768 take 16-25 s each), hence a call a part; each part's log its own.
# One line a failure (--tb=line): in session 42 a cold tests-norm with 45 failures ran into the
# timeout while it printed their tracebacks, and the log lost its summary.
wheels=$(ls device-wheels/*.whl 2>/dev/null | tr '\n' ':')
workers=()
if [ -n "$wheels" ]; then
    PYTHONPATH=$PYTHONPATH:${wheels%:}
    workers=(-n 14 --dist worksteal)
fi
OUT=${OUT:-device-out}
mkdir -p "$OUT"
mode=$1
shift
pytest_cuda() {
    # -v: a line a test as it ends, so a run cut by the timeout still says which tests ran
    timeout "${PYTEST_TIMEOUT:-560}" python3 -m pytest "$@" "${workers[@]}" --device cuda -o addopts="" -v --tb=line -rf -p no:cacheprovider -p no:warnings \
        > "$OUT/$mode.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$mode.log" | tail -20
}
case $mode in
    tests-norm) pytest_cuda tests/test_norm.py ;;
    tests-rest) pytest_cuda tests/test_api.py tests/test_cross_entropy.py tests/test_softmax.py tests/test_rotary.py \
        tests/test_fuzz.py ;;
    tests-a) pytest_cuda tests/test_api.py tests/test_cross_entropy.py ;;
    tests-n) pytest_cuda tests/test_norm.py -k "not cluster" ;;
    tests-nc) pytest_cuda tests/test_norm.py -k cluster ;;
    tests-nk) pytest_cuda tests/test_norm.py -k "$1" ;;
    tests-b) pytest_cuda tests/test_rotary.py tests/test_softmax.py tests/test_fuzz.py ;;
    tests-sk) pytest_cuda tests/test_softmax.py -k "$1" ;;
    bench)
        timeout 540 python3 -m pintail.bench --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
        grep -E "^\|" "$OUT/bench.log" ;;
    experiments)  # each step's log in $OUT; the lines that do not start with a space printed
        steps=("exp_compile_kernels.py --out $OUT --cases rms:32768,layer:32768,rotary:4096"
               "tune_rotary.py" "exp_bench_spread.py" "exp_norm_blocks_wait_first.py" "exp_norm_blocks_tma.py"
               "exp_softmax_warp_partials.py" "exp_norm_long_warps.py"
               "tune_softmax.py --directions fwd --sizes 24576,32768,49152,65536 --out /tmp"
               "tune_softmax.py --log --directions fwd --sizes 32768,65536 --out /tmp"
               "tune_norm.py --directions bwd --sizes 32768,131072,262144 --out /tmp"
               "exp_softmax_packed.py" "exp_norm_cluster.py"
               "exp_softmax_cluster.py --form two-level --sizes 65536,131072"
               "exp_softmax_cluster.py --form log-maxnreg --sizes 98304,131072"
               "exp_softmax_cluster.py --form stages --sizes 262144"
               "exp_softmax_cluster.py --form one-shot-mbar --sizes 32768,65536,131072,262144"
               "tune_softmax.py --dtype fp32 --sizes 65536,131072,262144 --plans cluster,split,own_row --out /tmp"
               "tune_softmax.py --directions fwd --sizes 32768 --plans cluster,two_pass --out /tmp"
               "tune_norm.py --directions bwd --sizes 12288,16384,24576,32768 --out /tmp"
               "tune_norm.py --layer --directions bwd --sizes 12288,16384,24576,32768 --out /tmp"
               "tune_norm.py --directions bwd --sizes 65536,131072,262144 --out /tmp"
               "tune_norm.py --layer --directions bwd --sizes 65536,131072,262144 --out /tmp"
               "exp_softmax_cluster.py --form rounds --sizes 131072,262144"
               "exp_softmax_fill.py" "exp_softmax_rows_shift.py --sizes 129,257,385,513,769,1001,4097,12289,16383"
               "tune_cross_entropy.py --odd-vocab-shift --sizes 32001,50257,128257,151937,256001"
               "exp_boundary.py"
               "tune_norm.py --sizes 2560,3072,5120,6144 --out /tmp"
               "tune_norm.py --layer --sizes 2560,3072,5120,6144 --out /tmp"
               "tune_softmax.py --sizes 2560,3072,5120,6144,12288 --out /tmp"
               "exp_softmax_flat_rows.py"
               "exp_ce_weighted_rows.py"
               "tune_cross_entropy.py --default-only --options all --sizes 32768,50257,131072,262144 --out /tmp"
               "tune_cross_entropy.py --default-only --options weight --sizes 32768,50257,131072,262144 --out /tmp"
               "exp_ce_softcap_fixed_shift.py"
               "exp_softmax_cluster.py --form one-row-packed-late --sizes 65536,131072,262144")
        picked=("$@"); [ ${#picked[@]} -eq 0 ] && picked=("${!steps[@]}")  # step numbers, or all
        for i in "${picked[@]}"; do
            timeout 250 python3 scripts/${steps[$i]} > "$OUT/step$i.log" 2>&1
            echo "== ${steps[$i]} (exit $?)"; grep -v "^ " "$OUT/step$i.log" | tail -120
        done ;;
    ab)
        dir=$1; shift
        for run in 1 2; do
            for side in "$dir" "$PWD"; do
                PYTHONPATH=$side:$PWD/scripts timeout 120 python3 "scripts/$1" "${@:2}" --out /tmp > /tmp/ab.log 2>&1
                echo "== ${side#$PWD/} run $run (exit $?)"; grep "(default)" /tmp/ab.log
            done
        done ;;
    profile)  # Nsight Compute on one launch per case (scripts/profile_kernel.py); reports in $OUT
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        # MemoryWorkloadAnalysis_Tables: L2 requests by kind (loads, stores, atomics), for what
        # the split plans spend the L2 on beside the two-pass softmax (docs/perf-notes.md)
        sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
                  --section WarpStateStats --section SchedulerStats --section LaunchStats"
        if "$ncu" --list-sections 2>/dev/null | grep -q MemoryWorkloadAnalysis_Tables; then
            sections="$sections --section MemoryWorkloadAnalysis_Tables"
        fi
        cases=("$@")  # "case N" pairs, or the list below
        [ ${#cases[@]} -eq 0 ] && cases=("softmax_fwd 32768" "softmax_fwd_split 32768" "softmax_fwd 131072"
            "softmax_bwd 131072" "rms_fwd 32768" "rms_fwd 131072" "layer_fwd 131072" "rms_bwd 32768"
            "layer_bwd 32768" "cross_entropy_fwd 32768")
        for case in "${cases[@]}"; do
            set -- $case
            # one report file in all: only ~8-10 files come back from a call
            timeout 100 "$ncu" --clock-control none --profile-from-start off --print-details all $sections \
                python3 scripts/profile_kernel.py "$1" "$2" > /tmp/ncu.txt 2>&1
            echo "== $1 $2 (exit $?)"
            (echo "==== $1 $2"; cat /tmp/ncu.txt) >> "$OUT/ncu-reports.txt"
            grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit Rate|L2 Hit Rate|Achieved Occupancy|Registers Per|Issued Warp|No Eligible" \
                /tmp/ncu.txt | head -24
        done ;;
    profile-source)  # warp-stall samples per SASS instruction (scripts/top_stalls.py); raw CSVs in $OUT
        ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        cases=("$@")  # "case N" pairs, or the list below
        [ ${#cases[@]} -eq 0 ] && cases=("rms_bwd 131072" "rotary_fwd 4096" "softmax_fwd 131072")
        for case in "${cases[@]}"; do
            set -- $case
            timeout 150 "$ncu" --clock-control none --profile-from-start off --section SourceCounters \
                --section WarpStateStats --import-source yes -f -o /tmp/source \
                python3 scripts/profile_kernel.py "$1" "$2" > /tmp/ncu.txt 2>&1
            echo "== $1 $2 (exit $?)"; grep -E "ERR|rror" /tmp/ncu.txt | head -5
            "$ncu" -i /tmp/source.ncu-rep --page source --csv --print-source sass > "$OUT/source-$1-$2.csv" 2>&1
            python3 scripts/top_stalls.py "$OUT/source-$1-$2.csv" --top 25
        done ;;
    sanitize)  # compute-sanitizer memcheck over the tests of the cross-program plans and the two-tile rows (small shapes)
        timeout 560 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest tests/test_norm.py \
            tests/test_softmax.py --device cuda -o addopts="" -q -p no:cacheprovider -p no:warnings \
            -k "blocks or split or own_row or small_slices or falls_back or two_tiles" > "$OUT/sanitize.log" 2>&1
        echo "exit $?"; grep -E "ERROR SUMMARY|Invalid|passed|failed" "$OUT/sanitize.log" | tail -20 ;;
    *) echo "usage: bash scripts/device_run.sh tests-norm | tests-rest | tests-a | tests-n | tests-nc | tests-b | bench [bench options] | experiments" \
            "| ab DIR SCRIPT [args] | profile | profile-source | sanitize"; exit 2 ;;
esac
