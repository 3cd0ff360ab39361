"""Why the bench's backward rows move between runs (prepared in session 11, not yet run).

Bench run 25 measured, with kernels that time alone as before: softmax backward at N = 131072
0.72 (0.84 in runs 19 / 23), RMSNorm backward at 262144 0.43 (0.59), LayerNorm backward at
1024 / 8192 0.71 / 0.48 (0.83 / 0.72). The protocol times one torch.autograd.grad at a time
after an L2 flush, so the host's time from grad() to the first launch is in each sample
when it is longer than the flush. This script times exactly the bench's step for such
cases, several rounds in one process, and prints per round the median and the 10th / 90th
percentiles of do_bench's samples, in three settings, alternating:
  - bench: the step as `python -m pintail.bench` times it;
  - one thread: the same with torch.autograd.set_multithreading_enabled(False) (the backward
    on the calling thread, not the engine's worker);
  - after compile: the step right after one step of torch.compile's version of the eager
    function (compiled in round 0), as in the bench, where the pintail row of a shape
    follows the compile row of the shape before.
Predicted, if the engine's worker thread is the cause: "one thread" tight and fast in every
round, "bench" spread (a wide 10-90 band, or rounds that differ); if the compile before it
is the cause, only "after compile" slow.

    python scripts/exp_bench_spread.py [--cases softmax:bwd:131072,rms_norm:bwd:262144,...] [--rounds 3]
"""

import argparse
import gc

import torch
from triton.testing import do_bench

from pintail import bench

CASES = "softmax:bwd:131072,rms_norm:bwd:262144,layer_norm:bwd:1024,layer_norm:bwd:8192,softmax:bwd:32768"


def samples(step):
    gc.collect()
    torch.cuda.synchronize()
    times = sorted(do_bench(step, warmup=200, rep=100, return_mode="all"))
    return times[len(times) // 2], times[len(times) // 10], times[(9 * len(times)) // 10]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=CASES, help="op:direction:N,...")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=".", help="unused (device_run.sh's ab mode passes it)")
    args = p.parse_args()
    ops = bench._ops()
    copy_bw = bench._copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s")
    for case in args.cases.split(","):
        name, direction, N = case.split(":")
        op, N = ops[name], int(N)
        M = op.rows(N) if op.rows else 2**27 // N
        inputs, others = op.make(M, N, torch.bfloat16, "cuda")
        nbytes = sum(t.numel() for t in inputs) * inputs[0].element_size() * op.directions[direction]
        step = bench._step(op.pintail, direction, inputs, others)
        torch._dynamo.reset()
        compiled = torch.compile(op.torch, dynamic=False)  # compiles in round 0's "after compile"
        for round_ in range(args.rounds):
            for setting in ("bench", "one thread", "after compile"):
                if setting == "after compile":  # compile's step once (its kernels, its host work), then ours
                    bench._step(compiled, direction, [t.detach().clone() for t in inputs], others)()
                torch.autograd.set_multithreading_enabled(setting != "one thread")
                median, low, high = samples(step)
                torch.autograd.set_multithreading_enabled(True)
                print(f"{name} {direction} N={N} round {round_} {setting}: median {median:.4f} ms "
                      f"({nbytes / (median * 1e-3) / copy_bw:.2f} of copy), 10-90 % {low:.4f}-{high:.4f} ms",
                      flush=True)
        del inputs, others, step, compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
