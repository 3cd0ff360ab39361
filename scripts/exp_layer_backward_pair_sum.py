"""Experiment for the next GPU session: LayerNorm's backward rows kernel (N up to 8192) with
its two row sums, of g x^ and of g, as one tuple reduction.

Why: LayerNorm's backward at N = 1024-8192 runs 0.73-0.83 of copy where RMSNorm's runs
0.88-0.90 on the same runs (one sum fewer), and its SASS has 10 / 14 / 14 barriers
(BAR.SYNC) at the library's configs for 1024 / 4096 / 8192 against RMSNorm's 5 / 7 / 5
(`scripts/inspect_kernel.py`). Two tl.sum of one tile compile to two barrier rounds; one
tuple reduction of the LayerNorm split forward cut 9 barriers to 6 and gained 0.05 (session 7).

The kernel here is the library's _backward_rows_kernel for LayerNorm (weight and bias, no
residual gradient) with PAIR (constexpr). `--inspect` prints registers and barriers at the
library's configs; the GPU run times the library's rows launch and both orders of the copy,
alternating, twice (kernel alone: the rows kernel, not the partial sums after it; bf16,
M*N = 2^27, 3 M N elements of traffic). Predicted: +0.03-0.08 at 4096 / 8192, where a row
spans warps and the kernel waits at barriers between its loads.

    TRITON_INTERPRET=1 python scripts/exp_layer_backward_pair_sum.py   # check against the library, CPU
    python scripts/exp_layer_backward_pair_sum.py --inspect             # registers and barriers, sm_90, CPU
    python scripts/exp_layer_backward_pair_sum.py                       # GPU
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")
launch_module = importlib.import_module("pintail._launch")
SIZES = (1024, 4096, 8192)


@triton.jit
def layer_backward_rows_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                               x_row_stride, dy_row_stride, dx_row_stride, PAIR: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The library's persistent rows backward for LayerNorm: tiles p, p + P, ...; the next
    # tile's loads issued before this one's sums; dweight / dbias partial rows at the end.
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    tiles = tl.cdiv(M, BLOCK_M)
    step = tl.num_programs(0)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows = rows.to(tl.int64)
    x_next = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
    for tile in range(tl.program_id(0), tiles, step):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)
        following = rows + step * BLOCK_M
        next_mask = (following < M)[:, None] & col_mask[None, :]
        x_next = tl.load(x_ptr + following[:, None] * x_row_stride + cols[None, :], mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptr + following[:, None] * dy_row_stride + cols[None, :], mask=next_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        x_hat = tl.where(mask, x - tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None], 0.0) * rstd
        g = dy * w
        if PAIR:
            gx_sum, g_sum = tl.reduce((g * x_hat, g), 1, norm._add_pairs)
        else:
            gx_sum = tl.sum(g * x_hat, axis=1)
            g_sum = tl.sum(g, axis=1)
        dx = (g - x_hat * (gx_sum * inv_n)[:, None] - (g_sum * inv_n)[:, None]) * rstd
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    part = tl.program_id(0).to(tl.int64) * N + cols
    tl.store(dw_ptr + part, tl.sum(dw, axis=0), mask=col_mask)
    tl.store(db_ptr + part, tl.sum(db, axis=0), mask=col_mask)


def backward_rows(x, w, dy, mean, rstd, pair, cfg):
    """(dx, dweight, dbias) by the copy: its partial rows summed by torch (not timed on GPU)."""
    M, N = x.shape
    parts = max(1, min(triton.cdiv(M, cfg["BLOCK_M"]), launch_module.program_slots(x.device, cfg["PROGRAMS_PER_SM"])))
    dx = torch.empty_like(x)
    dw = torch.empty(parts, N, dtype=torch.float32, device=x.device)
    db = torch.empty(parts, N, dtype=torch.float32, device=x.device)
    layer_backward_rows_kernel[(parts,)](x, w, dy, mean, rstd, dx, dw, db, M, N, 1.0 / N, x.stride(0), dy.stride(0),
                                         dx.stride(0), PAIR=pair, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                         num_warps=cfg["num_warps"])
    return dx, dw, db


def check(device):
    """Both sum orders against the library's backward: several tiles per program, ragged
    tiles and rows."""
    for M, N, block_m in ((9, 1000, 2), (5, 64, 4), (7, 130, 1)):
        x = torch.randn(M, N, device=device) * 0.5 + 2.0
        w, b, dy = torch.randn(N, device=device), torch.randn(N, device=device), torch.randn(M, N, device=device)
        _, _, mean, rstd = norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype)
        cfg = {"plan": "rows", "BLOCK_M": block_m, "BLOCK_N": triton.next_power_of_2(N), "num_warps": 4,
               "PROGRAMS_PER_SM": 2}
        want_dx, want_dw, want_db = norm._backward(dy, None, x, w, True, mean, rstd, 0.0, False, x.dtype, cfg)
        for pair in (False, True):
            dx, dw, db = backward_rows(x, w, dy, mean, rstd, pair, cfg)
            torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dw.sum(0), want_dw, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(db.sum(0), want_db, rtol=1e-5, atol=1e-5)
    print(f"LayerNorm backward rows, both sum orders, match the library ({device})", flush=True)


def inspect():
    sys.path.insert(0, "scripts")
    import inspect_kernel
    for N in SIZES:
        cfg = norm.backward_config(N, False)
        for pair in (False, True):
            inspect_kernel.inspect(layer_backward_rows_kernel, inspect_kernel.signature(layer_backward_rows_kernel),
                                   {"PAIR": pair, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]},
                                   cfg["num_warps"])


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, sizes=SIZES):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        _, _, mean, rstd = norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype)
        cfg = norm.backward_config(N, False)
        for _ in range(2):  # alternating, twice
            print_fraction(f"N={N} library (with the partial sums' kernel)",
                           lambda: norm._backward(dy, None, x, w, True, mean, rstd, 0.0, False, x.dtype),
                           3 * x.numel() * 2, copy_bw)
            for pair in (False, True):
                print_fraction(f"N={N} copy, {'one pair reduction' if pair else 'two sums'}",
                               lambda: backward_rows(x, w, dy, mean, rstd, pair, cfg), 3 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    if "--inspect" in sys.argv:
        inspect()
    else:
        main()
