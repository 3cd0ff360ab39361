"""The cross-entropy forward at V = 32768 (M = 4096 bf16 rows, class targets), 0.72 of copy
through do_bench and ~0.85 in the profiler against the 0.90 bar, no launch configuration
better (scripts/tune_cross_entropy.py). Where the rest goes, each timed by do_bench and by
its kernels in torch.profiler:
- the library's launch with reduction mean;
- the library's launch with reduction none;
- this file's kernel, reduction none, with the row's target and its logit loaded before the
  loop over the row's chunks instead of after it (at V = 32768 a row is four chunks, and
  the target's dependent load, a round trip, ended every row);
- the public call, mean, with and without the eager target check.

Session 5, first run (H200, copy 4.24 TB/s), when the mean was fused into the forward
(every row program counted its arrival with an acq_rel atomic, the last one reduced):
mean 0.0869 ms (0.728), kernel 74.6 us, plus a 0.7 us fill of the counters; none 0.0763 ms
(0.830), kernel 65.8 us; target prefetched 0.0764 ms (0.829), kernel 65.0 us. So the
arrival atomics cost 9 us of kernel time and the late target load nothing; the library now
reduces in a one-program kernel of its own.

    python scripts/exp_ce_forward.py
"""

import importlib

import torch
import triton
import triton.language as tl
from exp_host_gaps import kernels_of
from measure import long_rows, print_fraction

import pintail

ce = importlib.import_module("pintail.cross_entropy")


@triton.jit
def forward_kernel(x_ptr, target_ptr, loss_ptr, stats_ptr, V, x_row_stride, ignore_index, BLOCK: tl.constexpr):
    # The library's plain path (no weight, smoothing, softcap, z-loss or reduction), with the
    # target and x[target] loaded first.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    t = tl.load(target_ptr + row).to(tl.int64)
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(x_row + t, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = ce._logits(x_row, cols, cols < V, 0.0, False)
        running_max, running_sum, _, _, _ = ce._fold_chunk(x, x, running_max, running_sum, 0.0, 0.0, 0.0, False, False,
                                                           False)
    log_sum = tl.log2(running_sum) * ce.LN2
    loss = tl.where(ignored, 0.0, (running_max - x_t) + log_sum)
    tl.store(loss_ptr + row, tl.where(in_range | ignored, loss, float("nan")))
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)


def prefetched_forward(x, target):
    M, V = x.shape
    loss = torch.empty(M, dtype=torch.float32, device=x.device)
    stats = torch.empty(M, 2, dtype=torch.float32, device=x.device)
    forward_kernel[(M,)](x, target, loss, stats, V, x.stride(0), -100, BLOCK=ce._forward_block(V, 0.0, False),
                         num_warps=ce.FORWARD_WARPS)
    return loss, stats


def check(device):
    """Against the library's forward (itself tested against torch): ignored rows included."""
    x = torch.randn(37, 1000, device=device) * 4
    target = torch.randint(0, 1000, (37,), device=device)
    target[::5] = -100
    loss, stats = prefetched_forward(x, target)
    want, want_stats, _ = ce._forward(x, target, None, -100, 0.0, 0.0, 0.0, False)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats, want_stats, rtol=1e-6, atol=1e-6)
    print(f"prefetched forward matches the library's ({device})", flush=True)


def main():
    for V, _, copy_bw in long_rows(check, (32768,)):
        M = 4096
        x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, V, (M,), device="cuda")
        runs = {"library, mean": lambda: ce._launch_forward(x, target, None, -100, 0.0, 0.0, 0.0, False, "mean"),
                "library, none": lambda: ce._launch_forward(x, target, None, -100, 0.0, 0.0, 0.0, False, "none"),
                "target prefetched, none": lambda: prefetched_forward(x, target),
                "public call, checked": lambda: pintail.cross_entropy(x, target),
                "public call, unchecked": lambda: pintail.cross_entropy(x, target, check_target=False)}
        for name, fn in runs.items():
            print_fraction(name, fn, M * V * 2, copy_bw)
            for kernel, (count, gpu_us) in sorted(kernels_of(fn).items(), key=lambda kv: -kv[1][1]):
                print(f"    {count:.0f}x {gpu_us:8.1f} us ({M * V * 2 / (gpu_us * 1e-6) / copy_bw:.3f})  {kernel}",
                      flush=True)


if __name__ == "__main__":
    main()
