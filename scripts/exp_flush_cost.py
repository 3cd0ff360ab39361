"""Experiment: what the protocol's L2 flush costs a short kernel.

BENCHMARKS.md times with triton's do_bench, which clears the L2 before each call by
zeroing a 256 MB buffer (`cache.zero_()`). That leaves the L2 full of dirty lines, and the
timed call pays for writing them back to DRAM as it evicts them: up to the L2's ~50 MB, about
12 us at 4.27 TB/s. Cross-entropy's forward at V = 32768 (M = 4096: 256 MiB read, ~66 us of
kernel) would lose ~0.15 of copy to that; at V = 262144 (2 GiB, ~520 us) ~0.02.

Prediction: under the protocol's flush a pure read of 256 MiB (torch.sum, and our forward)
measures ~0.8 of copy; with the L2 left clean before the call (a 256 MB read after the zero)
~0.95, and without a flush (back-to-back calls) the same ~0.95. If so, the 0.90 bar at
V = 32768 is out of reach for any kernel under this protocol (quack's anchor there: 0.68).

    python scripts/exp_flush_cost.py
"""

import importlib
import statistics

import torch
from measure import copy_bandwidth

import pintail

ce = importlib.import_module("pintail.cross_entropy")
flush_buffer = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
clean_buffer = torch.ones(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
sink = torch.empty((), dtype=torch.int64, device="cuda")


def protocol_flush():  # what do_bench does
    flush_buffer.zero_()


def clean_flush():  # the same, then a read of another 256 MB: the dirty lines written back before the timed call
    flush_buffer.zero_()
    torch.sum(clean_buffer, dim=0, dtype=torch.int64, out=sink)


def no_flush():
    pass


def median_ms(fn, flush, reps=200):
    """do_bench's loop (flush, event, call, event; one synchronisation at the end), medians."""
    for _ in range(20):
        flush()
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main():
    from triton.testing import do_bench
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s")
    for V in (32768, 131072, 262144):
        M = 4096
        x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, V, (M,), device="cuda")
        out = torch.empty(M, dtype=torch.float32, device="cuda")
        y = torch.empty_like(x)
        nbytes = x.numel() * 2
        steps = {
            "torch.sum (read only)": (lambda: torch.sum(x, dim=1, out=out), nbytes),
            "y.copy_(x)": (lambda: y.copy_(x), 2 * nbytes),
            "forward kernel, reduction none": (lambda: ce._launch_forward(x, t, None, -100, 0.0, 0.0, 0.0, False,
                                                                          "none"), nbytes),
            "pintail.cross_entropy unchecked": (lambda: pintail.cross_entropy(x, t, check_target=False), nbytes),
            "pintail.cross_entropy (checked)": (lambda: pintail.cross_entropy(x, t), nbytes),
            "torch cross_entropy": (lambda: torch.nn.functional.cross_entropy(x, t), nbytes),
        }
        for name, (fn, n) in steps.items():
            cells = []
            for label, flush in (("protocol", protocol_flush), ("clean", clean_flush), ("none", no_flush)):
                ms = median_ms(fn, flush)
                cells.append(f"{label} {ms * 1e3:.1f} us {n / (ms * 1e-3) / copy_bw:.3f}")
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
            cells.append(f"do_bench {ms * 1e3:.1f} us {n / (ms * 1e-3) / copy_bw:.3f}")
            print(f"V={V} {name}: " + " | ".join(cells), flush=True)
        del x, y


if __name__ == "__main__":
    main()
