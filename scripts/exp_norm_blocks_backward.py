"""Experiment for the next GPU session: the norm backward past the rows plan as "blocks",
the groups plan (scripts/exp_norm_groups_backward.py: 0.63-0.70 for RMSNorm alone) without
its cooperative launch.

Work comes in tickets taken in order from an atomic counter: ticket t is slice t % SLICES of
the block of ROWS rows t // SLICES. The SLICES programs holding a block's tickets meet at
each of its rows as in the groups plan: each publishes the row's sums for its slice (the
next row's before it waits for the current one), waits for the row's other slices and
writes dx from the slice it holds. dweight / dbias of the slice are summed over the block's
rows in registers and written as one float32 partial row per block (torch sums the
partials in a fixed order: deterministic whichever program takes which ticket). HBM
traffic: x and dy once, dx once, plus the partials (4 / ROWS bytes per element written and
read: ~4 % at ROWS = 32 for bf16).

No co-residency is needed: a program takes a new ticket only when it has finished its
block, so a wait can only stall on the newest block (the only one whose tickets may not all
be taken yet), and any SLICES running programs complete it. A GPU runs at least one program
per SM and SLICES stays at or under 64 here. The interpreter runs one program at a time:
there a row is one slice (the arithmetic, not the waiting).

Predicted: the groups plan's 0.63-0.70 (RMSNorm) less the ticket atomics (one per ROWS rows
of a slice), and without its 0.35-0.63 through autograd if that came from the cooperative
launch; to check next to it with scripts/exp_host_gaps.py-style timing through autograd.

Session 5 (H200, kernel alone, fraction of copy; long = the library's two kernels):

| N | RMS long | RMS blocks, best (ROWS, BLOCK / warps / per SM) | LN long | LN blocks, best |
|---|---|---|---|---|
| 32768 | 0.556 | 0.643 (32, 2048 / 4 / 4) | 0.542 | 0.449 (16, 2048 / 4 / 4) |
| 131072 | 0.562 | 0.617 (32, 4096 / 8 / 2) | 0.543 | 0.421 (16, 2048 / 4 / 4) |
| 262144 | 0.558 | 0.599 (32, 2048 / 4 / 4) | 0.540 | 0.492 (32, 8192 / 16 / 1) |

Predicted: the groups plan's 0.63-0.70; got 0.60-0.64 for RMSNorm and less than the long
plan for LayerNorm (168-176 registers). Through autograd it lost to the long plan
(scripts/exp_norm_backward_autograd.py). Not taken.

    python scripts/exp_norm_blocks_backward.py
"""

import importlib

import torch
import triton
import triton.language as tl
from exp_norm_groups_backward import _publish_row_sums, _write_row_dx, check_against_long, time_against_long

norm = importlib.import_module("pintail.norm")
INTERPRET = importlib.import_module("pintail._launch").INTERPRET
launch = importlib.import_module("pintail._launch").launch


@triton.jit(do_not_specialize=["SLICES"])  # SLICES specialised to 1 fails Triton 3.6's compile
def backward_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                    SLICES, x_row_stride, dy_row_stride, dx_row_stride, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    end = tl.cdiv(M, ROWS) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        block = ticket // SLICES
        slice_index = ticket % SLICES
        cols = slice_index * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        w_eff = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        row = block * ROWS
        last = tl.minimum(row + ROWS, M)
        x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
        _publish_row_sums(slots_ptr, x_raw, dy_raw, w_eff, mask, mean_ptr, rstd_ptr, row, SLICES, slice_index, RMS)
        while row < last:
            next_row = row + 1
            more = next_row < last
            x_next = tl.load(x_ptr + next_row * x_row_stride + cols, mask=mask & more, other=0.0)
            dy_next = tl.load(dy_ptr + next_row * dy_row_stride + cols, mask=mask & more, other=0.0)
            if more:  # published before this program waits for the current row
                _publish_row_sums(slots_ptr, x_next, dy_next, w_eff, mask, mean_ptr, rstd_ptr, next_row, SLICES,
                                  slice_index, RMS)
            x_hat, dy = _write_row_dx(slots_ptr, x_raw, dy_raw, w_eff, 0.0, mask, mean_ptr, rstd_ptr, dx_ptr, row,
                                      cols, dx_row_stride, inv_n, SLICES, SLICES_POW2, RMS)
            dw += dy * x_hat
            db += dy
            row, x_raw, dy_raw = next_row, x_next, dy_next
        tl.store(dw_ptr + block * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(db_ptr + block * N + cols, db, mask=mask)
        ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")


def backward(dy, x, w, has_bias, mean, rstd, rms, cfg):
    """(dx, dweight, dbias or None) of rows x[M, N] with a weight (RMS: mean unused)."""
    M, N = x.shape
    dx = torch.empty_like(x)
    block = cfg["BLOCK"] if not INTERPRET else triton.next_power_of_2(N)
    slices = triton.cdiv(N, block)
    blocks = triton.cdiv(M, cfg["ROWS"])
    dw = torch.empty(blocks, N, dtype=torch.float32, device=x.device)
    db = torch.empty(blocks if has_bias else 0, N, dtype=torch.float32, device=x.device)
    slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)  # next ticket, a word per (row, slice)
    programs = cfg["PROGRAMS_PER_SM"] * (torch.cuda.get_device_properties(x.device).multi_processor_count
                                         if x.is_cuda else 1)
    launch(backward_kernel, (min(programs, blocks * slices),),  # the library's launch path, as a plan in it would
           x, w, dy, mean, rstd, slots, dx, dw, db if has_bias else dw, M, N, 1.0 / N, slices, x.stride(0),
           dy.stride(0), dx.stride(0), RMS=rms, HAS_BIAS=has_bias, ROWS=cfg["ROWS"], BLOCK=block,
           SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])
    return dx, dw.sum(0), (db.sum(0) if has_bias else None)


def check(device):
    """Blocks that run past the last row among the cases."""
    cases = [(M, N, {"ROWS": rows, "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 2})
             for M, N, rows, block in ((13, 300, 4, 64), (5, 1000, 8, 256), (3, 4097, 2, 1024), (9, 33, 3, 64),
                                       (2, 1, 4, 64))]
    check_against_long("blocks", lambda dy, dh, *rest: backward(dy, *rest), cases, device, with_dh=False)


def main():
    # Session 6 (registers for sm_90, scripts/inspect_kernel.py): RMSNorm 123 at 2048 / 4 warps,
    # 72 at 1024 / 4; LayerNorm 158 and 90. At 158, 3 programs fit per SM, not the 4 that
    # session 5's LayerNorm row counted on: (2048, 4, 3) and the 1024-element slices are new.
    configs = [{"ROWS": rows, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
               for block, warps, per_sm in ((2048, 4, 4), (2048, 4, 3), (1024, 4, 5), (1024, 4, 7), (4096, 8, 2),
                                            (8192, 16, 1)) for rows in (16, 32)]
    time_against_long(check, "blocks", configs, backward)


if __name__ == "__main__":
    main()
