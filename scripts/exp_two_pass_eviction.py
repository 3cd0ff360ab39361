"""Experiment for the next GPU session: one program per row, two passes over the row (the
statistics, then the output), with L2 eviction hints, for softmax, RMSNorm and LayerNorm
forward at N = 32768-131072 (bf16, M*N = 2^27).

Why: at N = 32768 torch.compile reaches 0.94-0.95 of copy on RMSNorm forward (our long
plan: 0.85; softmax's split plan: 0.79, LayerNorm's rows plan 0.77). Its generated kernel
is this two-pass loop with the first pass's loads marked evict_last and the second pass's
evict_first: the row read first stays in L2 for its second read, and the second read makes
room. Our two-pass kernels had no hints (the softmax probe of session 1, exp_long_rows.py:
0.82 / 0.61 / 0.60 at 32768 / 131072 / 262144, where the second pass missed L2 past 32768;
the library's norm long forward: 0.85 at 32768). RMSNorm's first pass here also sums x^2
per lane (one tl.sum after the loop, not one per chunk), as the compiler's kernel does.

Per op and N: the library's default, then each (BLOCK, warps) with and without the hints,
as fractions of the copy bandwidth of the same run (kernels launched directly, do_bench
median, L2 flushed before each call). Predicted: +0.05-0.1 at 32768 with the hints (at least
RMSNorm's 0.85 -> 0.9+, softmax 0.79-0.82 -> 0.9); at 131072 a row is 256 KB and ~528 rows
in flight are 135 MB, more than L2: no gain expected there unless fewer programs per SM run.
If the hints win at 32768, carry them into pintail/norm.py's long forward and give softmax a
two-pass plan up to where it stops winning (the split plan beyond). Also timed: the
library's split forward (softmax) with the new slice read evict_last and the lagged slice,
re-read from L2, evict_first (predicted: a few hundredths if the lagged re-reads miss L2
now and then; nothing if they never do).

    TRITON_INTERPRET=1 python scripts/exp_two_pass_eviction.py --check   # the interpreter, CPU
    python scripts/exp_two_pass_eviction.py                              # GPU
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")
softmax_module = importlib.import_module("pintail.softmax")
split = importlib.import_module("pintail._split")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def softmax_two_pass_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, FIRST: tl.constexpr, SECOND: tl.constexpr,
                            BLOCK: tl.constexpr):
    # Pass 1: (max, sum of exp(x - max)) with one exp per element (a scalar max per chunk).
    # Pass 2: y = exp(x - max) / sum. FIRST / SECOND: the eviction hints of each pass's loads.
    row = tl.program_id(0).to(tl.int64)
    m = -float("inf")
    s = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=-float("inf"),
                    eviction_policy=FIRST).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp2((m - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), axis=0)
        m = new_m
    log2_s = tl.log2(s)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0, eviction_policy=SECOND).to(tl.float32)
        y = tl.exp2((x - m) * LOG2E - log2_s)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def rms_two_pass_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, inv_n, eps, x_row_stride, y_row_stride,
                        FIRST: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr):
    # Pass 1: sum of x^2 per lane, reduced once after the loop. Pass 2: y = x * rstd * w.
    row = tl.program_id(0).to(tl.int64)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0, eviction_policy=FIRST).to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) * inv_n + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0, eviction_policy=SECOND).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def layer_two_pass_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, inv_n, eps, x_row_stride, y_row_stride,
                          FIRST: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr):
    # LayerNorm as rms_two_pass_kernel: pass 1 sums s and s^2 per lane, s = x - the row's
    # first value (the library's shift: both sums stay small, E[s^2] - E[s]^2 keeps the
    # variance of rows with a large mean); pass 2 writes (x - mean) * rstd * w + b.
    row = tl.program_id(0).to(tl.int64)
    pilot = tl.load(x_ptr + row * x_row_stride).to(tl.float32)
    sums = tl.zeros([BLOCK], dtype=tl.float32)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0, eviction_policy=FIRST).to(tl.float32)
        s = tl.where(cols < N, x - pilot, 0.0)
        sums += s
        squares += s * s
    shifted_mean = tl.sum(sums, axis=0) * inv_n
    var = tl.maximum(tl.sum(squares, axis=0) * inv_n - shifted_mean * shifted_mean, 0.0)
    mean = pilot + shifted_mean
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0, eviction_policy=SECOND).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        y = ((x - pilot) - shifted_mean) * rstd * w + b
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def softmax_split_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG,
                         FIRST: tl.constexpr, SECOND: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # The library's split forward (pintail/softmax.py, softmax only) with the hints: the new
    # slice read with FIRST, the lagged one (re-read from L2) with SECOND.
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M), other=-float("inf"),
                        eviction_policy=FIRST).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0), other=0.0,
                        eviction_policy=SECOND).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            slice_max = tl.max(x_new, axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
            split.publish(slots_ptr, ticket, slice_max, tl.sum(tl.exp2((x_new - shift) * LOG2E), axis=0))
        if done >= 0:
            maxes, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * LOG2E), 0.0), axis=0))
            y = tl.exp2((x_old - row_max) * LOG2E - log2_total)
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


HINTS = {"none": ("", ""), "hints": ("evict_last", "evict_first")}


def softmax_split(x, y, hints, cfg=None):
    """The library's split plan and configuration, the kernel above."""
    cfg = cfg or softmax_module.FORWARD_SPLIT
    M, N = x.shape
    slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
    first, second = HINTS[hints]
    softmax_split_kernel[grid](x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, FIRST=first, SECOND=second,
                               BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices),
                               num_warps=cfg["num_warps"])


def softmax_two_pass(x, y, block, warps, hints):
    first, second = HINTS[hints]
    softmax_two_pass_kernel[(x.shape[0],)](x, y, x.shape[1], x.stride(0), y.stride(0), FIRST=first, SECOND=second,
                                           BLOCK=block, num_warps=warps)


def rms_two_pass(x, w, y, rstd, block, warps, hints, eps=1e-6):
    first, second = HINTS[hints]
    N = x.shape[1]
    rms_two_pass_kernel[(x.shape[0],)](x, w, y, rstd, N, 1.0 / N, eps, x.stride(0), y.stride(0), FIRST=first,
                                       SECOND=second, BLOCK=block, num_warps=warps)


def layer_two_pass(x, w, b, y, mean, rstd, block, warps, hints, eps=1e-5):
    first, second = HINTS[hints]
    N = x.shape[1]
    layer_two_pass_kernel[(x.shape[0],)](x, w, b, y, mean, rstd, N, 1.0 / N, eps, x.stride(0), y.stride(0),
                                         FIRST=first, SECOND=second, BLOCK=block, num_warps=warps)


def check(device):
    for M, N, block in ((3, 1000, 256), (2, 64, 64), (4, 4097, 1024), (1, 1, 16)):
        x = torch.randn(M, N, device=device) * 3
        w = torch.randn(N, device=device)
        for hints in HINTS:
            y = torch.empty_like(x)
            softmax_two_pass(x, y, block, 4, hints)
            torch.testing.assert_close(y, torch.softmax(x.double(), -1).float(), rtol=1e-5, atol=1e-6)
            rstd = torch.empty(M, device=device)
            rms_two_pass(x, w, y, rstd, block, 4, hints)
            want = torch.nn.functional.rms_norm(x.double(), (N,), w.double(), 1e-6).float()
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            b = torch.randn(N, device=device)
            shifted = x * 0.1 + 1000.0  # a large mean against the spread: the shift must keep the variance
            layer_two_pass(shifted, w, b, y, torch.empty(M, device=device), rstd, block, 4, hints)
            want = torch.nn.functional.layer_norm(shifted.double(), (N,), w.double(), b.double(), 1e-5).float()
            torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
            split_cfg = {"plan": "split", "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 3, "LAG_ROUNDS": 1}
            softmax_split(x, y, hints, split_cfg)
            torch.testing.assert_close(y, torch.softmax(x.double(), -1).float(), rtol=1e-5, atol=1e-6)
    print(f"two-pass kernels match torch ({device})", flush=True)


CONFIGS = [(2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, sizes=(32768, 65536, 131072)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        mean, rstd = torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
        nbytes = 2 * x.numel() * 2
        runs = {"softmax library": lambda: softmax_module.launch_forward(x, y, False),
                "rms library": lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype),
                "layer library": lambda: norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype),
                "softmax split (library config) hints": lambda: softmax_split(x, y, "hints")}
        for block, warps in CONFIGS:
            for hints in HINTS:
                runs[f"softmax two-pass {block}/{warps} {hints}"] = \
                    lambda bl=block, nw=warps, h=hints: softmax_two_pass(x, y, bl, nw, h)
                runs[f"rms two-pass {block}/{warps} {hints}"] = \
                    lambda bl=block, nw=warps, h=hints: rms_two_pass(x, w, y, rstd, bl, nw, h)
                runs[f"layer two-pass {block}/{warps} {hints}"] = \
                    lambda bl=block, nw=warps, h=hints: layer_two_pass(x, w, b, y, mean, rstd, bl, nw, h)
        for name in sorted(runs, key=lambda n: n.split()[0]):
            print_fraction(f"N={N} {name}", runs[name], nbytes, copy_bw)
        del x, y


if __name__ == "__main__":
    if "--check" in sys.argv:
        check(torch.device("cpu"))
    else:
        main()
