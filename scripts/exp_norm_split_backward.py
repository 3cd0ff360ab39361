"""Experiment, measured (session 4): the norm backward over long rows as a split plan
whose weight gradient is deterministic, with the next row's loads in flight. Measured
(H200, bf16, M*N = 2^27, kernel alone, every config below): RMSNorm 0.40-0.48, LayerNorm
0.30-0.39, against the long plan's 0.53-0.56. Not taken.

Session 3 measured a split backward with tickets of ROWS rows x one slice (commit b622964):
per ticket, row j of block b publishes its sums (sum g, sum g x^) and dx of row j of block
b - LAG is written from a re-read that hits L2; dweight / dbias are summed over the block's
rows in registers in row order and written as one float32 partial row per ticket (torch
sums the partials: deterministic whichever program takes the ticket). It measured 0.45-0.50
of copy against the long plan's 0.55: each row of the loop was a serial chain (load, reduce,
publish, wait, store) with nothing else in flight. Here the loads of row j + 1 (new and
lagged) are issued before row j is processed, so a program always has a row's reads in
flight while it reduces, waits and stores.

HBM traffic: x and dy once, dx once, plus the float32 partials (1 / ROWS of a float32 row
per row, written once and read once by torch's sum).

    python scripts/exp_norm_split_backward.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import long_rows, print_fraction

split = importlib.import_module("pintail._split")
norm = importlib.import_module("pintail.norm")


@triton.jit
def backward_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, slots_ptr, M, N, inv_n,
                    x_row_stride, dy_row_stride, dx_row_stride, SLICES, LAG, RMS: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Published per (row, slice): RMS (1.0, sum g x^); LayerNorm (sum g, sum g x^ with its
    # lowest mantissa bit set, so that the word is never 0).
    blocks = tl.cdiv(M, ROWS)
    end = (blocks + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        block = ticket // SLICES
        done_block = block - LAG
        slice_index = ticket % SLICES
        cols = slice_index * BLOCK + tl.arange(0, BLOCK)
        col_mask = cols < N
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        row = block * ROWS
        done = done_block * ROWS
        new = col_mask & (row < M)
        old = col_mask & (done >= 0) & (done < M)
        x_new_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=new, other=0.0)
        dy_new_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=new, other=0.0)
        x_old_raw = tl.load(x_ptr + done * x_row_stride + cols, mask=old, other=0.0)
        dy_old_raw = tl.load(dy_ptr + done * dy_row_stride + cols, mask=old, other=0.0)
        for j in range(ROWS):
            row = block * ROWS + j
            done = done_block * ROWS + j
            # row j + 1's reads go out before row j is reduced, published, waited for, stored
            more = j + 1 < ROWS
            next_new = col_mask & (row + 1 < M) & more
            next_old = col_mask & (done + 1 >= 0) & (done + 1 < M) & more
            x_new_next = tl.load(x_ptr + (row + 1) * x_row_stride + cols, mask=next_new, other=0.0)
            dy_new_next = tl.load(dy_ptr + (row + 1) * dy_row_stride + cols, mask=next_new, other=0.0)
            x_old_next = tl.load(x_ptr + (done + 1) * x_row_stride + cols, mask=next_old, other=0.0)
            dy_old_next = tl.load(dy_ptr + (done + 1) * dy_row_stride + cols, mask=next_old, other=0.0)
            if row < M:
                x_new = x_new_raw.to(tl.float32)
                dy_new = dy_new_raw.to(tl.float32)
                if RMS:
                    x_hat = x_new * tl.load(rstd_ptr + row)
                else:
                    x_hat = tl.where(col_mask, x_new - tl.load(mean_ptr + row), 0.0) * tl.load(rstd_ptr + row)
                g = dy_new * w
                sum_gx = tl.sum(g * x_hat, axis=0)
                if RMS:
                    split.publish(slots_ptr, row * SLICES + slice_index, tl.full((), 1.0, tl.float32), sum_gx)
                else:
                    sum_gx = (sum_gx.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
                    split.publish(slots_ptr, row * SLICES + slice_index, tl.sum(g, axis=0), sum_gx)
                dw += dy_new * x_hat
                db += dy_new
            if (done >= 0) & (done < M):
                sums_g, sums_gx, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
                rstd = tl.load(rstd_ptr + done)
                x_old = x_old_raw.to(tl.float32)
                if RMS:
                    x_hat = x_old * rstd
                else:
                    x_hat = tl.where(col_mask, x_old - tl.load(mean_ptr + done), 0.0) * rstd
                g = dy_old_raw.to(tl.float32) * w
                dx = g - x_hat * (tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n)
                if not RMS:
                    dx -= tl.sum(tl.where(valid, sums_g, 0.0), axis=0) * inv_n
                tl.store(dx_ptr + done * dx_row_stride + cols, (dx * rstd).to(dx_ptr.dtype.element_ty), mask=col_mask)
            x_new_raw, dy_new_raw, x_old_raw, dy_old_raw = x_new_next, dy_new_next, x_old_next, dy_old_next
        if block < blocks:
            tl.store(dw_ptr + block * N + cols, dw, mask=col_mask)
            if not RMS:
                tl.store(db_ptr + block * N + cols, db, mask=col_mask)
        ticket = next_ticket


def backward(x, w, dy, mean, rstd, rms, cfg):
    """(dx, dweight, dbias or None) of rows x[M, N] with a weight (LayerNorm: and a bias)."""
    M, N = x.shape
    dx = torch.empty_like(x)
    blocks = triton.cdiv(M, cfg["ROWS"])
    dw = torch.empty(blocks, N, dtype=torch.float32, device=x.device)
    db = torch.empty(blocks if not rms else 0, N, dtype=torch.float32, device=x.device)
    slices = triton.cdiv(N, cfg["BLOCK"])
    programs = split.program_slots(x.device, cfg["PROGRAMS_PER_SM"])
    lag = max(1, min(blocks, int(cfg["LAG_ROUNDS"] * programs) // slices))  # in blocks: as split.split_plan
    grid = (min((blocks + lag) * slices, programs),)
    slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)  # next ticket, a word per (row, slice)
    backward_kernel[grid](x, w, dy, mean, rstd, dx, dw, db, slots, M, N, 1.0 / N, x.stride(0), dy.stride(0),
                          dx.stride(0), slices, lag, RMS=rms, ROWS=cfg["ROWS"], BLOCK=cfg["BLOCK"],
                          SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])
    return dx, dw.sum(0), (None if rms else db.sum(0))


def check(device):
    """Against the library's long plan (itself tested against torch), LayerNorm on rows of
    mean 1000; dweight bit-identical across runs."""
    for rms in (True, False):
        for M, N, rows, block in ((13, 300, 4, 64), (5, 1000, 8, 256), (3, 4097, 2, 1024), (9, 33, 3, 64)):
            x = torch.randn(M, N, device=device) * (1 if rms else 0.1) + (0 if rms else 1000.0)
            w, b, dy = torch.randn(N, device=device), torch.randn(N, device=device), torch.randn(M, N, device=device)
            _, _, mean, rstd = norm._forward(x, None, w, None if rms else b, 1e-5, 0.0, rms, x.dtype)
            cfg = {"ROWS": rows, "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 2, "LAG_ROUNDS": 1}
            got = backward(x, w, dy, mean, rstd, rms, cfg)
            want = norm._backward(dy, None, x, w, not rms, mean, rstd, 0.0, rms, x.dtype,
                                  {**norm.BACKWARD_LONG, "BLOCK": 64})
            for g, r in zip(got, want):
                if r is not None:
                    err = ((g - r).abs().max() / r.abs().max()).item()
                    assert err < 1e-4, f"rms={rms} M={M} N={N}: relative error {err}"
            assert torch.equal(backward(x, w, dy, mean, rstd, rms, cfg)[1], got[1]), "dweight differs between runs"
    print(f"pipelined split backward matches the long plan ({device})", flush=True)


def main():
    for N, M, copy_bw in long_rows(check, (16384, 32768, 131072, 262144)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        for rms in (True, False):
            kind = "rms" if rms else "layer"
            _, _, mean, rstd = norm._forward(x, None, w, None if rms else w, 1e-5, 0.0, rms, x.dtype)
            runs = {f"{kind} long": lambda: norm._backward(dy, None, x, w, not rms, mean, rstd, 0.0, rms, x.dtype,
                                                           norm.BACKWARD_LONG)}
            # registers (sm_90, ROWS 8): 1024 / 4 warps 107-124 (4 per SM), 2048 / 8 warps 108-128
            # (2), 2048 / 4 warps 168-199 (2-3), 4096 / 8 warps 169-205 (1)
            for block, warps, per_sm in ((1024, 4, 4), (2048, 4, 2), (2048, 8, 2), (4096, 8, 1)):
                for rows in (8, 16):
                    cfg = {"ROWS": rows, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm,
                           "LAG_ROUNDS": 1}
                    runs[f"{kind} pipelined split {cfg}"] = lambda cfg=cfg: backward(x, w, dy, mean, rstd, rms, cfg)
            for name, fn in runs.items():
                print_fraction(f"N={N} {name}", fn, 3 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    main()
