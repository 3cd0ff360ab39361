"""Softmax's forward over short rows of odd length (77, 197, 257, 385, 511: attention over
ViT's 197 tokens when not fused), where the rows plan moves every element 2 bytes at a time
(session 24, kernel alone: 0.46 at 257, 0.62 at 385) and the row-shift plan lost (one row a
program is too little work below 513). Here a program takes ROWS rows of a contiguous
(M, N) tensor as one flat span of ROWS * N elements: with ROWS a multiple of 8 every span
starts on a 16-byte boundary, so the span goes in and out as 16-byte vectors. tl.gather
moves it into a (ROWS, next_power_of_2(N)) tile for the row math and back (through shared
memory); the flat index's row comes from a float reciprocal (exact for spans under 2^22).
Prediction: 0.85-0.95 of copy at 197-511, against the rows plan's 0.46-0.62 (session 24).
The backward the same way (y and dy in, dx out). Session 25, prepared (interpreter check
only); M a multiple of ROWS.

    python scripts/exp_softmax_flat_rows.py          # GPU: timings; CPU (TRITON_INTERPRET=1): the check
"""

import importlib

import measure
import torch
import triton
import triton.language as tl

from pintail._launch import next_power_of_2

sm = importlib.import_module("pintail.softmax")


@triton.jit
def flat_rows_forward(x_ptr, y_ptr, N, LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      FLAT: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * ROWS * N  # ROWS * N: a multiple of 8 elements (16 bytes)
    i = tl.arange(0, FLAT)
    live = i < ROWS * N
    flat = tl.load(x_ptr + start + i, mask=live, other=0.0)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    in_row = c < N
    at = tl.reshape(tl.where(in_row, r * N + c, 0), [ROWS * BLOCK_N])
    x = tl.reshape(tl.gather(flat, at, 0), [ROWS, BLOCK_N]).to(tl.float32)
    x = tl.where(in_row, x, -float("inf"))
    shifted = x - tl.max(x, axis=1)[:, None]
    e = tl.exp(shifted)
    total = tl.sum(e, axis=1)[:, None]
    y = shifted - tl.log(total) if LOG else e / total
    row_of = ((i.to(tl.float32) + 0.5) * (1.0 / N)).to(tl.int32)  # i // N
    back = tl.where(live, row_of * BLOCK_N + (i - row_of * N), 0)
    out = tl.gather(tl.reshape(y.to(y_ptr.dtype.element_ty), [ROWS * BLOCK_N]), back, 0)
    tl.store(y_ptr + start + i, out, mask=live)


@triton.jit
def _to_tile(flat, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The flat span's ROWS rows as a (ROWS, BLOCK_N) float32 tile (0 past each row's end)."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    at = tl.reshape(tl.where(c < N, r * N + c, 0), [ROWS * BLOCK_N])
    return tl.where(c < N, tl.reshape(tl.gather(flat, at, 0), [ROWS, BLOCK_N]).to(tl.float32), 0.0)


@triton.jit
def flat_rows_backward(y_ptr, dy_ptr, dx_ptr, N, LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       FLAT: tl.constexpr):
    # dx = y * (dy - sum(y * dy)) (softmax) or dy - exp(y) * sum(dy) (log_softmax), the span
    # of ROWS rows read and written as 16-byte vectors as in the forward
    start = tl.program_id(0).to(tl.int64) * ROWS * N
    i = tl.arange(0, FLAT)
    live = i < ROWS * N
    y = _to_tile(tl.load(y_ptr + start + i, mask=live, other=0.0), N, ROWS, BLOCK_N)
    dy = _to_tile(tl.load(dy_ptr + start + i, mask=live, other=0.0), N, ROWS, BLOCK_N)
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    row_of = ((i.to(tl.float32) + 0.5) * (1.0 / N)).to(tl.int32)  # i // N
    back = tl.where(live, row_of * BLOCK_N + (i - row_of * N), 0)
    out = tl.gather(tl.reshape(dx.to(dx_ptr.dtype.element_ty), [ROWS * BLOCK_N]), back, 0)
    tl.store(dx_ptr + start + i, out, mask=live)


def plan(N, tile=4096):
    block_n = next_power_of_2(N)
    rows = max(8, tile // block_n)
    return rows, block_n, next_power_of_2(rows * N)


def forward(x, log, tile=4096, warps=8):
    M, N = x.shape
    rows, block_n, flat = plan(N, tile)
    assert x.is_contiguous() and M % rows == 0 and x.data_ptr() % 16 == 0
    y = torch.empty_like(x)
    flat_rows_forward[(M // rows,)](x, y, N, LOG=log, ROWS=rows, BLOCK_N=block_n, FLAT=flat, num_warps=warps)
    return y


def backward(y, dy, log, tile=4096, warps=8):
    M, N = y.shape
    rows, block_n, flat = plan(N, tile)
    assert y.is_contiguous() and dy.is_contiguous() and M % rows == 0
    dx = torch.empty_like(y)
    flat_rows_backward[(M // rows,)](y, dy, dx, N, LOG=log, ROWS=rows, BLOCK_N=block_n, FLAT=flat, num_warps=warps)
    return dx


def check(device):
    for N in (7, 77, 197, 257):
        for log in (False, True):
            rows = plan(N, 1024)[0]
            x = torch.randn(3 * rows, N, device=device, dtype=torch.bfloat16) * 3
            x[1, 0] = 1e4
            x[2, -1] = -float("inf")
            want = (torch.log_softmax if log else torch.softmax)(x.float(), -1)
            got = forward(x, log, tile=1024, warps=4).float()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 if not log else 1.3e-1)
            y = (torch.log_softmax if log else torch.softmax)(x.float(), -1).to(x.dtype)
            dy = torch.randn_like(x)
            want = torch.empty_like(y)
            sm.launch_backward(y, dy, want, log)  # the library's (tested against torch)
            torch.testing.assert_close(backward(y, dy, log, tile=1024, warps=4), want, rtol=2e-2, atol=2e-2)
    print(f"flat-rows forward and backward match torch and the library ({device})", flush=True)


def main():
    copy_bw = measure.checked_copy_bandwidth(check)
    if copy_bw is None:
        return
    for N in (77, 197, 257, 385, 511):
        for log in (False, True):
            rows = plan(N)[0]
            M = 2**27 // N // rows * rows
            x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            y = torch.empty_like(x)
            name = "log_softmax" if log else "softmax"
            dy, dx = torch.randn_like(x), torch.empty_like(x)
            measure.print_fraction(f"{name} N={N} fwd library", lambda: sm.launch_forward(x, y, log), 4 * M * N,
                                   copy_bw)
            for tile, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)):
                measure.print_fraction(f"{name} N={N} fwd flat {tile}/{warps}w", lambda: forward(x, log, tile, warps),
                                       4 * M * N, copy_bw)
            measure.print_fraction(f"{name} N={N} bwd library", lambda: sm.launch_backward(y, dy, dx, log),
                                   6 * M * N, copy_bw)
            for tile, warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)):
                measure.print_fraction(f"{name} N={N} bwd flat {tile}/{warps}w",
                                       lambda: backward(y, dy, log, tile, warps), 6 * M * N, copy_bw)
            del x, y, dy, dx
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
