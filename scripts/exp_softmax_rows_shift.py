"""Odd rows in the rows plan, one row a program with 1-D ends (prepared in session 23).

The library's rows kernels take SHIFT past 6144 (session 23): each row of the tile from its
first 16-byte boundary, the row's up to 2 x 7 other elements in a [rows, 16] tile. sm_90
SASS showed that tile replicated across the threads: 16 scalar loads a thread at 2 x 1024 /
4 warps, 8 at 1 x 8192 / 16 warps, beside the body's 2 vector loads, and two more barriers;
the cluster kernels' 1-D ends take 1 load a thread. The guess: that is why SHIFT lost on
rows of up to 6143 (1001: 0.81 -> 0.63) and why 8191 reaches 0.69 where 8192 reads 0.95.
Here the row is a 1-D slice (BLOCK_M 1), its ends a 1-D tensor, as in the cluster kernels.
Per N: the library (its plan), then the 1-D form at the warps given; forward and backward,
softmax and log_softmax. Prediction: within 0.05 of the aligned neighbour from 4097 up.

    python scripts/exp_softmax_rows_shift.py            # CPU: checks in the interpreter; GPU: also times
    python scripts/exp_softmax_rows_shift.py --sizes 1001,8191
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

import measure

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
LOG2E = sm.LOG2E


@triton.jit
def _forward_row_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr,
                        SHIFT: tl.constexpr):
    # one row a program: its 16-byte pieces as a 1-D slice, its ends as a 1-D tensor
    row = tl.program_id(0).to(tl.int64)
    x, x_ends = sm._load_slice(x_ptr, row, M, N, x_row_stride, 0, BLOCK, SHIFT, 1)
    x, x_ends = x.to(tl.float32), x_ends.to(tl.float32)
    row_max = tl.maximum(tl.max(x, axis=0), tl.max(x_ends, axis=0))
    e = tl.exp2((x - row_max) * LOG2E)
    e_ends = tl.exp2((x_ends - row_max) * LOG2E)
    total = tl.sum(e, axis=0) + tl.sum(e_ends, axis=0)
    if LOG:
        log_total = tl.log(total)
        y, y_ends = (x - row_max) - log_total, (x_ends - row_max) - log_total
    else:
        y, y_ends = e * (1.0 / total), e_ends * (1.0 / total)
    sm._store_slice(y_ptr, y, y_ends, row, M, N, x_row_stride, y_row_stride, 0, BLOCK, SHIFT, 1)


@triton.jit
def _backward_row_kernel(y_ptr, dy_ptr, dx_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                         LOG: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    y, y_ends = sm._load_slice(y_ptr, row, M, N, y_row_stride, 0, BLOCK, SHIFT, 1, other=0.0)
    dy, dy_ends = sm._load_slice(dy_ptr, row, M, N, dy_row_stride, 0, BLOCK, SHIFT, 1, other=0.0)
    total = sm._partial(y, dy, LOG) + sm._partial(y_ends, dy_ends, LOG)
    sm._store_slice(dx_ptr, sm._dx(y, dy, total, LOG), sm._dx(y_ends, dy_ends, total, LOG), row, M, N,
                    y_row_stride, dx_row_stride, 0, BLOCK, SHIFT, 1)


def forward(x, y, log, warps):
    M, N = x.shape
    shift = cluster.window(N, N, x, y)[1]
    assert shift, "rows that start 16-byte aligned, of a length no vector width divides"
    _forward_row_kernel[(M,)](x, y, M, N, x.stride(0), y.stride(0), LOG=log, BLOCK=triton.next_power_of_2(N),
                              SHIFT=shift, num_warps=warps)
    return y


def backward(y, dy, dx, log, warps):
    M, N = y.shape
    shift = cluster.window(N, N, y, dy, dx)[1]
    assert shift
    _backward_row_kernel[(M,)](y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0), LOG=log,
                               BLOCK=triton.next_power_of_2(N), SHIFT=shift, num_warps=warps)
    return dx


def check(device):
    """Both kernels against float64 torch at odd lengths, extremes in the ends."""
    for N in (9, 1001, 4097):
        for log in (False, True):
            wide = torch.randn(5, N + 16, device=device) * 3
            wide[1, 0] = wide[2, N - 1] = 1e4
            wide[3, :3] = -float("inf")
            x = wide.to(torch.bfloat16)[:, :N]
            y = forward(x, torch.empty(5, N, device=device, dtype=x.dtype), log, 4)
            fn = torch.log_softmax if log else torch.softmax
            truth = fn(x.double(), -1)
            finite = torch.isfinite(truth)
            assert ((y.double() - truth).abs() <= 0.02 + 0.01 * truth.abs())[finite].all(), (N, log)
            assert torch.equal(torch.isfinite(y), finite), (N, log)
            dy = torch.randn(5, N, device=device).to(x.dtype)
            dx = backward(y, dy, torch.empty_like(y), log, 4)
            y64, dy64 = y.double(), dy.double()
            exact = dy64 - y64.exp() * dy64.sum(-1, keepdim=True) if log else \
                y64 * (dy64 - (y64 * dy64).sum(-1, keepdim=True))
            assert ((dx.double() - exact).abs() <= 0.02 + 0.02 * exact.abs()).all(), (N, log)
    print("check: passed")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1001,3001,4097,6143,7001,8191,12289,16383")
    p.add_argument("--warps", default="4,8,16")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check(device)
    if device == "cpu":
        return
    copy_bw = measure.copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in map(int, args.sizes.split(",")):
        M = 2**27 // N
        x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
        for log in (False, True):
            measure.print_fraction(f"N={N} log={log} fwd library", lambda: sm.launch_forward(x, y, log),
                                   2 * x.numel() * 2, copy_bw)
            measure.print_fraction(f"N={N} log={log} bwd library", lambda: sm.launch_backward(y, dy, dx, log),
                                   3 * x.numel() * 2, copy_bw)
            for warps in map(int, args.warps.split(",")):
                measure.print_fraction(f"N={N} log={log} fwd 1-D {warps}w", lambda: forward(x, y, log, warps),
                                       2 * x.numel() * 2, copy_bw)
                measure.print_fraction(f"N={N} log={log} bwd 1-D {warps}w", lambda: backward(y, dy, dx, log, warps),
                                       3 * x.numel() * 2, copy_bw)
        del x, y, dy, dx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
