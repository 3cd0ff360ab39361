"""Experiment for the next GPU session: RMSNorm's blocks backward (pintail/norm.py,
`_backward_blocks_kernel`, 0.60-0.64 of copy alone) with the wait for row r moved before
the publication of row r + 1, so that the wait's polls overlap the next row's HBM loads.

Why (session 11's model of the library's kernel): per row a program issues the loads of
row r + 1, publishes row r + 1's sum of g x^ (which needs those loads: one HBM latency,
~1 us), then polls for row r's words (an L2 round trip, ~0.5 us) and writes dx. The two
latencies add up: ~2 us a row, and 528 programs x 12 KB a row (x and dy read, dx written,
2048 bf16 elements) / ~2 us = ~3.2 TB/s, ~0.64 of copy, what the kernel measures (the
profile: 24 % occupancy, 0.38 warps issued a cycle, DRAM 61 %). Here a row's iteration
issues the loads of row r + 1, waits for row r (the polls run while the loads are in
flight), publishes row r + 1 (its loads have arrived by then) and writes dx of row r:
~max(HBM latency, polls) a row instead of their sum, with the same registers (two rows of
x and dy, as the library's). Predicted: 0.72-0.80 at N = 16384-262144.

No new deadlock: a program publishes row r + 1 only after every slice of row r has
published, and each block's first row is published before its loop, so by induction every
row of a block gets all its words while all its SLICES programs run (the library's
condition: the host keeps SLICES <= the SMs, and a program takes a new ticket only when its
block is done). What it gives up: the library's publish-before-wait gave the other slices a
whole row of slack; here a slow slice makes the others wait at every row.

    TRITON_INTERPRET=1 python scripts/exp_norm_blocks_wait_first.py --check   # the interpreter, CPU
    python scripts/exp_norm_blocks_wait_first.py --inspect                     # registers, sm_90, CPU
    python scripts/exp_norm_blocks_wait_first.py                               # GPU: check, then time
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

import exp_norm_blocks_deep as deep

norm = importlib.import_module("pintail.norm")
split = importlib.import_module("pintail._split")


@triton.jit(do_not_specialize=["SLICES"])
def wait_first_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, M, N, inv_n, SLICES, x_row_stride,
                      dy_row_stride, dx_row_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      SLICES_POW2: tl.constexpr, PUBLISH_BEFORE_DX: tl.constexpr):
    # The library's blocks kernel (RMSNorm with a weight, no bias, no residual gradient),
    # its rows in the order: load r + 1, wait for r, publish r + 1 (before or after dx of r).
    end = tl.cdiv(M, ROWS) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        block = ticket // SLICES
        slice_index = ticket % SLICES
        cols = slice_index * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        row = block * ROWS
        last = tl.minimum(row + ROWS, M)
        x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
        norm._publish_sum_gx(slots_ptr, x_raw, dy_raw, w, rstd_ptr, row, SLICES, slice_index)
        while row < last:
            next_row = row + 1
            more = next_row < last
            x_next = tl.load(x_ptr + next_row * x_row_stride + cols, mask=mask & more, other=0.0)
            dy_next = tl.load(dy_ptr + next_row * dy_row_stride + cols, mask=mask & more, other=0.0)
            _, sums_gx, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
            if PUBLISH_BEFORE_DX:
                if more:
                    norm._publish_sum_gx(slots_ptr, x_next, dy_next, w, rstd_ptr, next_row, SLICES, slice_index)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x_raw.to(tl.float32) * rstd
            dy = dy_raw.to(tl.float32)
            dx = rstd * (dy * w - x_hat * (tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n))
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            if not PUBLISH_BEFORE_DX:
                if more:
                    norm._publish_sum_gx(slots_ptr, x_next, dy_next, w, rstd_ptr, next_row, SLICES, slice_index)
            row, x_raw, dy_raw = next_row, x_next, dy_next
        tl.store(dw_ptr + block * N + cols, dw, mask=mask)
        ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")


def backward(dy, x, w, rstd, cfg):
    """(dx, dweight) of RMSNorm rows x[M, N] with a weight (float32 dweight); publishing
    before dx unless cfg says PUBLISH_BEFORE_DX False."""
    return deep.backward(dy, x, w, rstd, cfg, kernel=wait_first_kernel,
                         PUBLISH_BEFORE_DX=cfg.get("PUBLISH_BEFORE_DX", True))


def check(device):
    for before in (True, False):
        deep.check_against_library(
            f"wait-first (publish before dx: {before})",
            lambda dy, x, w, rstd, cfg: backward(dy, x, w, rstd, {**cfg, "PUBLISH_BEFORE_DX": before}), device)


# The library's slices and smaller ones (more programs, the same bytes per SM); programs per
# SM from the registers (--inspect, sm_90): 2048 / 4 warps 128 publishing before dx (4 fit),
# 158 after (3); 1024 / 4 warps 72 (7) and 80 (6).
CONFIGS = [{"ROWS": 32, "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": per_sm, "PUBLISH_BEFORE_DX": before}
           for block, per_sm, before in ((2048, 4, True), (2048, 3, False), (1024, 7, True), (1024, 6, False))]


def inspect():
    sys.path.insert(0, "scripts")
    import inspect_kernel
    signature = inspect_kernel.signature(wait_first_kernel)
    for cfg in CONFIGS:
        inspect_kernel.inspect(wait_first_kernel, signature,
                               {"ROWS": cfg["ROWS"], "BLOCK": cfg["BLOCK"], "SLICES_POW2": 16,
                                "PUBLISH_BEFORE_DX": cfg["PUBLISH_BEFORE_DX"]}, cfg["num_warps"])


def main():
    runs = {f"wait first {cfg}": (lambda dy, x, w, rstd, cfg=cfg: backward(dy, x, w, rstd, cfg)) for cfg in CONFIGS}
    deep.time_against_library(check, runs)


if __name__ == "__main__":
    from measure import experiment
    experiment(check, inspect, main)
