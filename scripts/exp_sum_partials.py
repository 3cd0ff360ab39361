"""Experiment (session 47): what the norms' backward pays for dweight / dbias after its main
kernel, and whether the sum over the partial rows can cost less.

The backward ends with _sum_partials_kernel: the float32 partial rows (one a persistent
program or cluster: 528 at LayerNorm's 1024, 4 programs an SM) summed by columns in a
fixed order. At N = 1024 it runs cdiv(1024, 16) = 64 programs of 16 columns, each a loop of
17 steps of 32 partials: a chain of L2 round trips on half the SMs. LayerNorm's backward
at 1024 reads 0.84 of copy (0.227 ms), its bar 0.85: 2.5 us is 0.01 there.

1. Per kernel GPU time of the library's backward (torch.profiler), bf16, M * N = 2^27:
   the main kernel and the sum, for LayerNorm (weight and bias) and RMSNorm (weight).
2. The sum kernel alone on the same partial shapes (its partials in L2, as just written),
   its GPU time by the profiler, at launch configs (PARTS_BLOCK, BLOCK_N, warps) around the
   library's.

Predicted: the sum is 5-12 us at 1024-8192 (2-5 % of the step), and more partials a step
(fewer trips) or more programs cut it by half or more. Session 47 measured 1024-32768 (in
docs/perf-notes.md) and took one step of all the partials past 32 of them. Past 32768 the
sum took 7.5-13.4 us (LayerNorm 131072 / 262144, RMSNorm 262144: scripts/exp_step_kernels.py)
for 4-30 partial rows, each step of 32 mostly masked at 4-16; the last variants are for it.

    python scripts/exp_sum_partials.py [sizes, e.g. 131072,262144]
"""

import importlib

import torch
from exp_host_gaps import kernels_of
from measure import norm_backward_inputs

norm = importlib.import_module("pintail.norm")
launch_module = importlib.import_module("pintail._launch")

# (partials a step, columns a program, warps); the last five for the long rows' few partials
# (4 at LayerNorm's 262144, 16 at RMSNorm's), where a step of 32 is mostly masked
VARIANTS = [(32, 16, 4), (128, 16, 4), (256, 16, 8), (512, 16, 8), (1024, 16, 8), (1024, 16, 16), (256, 8, 4),
            (512, 8, 8), (1024, 8, 8), (128, 32, 8), (256, 32, 8), (512, 32, 16),
            (32, 128, 4), (4, 1024, 4), (8, 512, 4), (16, 256, 4), (32, 256, 8)]


def sum_variant(dw_parts, db_parts, dw, db, parts_block, block_n, warps):
    N = dw_parts.shape[1]
    launch_module.launch(norm._sum_partials_kernel, (launch_module.cdiv(N, block_n),), dw_parts,
                         db_parts if db_parts is not None else dw_parts, dw, db if db is not None else dw,
                         dw_parts.shape[0], N, HAS_WEIGHT=True, HAS_BIAS=db_parts is not None,
                         PARTS_BLOCK=parts_block, BLOCK_N=block_n, num_warps=warps)


def gpu_us(fn):
    """The sum kernel's GPU time (torch.profiler): timed back to back from the host, the
    launches (~20 us of host time each) would hide it."""
    return sum(us for _, us in kernels_of(fn, calls=10).values())


def main(sizes):
    for N in sizes:
        for rms in (False, True):
            x, w, b, dy, mean, rstd = norm_backward_inputs(norm, N, rms)
            shapes = []
            library_sum = norm._sum_partials

            def spy(dw_parts, db_parts, *rest):
                shapes.append(tuple(dw_parts.shape))
                return library_sum(dw_parts, db_parts, *rest)

            norm._sum_partials = spy
            cfg = norm.backward_config(N, rms, clusters=True)
            step = lambda: norm._backward(dy, None, x, w, not rms, mean, rstd, 0.0, rms, x.dtype, cfg)
            kernels = kernels_of(step)
            norm._sum_partials = library_sum
            name = "rms" if rms else "layer"
            total = sum(us for _, us in kernels.values())
            print(f"{name} N={N} {cfg['plan']} partials {shapes[0]}: {total:.1f} us of GPU time", flush=True)
            for k, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                print(f"    {count:.0f}x {us:8.1f} us ({us / total:.1%})  {k}", flush=True)
            dw_parts = torch.randn(shapes[0], device="cuda")
            db_parts = None if rms else torch.randn(shapes[0], device="cuda")
            dw = torch.empty(N, device="cuda", dtype=torch.bfloat16)
            db = None if rms else torch.empty(N, device="cuda", dtype=torch.bfloat16)
            want = dw_parts.double().sum(0)
            for variant in VARIANTS:
                sum_variant(dw_parts, db_parts, dw, db, *variant)
                torch.testing.assert_close(dw.double(), want.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
                us = gpu_us(lambda: sum_variant(dw_parts, db_parts, dw, db, *variant))
                cfg = norm._sum_partials_config(shapes[0][0], N)
                library = (cfg["PARTS_BLOCK"], cfg["BLOCK_N"], cfg["num_warps"])
                mark = " (library)" if variant == library else ""
                print(f"    sum alone PARTS_BLOCK / BLOCK_N / warps {variant}: {us:.1f} us{mark}", flush=True)
            del x, dy, dw_parts, db_parts
            torch.cuda.empty_cache()


if __name__ == "__main__":
    import sys
    main([int(n) for n in sys.argv[1].split(",")] if len(sys.argv) > 1 else (1024, 4096, 8192, 32768, 131072, 262144))
