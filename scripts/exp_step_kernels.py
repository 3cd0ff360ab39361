"""Every kernel of each bench step, by GPU time (torch.profiler), on a GPU: what a step runs
besides its main kernel (sums of partials, memsets of tickets, casts, copies) and what
each costs. Session 47 found 8 % of LayerNorm's backward at 1024 in the dweight / dbias
sum after the main kernel; this looks for the others. One line a step: the total GPU time
and each kernel's count, time and share, the main kernel first.

    python scripts/exp_step_kernels.py [--ops rms_norm,layer_norm] [--directions bwd] [--sizes 1024,4096]
"""

import argparse

import torch
from exp_host_gaps import kernels_of

from pintail import bench


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ops", default=",".join(bench.DEFAULT_OPS))
    p.add_argument("--directions", default=None)
    p.add_argument("--sizes", default=None)
    args = p.parse_args()
    ops = bench._ops()
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    for name in args.ops.split(","):
        op = ops[name]
        for direction in op.directions:
            if args.directions and direction not in args.directions.split(","):
                continue
            for N in sizes or op.sizes:
                M = op.rows(N) if op.rows else 2**27 // N
                inputs, others = op.make(M, N, torch.bfloat16, "cuda")
                with torch.autograd.set_multithreading_enabled(False):
                    kernels = kernels_of(bench._step(op.pintail, direction, inputs, others))
                total = sum(us for _, us in kernels.values())
                parts = [f"{count:.0f}x {us:.1f} us ({us / total:.0%}) {k[:44]}"
                         for k, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])]
                print(f"{name} {direction} N={N}: {total:.1f} us | " + " | ".join(parts), flush=True)
                del inputs, others
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
