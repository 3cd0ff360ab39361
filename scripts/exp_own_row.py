"""Experiment, measured (session 4): the split forwards without the lag. Each ticket keeps
its slice in registers, publishes the slice's partials, waits for the other slices of its
own row and writes its output from registers; the next ticket's slice is loaded and its
partials published before the wait (why that cannot deadlock: pintail/_split.py, where the
softmax backward took this plan: 0.82-0.84 against the lagged 0.77-0.79). Against the lagged
forwards it drops the L2 re-read of the lagged slice.

Measured (H200, bf16, M*N = 2^27, kernel alone) at N = 32768 / 131072 / 262144: softmax
forward 0.56-0.59 / 0.49-0.59 / 0.49-0.56 (lagged 0.80), RMSNorm forward 0.60-0.67 /
0.58-0.68 / 0.53-0.66 (library 0.86 / 0.80 / 0.79): the forward's partial needs the slice's
max, then a sum of exps, before it can be published, all on every ticket's critical path.
The interpreter runs one program at a time: the CPU check cuts a row into one slice.

    python scripts/exp_own_row.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import long_rows, print_fraction

split = importlib.import_module("pintail._split")
sm = importlib.import_module("pintail.softmax")
norm = importlib.import_module("pintail.norm")
LOG2E = sm.LOG2E


@triton.jit
def softmax_forward_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES,
                           BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Per ticket: (slice max, sum of exp(x - slice max)), with the max shifted to 0 for an
    # all -inf slice so the sum is 0, not NaN.
    end = M * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    row = ticket // SLICES
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M), other=-float("inf"))
    x = x_raw.to(tl.float32)
    slice_max = tl.max(x, axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    split.publish(slots_ptr, tl.minimum(ticket, end), slice_max, tl.sum(tl.exp2((x - shift) * LOG2E), axis=0))
    while ticket < end:
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        next_row = next_ticket // SLICES
        next_cols = (next_ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        x_next_raw = tl.load(x_ptr + next_row * x_row_stride + next_cols, mask=(next_cols < N) & (next_row < M),
                             other=-float("inf"))
        x_next = x_next_raw.to(tl.float32)
        # published before this program waits (see the module docstring); past the end: the spare word
        next_max = tl.max(x_next, axis=0)
        shift = tl.where(next_max == -float("inf"), 0.0, next_max)
        split.publish(slots_ptr, tl.minimum(next_ticket, end), next_max,
                      tl.sum(tl.exp2((x_next - shift) * LOG2E), axis=0))
        maxes, sums, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
        row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
        log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * LOG2E), 0.0), axis=0))
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        y = tl.exp2((x_raw.to(tl.float32) - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket, row, x_raw = next_ticket, next_row, x_next_raw


@triton.jit
def rms_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, slots_ptr, M, N, inv_n, x_row_stride, y_row_stride, eps,
                       SLICES, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Per ticket: (sum of x^2 over the slice, 1.0).
    end = M * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    row = ticket // SLICES
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M), other=0.0)
    x = x_raw.to(tl.float32)
    split.publish(slots_ptr, tl.minimum(ticket, end), tl.sum(x * x, axis=0), tl.full((), 1.0, tl.float32))
    while ticket < end:
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        next_row = next_ticket // SLICES
        next_cols = (next_ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        x_next_raw = tl.load(x_ptr + next_row * x_row_stride + next_cols, mask=(next_cols < N) & (next_row < M),
                             other=0.0)
        x_next = x_next_raw.to(tl.float32)
        split.publish(slots_ptr, tl.minimum(next_ticket, end), tl.sum(x_next * x_next, axis=0),
                      tl.full((), 1.0, tl.float32))
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        squares, _, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.where(valid, squares, 0.0), axis=0) * inv_n + eps)
        y = x_raw.to(tl.float32) * rstd * w
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        tl.store(rstd_ptr + row, rstd, mask=ticket % SLICES == 0)
        ticket, row, x_raw = next_ticket, next_row, x_next_raw


def _launch_plan(M, N, cfg, device):
    slices = triton.cdiv(N, cfg["BLOCK"])
    programs = min(M * slices, split.program_slots(device, cfg["PROGRAMS_PER_SM"]))
    assert device.type != "cuda" or slices <= torch.cuda.get_device_properties(device).multi_processor_count
    # [next ticket, a word per (row, slice), a spare word for the tickets past the end]
    return slices, (programs,), torch.zeros(2 + M * slices, dtype=torch.int64, device=device)


def softmax_forward(x, cfg):
    M, N = x.shape
    y = torch.empty_like(x)
    slices, grid, slots = _launch_plan(M, N, cfg, x.device)
    softmax_forward_kernel[grid](x, y, slots, M, N, x.stride(0), y.stride(0), slices, BLOCK=cfg["BLOCK"],
                                 SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])
    return y


def rms_forward(x, w, eps, cfg):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    slices, grid, slots = _launch_plan(M, N, cfg, x.device)
    rms_forward_kernel[grid](x, w, y, rstd, slots, M, N, 1.0 / N, x.stride(0), y.stride(0), eps, slices,
                             BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices),
                             num_warps=cfg["num_warps"])
    return y


def check(device):
    """Against torch: on the GPU with many slices per row (the waits), in the interpreter
    with one slice per row (a program never waits on another)."""
    for M, N in ((7, 1000), (3, 40000), (33, 4097)):
        # at least two slices on the GPU (one slice, SLICES specialised to 1, fails Triton 3.6's compile)
        block = min(1024, triton.next_power_of_2(N) // 2) if device.type == "cuda" else triton.next_power_of_2(N)
        cfg = {"BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 4}
        x = torch.randn(M, N, device=device) * 5
        x[0, : N // 2] = -float("inf")
        torch.testing.assert_close(softmax_forward(x, cfg), torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
        x = torch.randn(M, N, device=device)
        w = torch.randn(N, device=device)
        torch.testing.assert_close(rms_forward(x, w, 1e-6, cfg), torch.nn.functional.rms_norm(x, (N,), w, 1e-6),
                                   rtol=1e-5, atol=1e-5)
    print(f"own-row plans match torch ({device})", flush=True)


def main():
    for N, M, copy_bw in long_rows(check):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        runs = {"softmax fwd library": lambda: sm.launch_forward(x, torch.empty_like(x), False),
                "rms fwd library": lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)}
        # registers (sm_90): 108-128 at 4096 / 4 warps and 8192 / 8 warps
        for block, warps, per_sm in ((4096, 4, 4), (4096, 4, 3), (8192, 8, 2), (16384, 16, 1)):
            cfg = {"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
            if triton.cdiv(N, block) <= 64:
                runs[f"softmax fwd own row {cfg}"] = lambda cfg=cfg: softmax_forward(x, cfg)
                runs[f"rms fwd own row {cfg}"] = lambda cfg=cfg: rms_forward(x, w, 1e-6, cfg)
        for name, fn in runs.items():
            print_fraction(f"N={N} {name}", fn, 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    main()
