"""Where SHIFT starts a row's slices: the first 16-byte boundary in the row, or the first
128-byte one (a whole L2 line; cluster.window's `boundary`), for rows no vector width divides.
Session 24's Nsight Compute profile of cross-entropy's backward at V = 128257 (16-byte
boundaries) read 0.73 of DRAM bandwidth against 0.78 at 131072, with more L2 tag requests
for fewer bytes: every warp's 512-byte access straddled 5 lines and 17 sectors. Prediction:
128-byte boundaries bring the odd sizes to within 0.02 of the aligned neighbour, the
backward most (0.77-0.85 -> 0.88-0.92). Kernels alone, bf16, alternating 16 / 128 twice.

    python scripts/exp_boundary.py [--row-shift-backward]   # GPU only
"""

import argparse
import functools
import importlib

import torch

import measure

sm = importlib.import_module("pintail.softmax")
ce = importlib.import_module("pintail.cross_entropy")
cluster = importlib.import_module("pintail._cluster")


def cross_entropy_cases(V):
    M = 4096
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, V, (M,), device="cuda")
    _, stats, mass, _, denominator = ce._launch_forward(x, target, None, -100, 0.0, 0.0, 0.0, False, "mean")
    grad = torch.ones((), device="cuda", dtype=torch.bfloat16)
    return [(f"ce bwd V={V}", lambda: ce._backward(grad, x, target, None, stats, mass, -100, 0.0, 0.0, 0.0, False,
                                                   False, denominator), 2 * M * V * 2),
            (f"ce fwd V={V}", lambda: ce._launch_forward(x, target, None, -100, 0.0, 0.0, 0.0, False, "mean"),
             M * V * 2)]


def softmax_cases(N, logs=(False,), directions=("bwd", "fwd")):
    M = 2**27 // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
    cases = []
    for log in logs:
        name = "log_softmax" if log else "softmax"
        sm.launch_forward(x, y, log)  # y a real (log-)softmax for the backward
        if "bwd" in directions:
            cases.append((f"{name} bwd N={N}", lambda log=log: sm.launch_backward(y, dy, dx, log), 3 * M * N * 2))
        if "fwd" in directions:
            cases.append((f"{name} fwd N={N}", lambda log=log: sm.launch_forward(x, y, log), 2 * M * N * 2))
    return cases


def row_shift_backward_cases(N):  # session 25: bench run 46 read log_softmax's at 769 / 12289 low
    return softmax_cases(N, logs=(False, True), directions=("bwd",))


def set_boundary(boundary):
    """Every plan, both directions, from boundaries of `boundary` bytes (the cluster plans
    call cluster.window with its default)."""
    both = {"forward": boundary, "backward": boundary}
    sm.ROW_SHIFT_BOUNDARY_BYTES, ce.VOCAB_BOUNDARY_BYTES = both, dict(both)
    cluster.window = functools.partial(library_window, boundary=boundary)


library_window = cluster.window


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--row-shift-backward", action="store_true",
                   help="only softmax's and log_softmax's row-shift backward at 769-16383 (session 25)")
    args = p.parse_args()
    copy_bw = measure.copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    cases = ((cross_entropy_cases, 128257), (cross_entropy_cases, 50257), (softmax_cases, 131065),
             (softmax_cases, 12289), (softmax_cases, 4097))
    if args.row_shift_backward:
        cases = [(row_shift_backward_cases, N) for N in (769, 1001, 4097, 12289, 16383)]
    for make, size in cases:
        for name, fn, nbytes in make(size):
            for run in (1, 2):
                for boundary in (16, 128):
                    set_boundary(boundary)
                    measure.print_fraction(f"{name} boundary {boundary} run {run}", fn, nbytes, copy_bw)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
