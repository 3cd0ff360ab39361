"""Experiment for the next GPU session: rows of N = 32768 kept on chip in their storage
dtype (bf16) instead of float32, so that two programs fit on an SM where the float32 row
allows one.

At N = 32768 the softmax rows plan holds a float32 row per program (one program per SM:
0.757 of copy, session 2; the split plan reaches 0.80) and RMSNorm's forward takes the long
plan (two passes, 0.85-0.86; torch.compile 0.94-0.95). Here a program holds one bf16 row
(64 KB: 32 registers a thread at 32 warps, 64 at 16, two bf16 to a register) and converts it
to float32 where each use needs it. The conversions are made to depend on the preceding
reduction's result (`tl.where(r == r, x, 0)`: x itself unless r is NaN, when the output is
NaN anyway), because a conversion that depends only on x is computed (and its float32
copy held) as soon as x arrives: without it, the compiler used the whole register budget
(128 registers at 16 warps). Registers, compiled for sm_90 on the CPU machine
(`--inspect`):

| kernel, N = 32768 | 16 warps | maxnreg 64 | maxnreg 72 | 32 warps | maxnreg 32 | maxnreg 40 |
|---|---|---|---|---|---|---|
| softmax forward | 128 (the cap) | 64, 152 B spilled | 72, 16 B | 54 | 32, 64 B | 40, 24 B |
| RMSNorm forward | 127 | 64, 296 B | 72, 208 B | 64 | 32, 96 B | 40, 32 B |

Two programs per SM need at most 64 registers at 16 warps or 32 at 32 warps (65536 per
SM): none of these gets there without spilling (to L1-cached local memory). Predicted:
softmax at 16 warps / maxnreg 72 (16 bytes spilled, still one program per SM) no better
than the rows plan's 0.757; the two-per-SM configurations with spills between that and the
rows plans at 16384 (0.915 softmax, 0.93 RMSNorm); to compare with the library's plans
(kernel alone, bf16, M*N = 2^27). A low-value experiment: run it only with spare time.

    python scripts/exp_rows_bf16.py [--inspect]
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

sm = importlib.import_module("pintail.softmax")
norm = importlib.import_module("pintail.norm")
LOG2E = sm.LOG2E
CONFIGS = [(16, None), (16, 64), (16, 72), (32, None), (32, 32), (32, 40)]  # (warps, maxnreg)


@triton.jit
def softmax_forward_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf"))  # held as bf16
    row_max = tl.max(x.to(tl.float32), axis=0)
    x_after_max = tl.where(row_max == row_max, x, 0.0)
    total = tl.sum(tl.exp2((x_after_max.to(tl.float32) - row_max) * LOG2E), axis=0)
    x_after_sum = tl.where(total == total, x, 0.0)
    y = tl.exp2((x_after_sum.to(tl.float32) - row_max) * LOG2E) * (1.0 / total)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, inv_n, eps, x_row_stride, y_row_stride,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)  # held as bf16
    x_f = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x_f * x_f, axis=0) * inv_n + eps)
    tl.store(rstd_ptr + row, rstd)
    x_after = tl.where(rstd == rstd, x, 0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = x_after.to(tl.float32) * rstd * w.to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def softmax_forward(x, warps, maxnreg):
    M, N = x.shape
    y = torch.empty_like(x)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    softmax_forward_kernel[(M,)](x, y, N, x.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(N),
                                 num_warps=warps, **extra)
    return y


def rms_forward(x, w, warps, maxnreg, eps=1e-6):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    rms_forward_kernel[(M,)](x, w, y, rstd, N, 1.0 / N, eps, x.stride(0), y.stride(0),
                             BLOCK=triton.next_power_of_2(N), num_warps=warps, **extra)
    return y, rstd


def check(device):
    """Against torch (softmax) and the library (RMSNorm), bf16 rows of odd lengths, with
    -inf entries in the softmax rows."""
    warps, maxnreg = (4, None) if device.type == "cpu" else CONFIGS[1]
    for M, N in ((5, 1000), (3, 4097)):
        x = torch.randn(M, N, device=device, dtype=torch.bfloat16) * 3
        x[0, ::3] = -float("inf")
        torch.testing.assert_close(softmax_forward(x, warps, maxnreg).float(), torch.softmax(x.float(), 1),
                                   rtol=2e-2, atol=1e-3)
        w = torch.randn(N, device=device, dtype=torch.bfloat16)
        x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        y, rstd = rms_forward(x, w, warps, maxnreg)
        want, _, _, want_rstd = norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)
        torch.testing.assert_close(rstd, want_rstd, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    print(f"bf16 rows kernels match ({device})", flush=True)


def inspect():
    import inspect_kernel
    for warps, maxnreg in CONFIGS:
        inspect_kernel.EXTRA_OPTIONS.clear()
        if maxnreg:
            inspect_kernel.EXTRA_OPTIONS["maxnreg"] = maxnreg
        print(f"maxnreg {maxnreg}:")
        inspect_kernel.inspect(softmax_forward_kernel, inspect_kernel.signature(softmax_forward_kernel),
                               {"BLOCK": 32768}, warps)
        inspect_kernel.inspect(rms_forward_kernel, {**inspect_kernel.signature(rms_forward_kernel),
                                                    "rstd_ptr": "*fp32"}, {"BLOCK": 32768}, warps)


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, (32768,)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * 2
        print_fraction(f"N={N} softmax fwd, library", lambda: sm._forward(x, 1, False, x.dtype), nbytes, copy_bw)
        print_fraction(f"N={N} rms fwd, library", lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype),
                       nbytes, copy_bw)
        for warps, maxnreg in CONFIGS:
            print_fraction(f"N={N} softmax fwd, bf16 row, {warps} warps, maxnreg {maxnreg}",
                           lambda: softmax_forward(x, warps, maxnreg), nbytes, copy_bw)
            print_fraction(f"N={N} rms fwd, bf16 row, {warps} warps, maxnreg {maxnreg}",
                           lambda: rms_forward(x, w, warps, maxnreg), nbytes, copy_bw)


if __name__ == "__main__":
    inspect() if "--inspect" in sys.argv else main()
