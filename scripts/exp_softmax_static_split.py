"""Softmax forward past 32768: the split plan with a static ticket order (ticket = program +
round x grid) instead of the ticket counter, so that Triton's pipeliner can prefetch the
next rounds' slices (cp.async into shared memory: bytes in flight that hold no registers).
A static order waits on earlier rounds of other programs: safe only when every program of
the grid is running at once, which a cooperative launch guarantees (or it fails to launch).

    python scripts/exp_softmax_static_split.py            # GPU: kernel alone, fraction of copy
    python scripts/exp_softmax_static_split.py --inspect  # CPU: registers, SASS memory ops
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

sm = importlib.import_module("pintail.softmax")
split = importlib.import_module("pintail._split")
LOG2E = 1.4426950408889634


@triton.jit
def _forward_static_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG, ROUNDS,
                           BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    for i in tl.range(0, ROUNDS, num_stages=STAGES):
        ticket = pid + i * grid
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        x_new = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (row < M),
                        other=-float("inf")).to(tl.float32)
        x_old = tl.load(x_ptr + done.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (done >= 0) & (done < M),
                        other=0.0).to(tl.float32)
        if row < M:
            slice_max = tl.max(x_new, axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
            split.publish(slots_ptr, ticket, slice_max, tl.sum(tl.exp2((x_new - shift) * 1.4426950408889634), axis=0))
        if (done >= 0) & (done < M):
            maxes, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * 1.4426950408889634), 0.0),
                                        axis=0))
            y = tl.exp2((x_old - row_max) * 1.4426950408889634 - log2_total)
            tl.store(y_ptr + done.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _forward_own_static_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, ROUNDS,
                               BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr, STAGES: tl.constexpr):
    # Own row: the slice's exps stay in registers across the wait for the row's other slices
    # (same round or the next: programs of one grid all run at once), one exp an element; the
    # pipeliner keeps the next rounds' slices streaming into shared memory meanwhile.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    for i in tl.range(0, ROUNDS, num_stages=STAGES):
        ticket = pid + i * grid
        row = ticket // SLICES
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (row < M),
                    other=-float("inf")).to(tl.float32)
        if row < M:
            slice_max = tl.max(x, axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
            e = tl.exp2((x - shift) * 1.4426950408889634)
            split.publish(slots_ptr, ticket, shift, tl.sum(e, axis=0))
            shifts, sums, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, shifts, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((shifts - row_max) * 1.4426950408889634), 0.0),
                                        axis=0))
            y = e * tl.exp2((shift - row_max) * 1.4426950408889634 - log2_total)
            tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


def own_static_forward(x, block, warps, per_sm, stages, cooperative=True):
    M, N = x.shape
    y = torch.empty_like(x)
    slices = triton.cdiv(N, block)
    grid = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm
    rounds = triton.cdiv(M * slices, grid)
    slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)
    _forward_own_static_kernel[(grid,)](x, y, slots, M, N, x.stride(0), y.stride(0), slices, rounds,
                                        BLOCK=block, SLICES_POW2=triton.next_power_of_2(slices), STAGES=stages,
                                        num_warps=warps, launch_cooperative_grid=cooperative)
    return y


def static_forward(x, block, warps, per_sm, stages, lag_rounds=1.0, cooperative=True):
    M, N = x.shape
    y = torch.empty_like(x)
    slices = triton.cdiv(N, block)
    grid = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm if x.is_cuda else 1
    lag = max(1, (int(lag_rounds * grid) + slices - 1) // slices + 1)  # wait only on earlier rounds
    rounds = triton.cdiv((M + lag) * slices, grid)
    slots = torch.zeros(1 + (M + lag) * slices + grid, dtype=torch.int64, device=x.device)
    _forward_static_kernel[(grid,)](x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, rounds,
                                    BLOCK=block, SLICES_POW2=triton.next_power_of_2(slices), STAGES=stages,
                                    num_warps=warps, launch_cooperative_grid=cooperative)
    return y


def inspect():
    ik = importlib.import_module("inspect_kernel")
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32", "x_row_stride": "i32",
           "y_row_stride": "i32", "SLICES": "i32", "LAG": "i32", "ROUNDS": "i32", "BLOCK": "constexpr",
           "SLICES_POW2": "constexpr", "STAGES": "constexpr"}
    for block, warps, stages in ((8192, 4, 1), (8192, 4, 2), (8192, 4, 3), (4096, 4, 3), (8192, 8, 3)):
        ik.inspect(_forward_static_kernel, sig, {"BLOCK": block, "SLICES_POW2": 32, "STAGES": stages}, warps)
    del sig["LAG"]
    for block, warps, stages in ((8192, 4, 1), (8192, 4, 3), (4096, 4, 3), (4096, 4, 4), (8192, 8, 3), (16384, 8, 3)):
        ik.inspect(_forward_own_static_kernel, sig, {"BLOCK": block, "SLICES_POW2": 32, "STAGES": stages}, warps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(lambda device: None, sizes=(32768, 131072, 262144)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.softmax(x.float(), -1)
        nbytes = 2 * x.numel() * 2
        print_fraction(f"N={N} library", lambda: sm.softmax(x), nbytes, copy_bw)
        variants = [("lagged", static_forward, cfg) for cfg in ((4096, 4, 4, 3), (8192, 8, 2, 3), (4096, 4, 4, 1))]
        variants += [("own", own_static_forward, cfg) for cfg in
                     ((4096, 4, 5, 3), (4096, 4, 4, 3), (4096, 4, 4, 4), (4096, 4, 5, 1), (8192, 8, 2, 3),
                      (8192, 8, 2, 4), (2048, 4, 8, 4), (2048, 2, 12, 4), (16384, 16, 1, 3))]
        for name, fn, (block, warps, per_sm, stages) in variants:
            label = f"N={N} {name} {block}/{warps}w/{per_sm} an SM/{stages} stages"
            try:
                y = fn(x, block, warps, per_sm, stages)
                err = (y.float() - ref).abs().max().item()
            except Exception as e:
                print(f"{label}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            print_fraction(f"{label} (err {err:.1e})", lambda: fn(x, block, warps, per_sm, stages), nbytes, copy_bw)

if __name__ == "__main__":
    main()
