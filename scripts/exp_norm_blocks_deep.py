"""Experiment for the next GPU session: RMSNorm's blocks backward (pintail/norm.py,
`_backward_blocks_kernel`, 0.59-0.64 of copy alone) with its rows published two ahead of
the wait instead of one.

Why: each row of a block is a round trip between the programs holding its slices (publish
the slice's sum of g x^, wait for the other slices' words, write dx). With one row published
ahead, a program has one row's x and dy loads (8 KB at 2048 bf16 elements) in flight while
it waits, ~32 KB per SM at 4 programs: about what Little's law asks for the H200's HBM
(~4.8 TB/s x ~1 us / 132 SMs = ~36 KB), with nothing to spare for the waits. Publishing two
rows ahead keeps two rows' loads in flight and lets a slow slice's word arrive while the
program still has work. No new deadlock: a program publishes rows r + 1 and r + 2 before it
waits for row r, and publishing never waits.

Cost: a third row of x and dy in registers. The library kernel takes 128 registers at
2048 / 4 warps (4 programs per SM); this one 168 (3 per SM), and 80 at 1024 / 4 warps (6 per
SM: two rows of 4 KB in flight each, 48 KB per SM). `--inspect` compiles it for sm_90 on the
CPU machine and prints the registers of each configuration below.

Predicted: 0.70-0.75 at N = 32768-262144 if the round trip is the limit (0.64 -> the groups
plan's 0.69 came from the same kind of overlap). If it is not better, the limit is elsewhere
(the word polling, the partial rows), and the next step is a profile of the stall reasons.

    TRITON_INTERPRET=1 python scripts/exp_norm_blocks_deep.py --check   # the interpreter, CPU
    python scripts/exp_norm_blocks_deep.py --inspect                     # registers, sm_90, CPU
    python scripts/exp_norm_blocks_deep.py                               # GPU: check, then time
"""

import importlib
import sys

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")
split = importlib.import_module("pintail._split")
launch_module = importlib.import_module("pintail._launch")


@triton.jit
def _load_row(x_ptr, dy_ptr, row, cols, mask, x_row_stride, dy_row_stride):
    return (tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0),
            tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0))


@triton.jit(do_not_specialize=["SLICES"])
def deep_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, M, N, inv_n, SLICES, x_row_stride,
                dy_row_stride, dx_row_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # The library's blocks kernel (RMSNorm with a weight, no bias, no residual gradient) with
    # rows r + 1 and r + 2 loaded and published before the wait for row r.
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
        x_0, dy_0 = _load_row(x_ptr, dy_ptr, row, cols, mask, x_row_stride, dy_row_stride)
        norm._publish_sum_gx(slots_ptr, x_0, dy_0, w, rstd_ptr, row, SLICES, slice_index)
        x_1, dy_1 = _load_row(x_ptr, dy_ptr, row + 1, cols, mask & (row + 1 < last), x_row_stride, dy_row_stride)
        if row + 1 < last:
            norm._publish_sum_gx(slots_ptr, x_1, dy_1, w, rstd_ptr, row + 1, SLICES, slice_index)
        while row < last:
            ahead = row + 2
            x_2, dy_2 = _load_row(x_ptr, dy_ptr, ahead, cols, mask & (ahead < last), x_row_stride, dy_row_stride)
            if ahead < last:
                norm._publish_sum_gx(slots_ptr, x_2, dy_2, w, rstd_ptr, ahead, SLICES, slice_index)
            _, sums_gx, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x_0.to(tl.float32) * rstd
            dy = dy_0.to(tl.float32)
            dx = rstd * (dy * w - x_hat * (tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n))
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            row += 1
            x_0, dy_0, x_1, dy_1 = x_1, dy_1, x_2, dy_2
        tl.store(dw_ptr + block * N + cols, dw, mask=mask)
        ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")


def blocks_plan(x, cfg):
    """The blocks plan's launch for rows x[M, N]: slice length (a whole row in the
    interpreter, which runs one program at a time), slices a row, dx, float32 partial
    dweight rows (one per block of ROWS rows), the zeroed slots and the persistent grid."""
    M, N = x.shape
    block = cfg["BLOCK"] if not launch_module.INTERPRET else launch_module.next_power_of_2(N)
    slices = launch_module.cdiv(N, block)
    blocks = launch_module.cdiv(M, cfg["ROWS"])
    assert slices <= launch_module.program_slots(x.device, 1)  # a row's slices all run at once
    dw = torch.empty(blocks, N, dtype=torch.float32, device=x.device)
    slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)
    grid = (min(launch_module.program_slots(x.device, cfg["PROGRAMS_PER_SM"]), blocks * slices),)
    return block, slices, torch.empty_like(x), dw, slots, grid


def backward(dy, x, w, rstd, cfg, kernel=deep_kernel, **constexprs):
    """(dx, dweight) of RMSNorm rows x[M, N] with a weight (float32 dweight) by `kernel`
    (this one, or another variant of the library's blocks kernel with its constexprs)."""
    M, N = x.shape
    block, slices, dx, dw, slots, grid = blocks_plan(x, cfg)
    launch_module.launch(kernel, grid, x, w, dy, rstd, slots, dx, dw, M, N, 1.0 / N,
                         slices, x.stride(0), dy.stride(0), dx.stride(0), ROWS=cfg["ROWS"], BLOCK=block,
                         SLICES_POW2=launch_module.next_power_of_2(slices), **constexprs,
                         num_warps=cfg["num_warps"])
    return dx, dw.sum(0)


def library(dy, x, w, rstd, cfg):
    dx, dw, _ = norm._backward(dy, None, x, w, False, rstd, rstd, 0.0, True, x.dtype,
                               {**norm.BACKWARD_BLOCKS["rms"], **cfg})
    return dx, dw


CHECK_CASES = ((13, 300, 4, 64), (5, 1000, 8, 256), (3, 4097, 2, 1024), (9, 33, 1, 64), (2, 1, 4, 64),
               (40, 200, 32, 64))  # (M, N, rows a block, slice)


def check_against_library(name, variant, device, cases=CHECK_CASES):
    """variant(dy, x, w, rstd, cfg) against the library's blocks plan: blocks that end past
    the last row, blocks of one and two rows (a look-ahead masked off), several slices on a GPU."""
    for M, N, rows, block in cases:
        cfg = {"ROWS": rows, "BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 4}
        x, w, dy = torch.randn(M, N, device=device), torch.randn(N, device=device), torch.randn(M, N, device=device)
        _, _, _, rstd = norm._forward(x, None, w, None, 1e-5, 0.0, True, torch.float32)
        got, want = variant(dy, x, w, rstd, cfg), library(dy, x, w, rstd, cfg)
        for g, r in zip(got, want):
            err = ((g - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
            assert err < 1e-5, f"{name} M={M} N={N} rows={rows}: relative error {err}"
    print(f"{name} blocks backward matches the library's ({device})", flush=True)


def check(device):
    check_against_library("two-ahead", backward, device)


def time_against_library(check, runs):
    """After check(device): per long-row size, the library's blocks plan (with each of
    LIBRARY_CONFIGS) and each labelled variant(dy, x, w, rstd) of `runs`, as fractions of copy."""
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, _, _, rstd = norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)
        for cfg in LIBRARY_CONFIGS:
            print_fraction(f"N={N} library blocks {cfg}", lambda: library(dy, x, w, rstd, cfg), 3 * x.numel() * 2,
                           copy_bw)
        for label, variant in runs.items():
            print_fraction(f"N={N} {label}", lambda: variant(dy, x, w, rstd), 3 * x.numel() * 2, copy_bw)


# Programs per SM from the registers (--inspect, sm_90): 2048 / 4 warps 168 (3 fit), 1024 / 4
# warps 80 (6), 1024 / 2 warps 168 (6), 4096 / 8 warps 188 (1).
CONFIGS = [{"ROWS": 32, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
           for block, warps, per_sm in ((2048, 4, 3), (1024, 4, 6), (1024, 4, 4), (1024, 2, 6), (4096, 8, 1))]
# The library's kernel with the same smaller slices (one row ahead: ~64 registers at 1024 / 4 warps).
LIBRARY_CONFIGS = [{}, {"BLOCK": 1024, "num_warps": 4, "PROGRAMS_PER_SM": 8}]


def inspect():
    sys.path.insert(0, "scripts")
    import inspect_kernel
    signature = inspect_kernel.signature(deep_kernel)
    for cfg in CONFIGS:
        inspect_kernel.inspect(deep_kernel, signature, {"ROWS": cfg["ROWS"], "BLOCK": cfg["BLOCK"], "SLICES_POW2": 16},
                               cfg["num_warps"])


def main():
    time_against_library(check, {f"two ahead {cfg}": (lambda dy, x, w, rstd, cfg=cfg: backward(dy, x, w, rstd, cfg))
                                 for cfg in CONFIGS})


if __name__ == "__main__":
    from measure import experiment
    experiment(check, inspect, main)
