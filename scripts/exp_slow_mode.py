"""The slow mode at 262144 (session 50, prepared; run in 51): softmax / log_softmax over 512 x
262144 bf16 sometimes measured 0.46-0.82 of copy where they otherwise read 0.90-0.92, in
main's code too, most often log_softmax or a machine's first run. Here both ops are timed
as the bench times them (do_bench, L2 flushed, median) 24 times in turn, each with its
spread, while nvidia-smi logs the SM clock, power and throttle reasons every 250 ms: a slow
trial beside a low clock or a power cap points at the GPU's clocks; one at full clock points
at the launch. Then the clusters and side rows one call at a time with every CTA's start and
end stamped (`exp_side_rows_timeline.py`), 40 calls an op: in a slow call, clusters that
start late (a cluster not placed with the others) or end late all together (the clock).
Run in session 51: one slow trial of 48 (softmax, median 180.7 us against 140.4), at 1980 MHz
with no throttle reason; the 80 stamped calls all in step (docs/perf-notes.md).

    PYTHONPATH=.:scripts python scripts/exp_slow_mode.py --out $OUT   # on the GPU (smi.csv into --out)
"""

import argparse
import collections
import subprocess
import time

import torch
from triton.testing import do_bench

import pintail
import exp_side_rows_timeline as timeline

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--trials", type=int, default=24)
    args = p.parse_args()
    smi_path = f"{args.out}/smi.csv"
    with open(smi_path, "w") as log:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "250"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        x = torch.randn(512, 262144, device="cuda", dtype=torch.bfloat16) * 3
        t0 = time.time()
        for _ in range(args.trials):
            for name, fn in (("softmax", pintail.softmax), ("log_softmax", pintail.log_softmax)):
                times = sorted(do_bench(lambda: fn(x, -1), warmup=50, rep=50, return_mode="all"))
                pick = lambda q: times[min(int(len(times) * q), len(times) - 1)] * 1e3
                print(f"t={time.time() - t0:.1f} s {name}: median {pick(0.5):.1f} us, min {pick(0):.1f}, "
                      f"p90 {pick(0.9):.1f}, max {pick(1):.1f}", flush=True)
        flush = torch.empty(2**28, dtype=torch.int8, device="cuda")
        for log in (False, True):
            for trial in range(40):  # the library's side rows at 512 x 262144: 17
                flush.zero_()
                print(f"t={time.time() - t0:.1f} s log={log} stamped: {timeline.run(x, 17, 8192, 8, log=log)}",
                      flush=True)
    finally:
        smi.terminate()
        smi.wait()
    # the clock states seen, most common first (SM MHz, memory MHz, watts, degrees, throttle reasons)
    with open(smi_path) as log:
        states = collections.Counter(tuple(f.strip() for f in line.split(",")[1:]) for line in log if "," in line)
    for state, count in states.most_common(12):
        print(count, *state)


if __name__ == "__main__":
    main()
