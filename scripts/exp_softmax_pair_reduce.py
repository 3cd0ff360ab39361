"""Experiment for the next GPU session: softmax's (max, sum of exp(x - max)) as one pair
reduction instead of a max and then a sum, in the split forward (N > 32768) and the
two-pass forward (N <= 32768).

Why: each of those reductions crosses the warps of a program through shared memory with a
barrier, and the sum cannot start before the max is known. The split forward's profile
(docs/profiles/ncu-softmax_fwd-131072-2026-11-30.txt) has its warps stalled at a CTA
barrier for 31 % of the cycles between instructions ("est. speedup 30 %"). LayerNorm's
split forward gained 0.05 of copy in session 7 when its two (independent) sums became one
tuple reduction. Here the pair (m, s) combines as the online softmax does, with one exp per
combine: (m1, s1) + (m2, s2) = (m1, s1 + s2 * 2^(m2 - m1)) when m1 >= m2, else the mirror.
Each element enters as (x, 1), or (-inf, 0) when x is -inf, so a slice of -inf gives
(-inf, 0) as the library's two reductions do. One exp per element either way.

Variants, each against the library's kernel in the same run (kernel alone, bf16, M*N =
2^27): the split forward at the library's config, N = 65536 / 131072 / 262144; the two-pass
forward at the library's config, N = 24576 / 32768; softmax and log_softmax. Predicted:
+0.02-0.05 for the split forward (one barrier round of two per ticket, less latency per
ticket); less for the two-pass (its reductions sit between chunk loads that stay in flight).
Registers (sm_90, `--inspect`): the split kernel 104 against the library's 128 at 4 warps
(4 programs per SM either way); the two-pass kernel 32 against 54 at softmax's 8 warps, so
8 programs per SM instead of 4 and twice the rows in flight, which cost log_softmax's
two-pass 0.08 in session 7: it is also timed at 16 warps (4 per SM).

    TRITON_INTERPRET=1 python scripts/exp_softmax_pair_reduce.py   # check against torch and the library, CPU
    python scripts/exp_softmax_pair_reduce.py --inspect             # registers, sm_90, CPU
    python scripts/exp_softmax_pair_reduce.py                       # GPU
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

softmax = importlib.import_module("pintail.softmax")
split = importlib.import_module("pintail._split")
LOG2E, LN2 = softmax.LOG2E, softmax.LN2  # the library's constants (exp2 / log2 scaling)


@triton.jit
def _combine(m1, s1, m2, s2):
    # Online softmax: rescale the smaller side's sum to the larger max (one exp). A side
    # whose max is -inf holds only -inf elements, whose sum is 0: it adds nothing.
    first = m1 >= m2
    big = tl.where(first, m1, m2)
    small = tl.where(first, m2, m1)
    scale = tl.exp2(tl.where(small == -float("inf"), -float("inf"), (small - big) * LOG2E))
    return big, tl.where(first, s1 + s2 * scale, s2 + s1 * scale)


@triton.jit
def _max_and_sum(x):
    """(max, sum of exp(x - max)) of a slice in one reduction. An element enters as (x, 1);
    -inf as (-inf, 0); +inf as (inf, NaN), so that its row comes out NaN as torch's does
    (x - x: 0, or NaN for an infinity)."""
    return tl.reduce((x, tl.where(x == -float("inf"), 0.0, 1.0 + (x - x))), 0, _combine)


@triton.jit
def split_forward_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG,
                         LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # The library's _forward_split_kernel with the slice's partials from _max_and_sum.
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M),
                        other=-float("inf")).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0),
                        other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            slice_max, slice_sum = _max_and_sum(x_new)
            split.publish(slots_ptr, ticket, slice_max, slice_sum)
        if done >= 0:
            maxes, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * LOG2E), 0.0), axis=0))
            if LOG:
                y = (x_old - row_max) - log2_total * LN2
            else:
                y = tl.exp2((x_old - row_max) * LOG2E - log2_total)
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


@triton.jit
def two_pass_forward_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr):
    # The library's _forward_two_pass_kernel with each chunk's partials from _max_and_sum.
    row = tl.program_id(0).to(tl.int64)
    row_max = -float("inf")
    total = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        chunk_max, chunk_sum = _max_and_sum(x)
        row_max, total = _combine(row_max, total, chunk_max, chunk_sum)
    log2_total = tl.log2(total)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if LOG:
            y = (x - row_max) - log2_total * LN2
        else:
            y = tl.exp2((x - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


def forward(x, y, log, cfg):
    """y = (log_)softmax(x) by this file's kernel for cfg's plan (the library's configs)."""
    M, N = x.shape
    if cfg["plan"] == "two_pass":
        two_pass_forward_kernel[(M,)](x, y, N, x.stride(0), y.stride(0), LOG=log, BLOCK=cfg["BLOCK"],
                                      num_warps=cfg["num_warps"])
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
        split_forward_kernel[grid](x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, LOG=log,
                                   BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices),
                                   num_warps=cfg["num_warps"])


def check(device):
    """Against float64 torch and the library: many slices / chunks a row, -inf slices and rows,
    a +inf, large values."""
    for M, N, block in ((5, 1000, 64), (3, 130, 64), (6, 64, 64), (2, 1, 64)):
        x = torch.randn(M, N, device=device) * 4
        x[0, : N // 2] = -float("inf")
        if M > 3:
            x[3] = -float("inf")
        if M > 4:
            x[4, N // 3] = float("inf")
            x[2, ::3] = 1e4
        for cfg in ({"plan": "two_pass", "BLOCK": block, "num_warps": 4},
                    {"plan": "split", "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 3, "LAG_ROUNDS": 1}):
            for log in (False, True):
                ours, library = torch.empty_like(x), torch.empty_like(x)
                forward(x, ours, log, cfg)
                softmax.launch_forward(x, library, log, cfg)
                truth = (torch.log_softmax if log else torch.softmax)(x.double(), -1).float()
                torch.testing.assert_close(ours, truth, rtol=1e-5, atol=1e-6, equal_nan=True)
                torch.testing.assert_close(ours, library, rtol=1e-5, atol=1e-6, equal_nan=True)
    print(f"pair-reduction forwards match torch and the library ({device})", flush=True)


def inspect():
    sys.path.insert(0, "scripts")
    import inspect_kernel
    for log in (False, True):
        split_cfg, two_pass_cfg = softmax.FORWARD_SPLIT, softmax.FORWARD_TWO_PASS[log]
        for fn, cfg, extra in ((split_forward_kernel, split_cfg, {"SLICES_POW2": 32}),
                               (softmax._forward_split_kernel, split_cfg, {"SLICES_POW2": 32}),
                               (two_pass_forward_kernel, two_pass_cfg, {}),
                               (softmax._forward_two_pass_kernel, two_pass_cfg, {})):
            inspect_kernel.inspect(fn, inspect_kernel.signature(fn), {"LOG": log, "BLOCK": cfg["BLOCK"], **extra},
                                   cfg["num_warps"])


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, sizes=(24576, 32768, 65536, 131072, 262144)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        for log in (False, True):
            cfg = softmax.forward_config(N, log)
            name = f"N={N} {'log_softmax' if log else 'softmax'} {cfg['plan']}"
            # the two-pass pair kernel at 8 warps takes 32 registers (softmax's library one 54):
            # 8 programs per SM, twice the rows in flight; 16 warps keeps 4 per SM
            variants = [cfg]
            if cfg["plan"] == "two_pass" and cfg["num_warps"] != 16:
                variants.append({**cfg, "num_warps": 16})
            for _ in range(2):  # alternating, twice
                print_fraction(f"{name} library", lambda: softmax.launch_forward(x, y, log, cfg), 4 * x.numel(),
                               copy_bw)
                for variant in variants:
                    print_fraction(f"{name} pair reduction, {variant['num_warps']} warps",
                                   lambda: forward(x, y, log, variant), 4 * x.numel(), copy_bw)


if __name__ == "__main__":
    if "--inspect" in sys.argv:
        inspect()
    else:
        main()
