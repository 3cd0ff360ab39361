"""Experiment for the next GPU session: LayerNorm's rows forward (N up to 32768) with its two
sums, of s and s^2, as one tuple reduction.

Why: the library's rows kernel (pintail/norm.py, _forward_rows_kernel) takes two tl.sum of
the same tile and its comment assumes they share one round of cross-warp reductions. The
SASS says otherwise: in the split forward two sums compiled to 9 barriers (BAR.SYNC) and
one tuple reduction to 6 (`scripts/inspect_kernel.py` counts them), and that change gained
0.05 of copy there in session 7. LayerNorm's rows forward measures 0.92 at N = 1024 (bar
0.96), 0.94 at 4096 / 8192, 0.77 at 32768 (bar 0.90, compile 0.79); RMSNorm's one sum
0.95 at the same shapes.

The kernel here is the library's rows forward for LayerNorm (weight and bias, no residual)
with PAIR (constexpr): the two sums as one tl.reduce. `--inspect` prints registers and
barriers per library config; the GPU run times both at each of the library's rows configs,
alternating, twice (kernel alone, bf16, M*N = 2^27). Predicted: +0.02-0.04 where a row
spans several warps (N >= 4096); nothing where a row sits in one warp (the sums then need
no barrier).

    TRITON_INTERPRET=1 python scripts/exp_layer_rows_pair_sum.py   # check against the library, CPU
    python scripts/exp_layer_rows_pair_sum.py --inspect             # registers and barriers, sm_90, CPU
    python scripts/exp_layer_rows_pair_sum.py                       # GPU
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")
SIZES = (1024, 4096, 8192, 16384, 32768)


@triton.jit
def layer_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, inv_n, x_row_stride, y_row_stride, eps,
                      PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The library's rows forward for LayerNorm: sums of s = x - pilot (the row's first value).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    pilot = tl.load(x_ptr + rows * x_row_stride, mask=row_mask, other=0.0).to(tl.float32)
    shifted = tl.where(mask, x - pilot[:, None], 0.0)
    if PAIR:
        sums, squares = tl.reduce((shifted, shifted * shifted), 1, norm._add_pairs)
    else:
        sums = tl.sum(shifted, axis=1)
        squares = tl.sum(shifted * shifted, axis=1)
    shifted_mean = sums * inv_n
    var = tl.maximum(squares * inv_n - shifted_mean * shifted_mean, 0.0)
    tl.store(mean_ptr + rows, pilot + shifted_mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    y = (shifted - shifted_mean[:, None]) * rstd[:, None]
    y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :] + \
        tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def forward(x, w, b, pair, cfg, eps=1e-5):
    M, N = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    layer_rows_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](x, w, b, y, mean, rstd, M, N, 1.0 / N, x.stride(0),
                                                        y.stride(0), eps, PAIR=pair, BLOCK_M=cfg["BLOCK_M"],
                                                        BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    return y, mean, rstd


def check(device):
    """Both sum orders against the library's rows plan: rows of mean 1000 (the shift keeps
    the variance), ragged tiles and rows."""
    for M, N, block_m in ((5, 1000, 2), (3, 64, 4), (7, 130, 1)):
        x = torch.randn(M, N, device=device) * 0.1 + 1000.0
        w, b = torch.randn(N, device=device), torch.randn(N, device=device)
        cfg = {"plan": "rows", "BLOCK_M": block_m, "BLOCK_N": triton.next_power_of_2(N), "num_warps": 4}
        want, _, want_mean, want_rstd = norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype, cfg)
        for pair in (False, True):
            y, mean, rstd = forward(x, w, b, pair, cfg)
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mean, want_mean)
            torch.testing.assert_close(rstd, want_rstd, rtol=1e-5, atol=1e-5)
    print(f"LayerNorm rows forward, both sum orders, match the library ({device})", flush=True)


def inspect():
    sys.path.insert(0, "scripts")
    import inspect_kernel
    for N in SIZES:
        cfg = norm.forward_config(N, False, False)
        for pair in (False, True):
            inspect_kernel.inspect(layer_rows_kernel, inspect_kernel.signature(layer_rows_kernel),
                                   {"PAIR": pair, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]},
                                   cfg["num_warps"])


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, sizes=SIZES):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        cfg = norm.forward_config(N, False, False)
        for _ in range(2):  # alternating, twice
            print_fraction(f"N={N} library", lambda: norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype),
                           4 * x.numel(), copy_bw)
            for pair in (False, True):
                print_fraction(f"N={N} copy, {'one pair reduction' if pair else 'two sums'}",
                               lambda: forward(x, w, b, pair, cfg), 4 * x.numel(), copy_bw)


if __name__ == "__main__":
    if "--inspect" in sys.argv:
        inspect()
    else:
        main()
