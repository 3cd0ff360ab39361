"""Experiment for the next GPU session: the split plans without the lag. Each ticket keeps
its slice in registers, publishes the slice's partials, waits for the other slices of its
own row and writes its output from registers; the next ticket's slice is loaded before the
wait, so a load is always in flight. Against the lagged plans (pintail/_split.py) this drops
the L2 re-read of the lagged slice (x once from HBM, y once to HBM, nothing from L2).

Deadlock: a program publishes its next ticket's partials before it waits for its current
row, so every ticket a running program has taken is published without waiting on anything.
A wait on row r can then only stall on tickets nobody has taken yet; tickets are taken in
order, so that happens only when every running program's current ticket is in r's row and
its next ticket too (2 x programs <= SLICES): never with at least one program per SM (132
on the H200) and SLICES at most 64. The interpreter runs one program at a time, so it would
wait forever: the CPU check below uses a single slice per row (the arithmetic, not the
waiting); the GPU check uses many.

Variants timed beside the library's plans (bf16, M*N = 2^27, fraction of copy):
softmax forward, softmax backward, RMSNorm forward.

    python scripts/exp_own_row.py
"""

import importlib

import torch
import triton
import triton.language as tl

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
def softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, slots_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                            SLICES, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Per ticket: (1.0, sum of y * dy over the slice); dx = y * (dy - row sum).
    end = M * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    row = ticket // SLICES
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < N) & (row < M)
    y_raw = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0)
    dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
    split.publish(slots_ptr, tl.minimum(ticket, end), tl.full((), 1.0, tl.float32),
                  tl.sum(y_raw.to(tl.float32) * dy_raw.to(tl.float32), axis=0))
    while ticket < end:
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        next_row = next_ticket // SLICES
        next_cols = (next_ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        next_mask = (next_cols < N) & (next_row < M)
        y_next = tl.load(y_ptr + next_row * y_row_stride + next_cols, mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptr + next_row * dy_row_stride + next_cols, mask=next_mask, other=0.0)
        split.publish(slots_ptr, tl.minimum(next_ticket, end), tl.full((), 1.0, tl.float32),
                      tl.sum(y_next.to(tl.float32) * dy_next.to(tl.float32), axis=0))
        _, parts, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        y = y_raw.to(tl.float32)
        dx = y * (dy_raw.to(tl.float32) - tl.sum(tl.where(valid, parts, 0.0), axis=0))
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N)
        ticket, row, y_raw, dy_raw = next_ticket, next_row, y_next, dy_next


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


def softmax_backward(y, dy, cfg):
    M, N = y.shape
    dx = torch.empty_like(y)
    slices, grid, slots = _launch_plan(M, N, cfg, y.device)
    softmax_backward_kernel[grid](y, dy, dx, slots, M, N, y.stride(0), dy.stride(0), dx.stride(0), slices,
                                  BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices),
                                  num_warps=cfg["num_warps"])
    return dx


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
        y = softmax_forward(x, cfg)
        torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-5, atol=1e-6)
        dy = torch.randn_like(x)
        truth = torch.softmax(x.double(), -1)
        dx = softmax_backward(y, dy, cfg)
        want = truth * (dy.double() - (truth * dy.double()).sum(-1, keepdim=True))
        torch.testing.assert_close(dx.double(), want, rtol=1e-4, atol=1e-5)
        x = torch.randn(M, N, device=device)
        w = torch.randn(N, device=device)
        torch.testing.assert_close(rms_forward(x, w, 1e-6, cfg), torch.nn.functional.rms_norm(x, (N,), w, 1e-6),
                                   rtol=1e-5, atol=1e-5)
    print(f"own-row plans match torch ({device})", flush=True)


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(device)
    if device.type != "cuda":
        return
    from measure import copy_bandwidth, time_ms
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in (32768, 131072, 262144):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y, dy = torch.softmax(x, -1), torch.randn_like(x)
        runs = {"softmax fwd library": (2, lambda: sm.launch_forward(x, torch.empty_like(x), False)),
                "softmax bwd library": (3, lambda: sm.launch_backward(y, dy, torch.empty_like(x), False)),
                "rms fwd library": (2, lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype))}
        # registers (scripts/inspect_kernel.py style, sm_90): 108-128 at 4096 / 4 warps and
        # 8192 / 8 warps; 181-236 at 8192 / 4 warps
        for block, warps, per_sm in ((4096, 4, 4), (4096, 4, 3), (8192, 8, 2), (16384, 16, 1)):
            cfg = {"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
            if triton.cdiv(N, block) > 64:
                continue
            runs[f"softmax fwd own row {cfg}"] = (2, lambda cfg=cfg: softmax_forward(x, cfg))
            runs[f"softmax bwd own row {cfg}"] = (3, lambda cfg=cfg: softmax_backward(y, dy, cfg))
            runs[f"rms fwd own row {cfg}"] = (2, lambda cfg=cfg: rms_forward(x, w, 1e-6, cfg))
        for name, (passes, fn) in runs.items():
            ms = time_ms(fn)
            print(f"N={N} {name}: {ms:.4f} ms {passes * x.numel() * 2 / (ms * 1e-3) / copy_bw:.3f}", flush=True)


if __name__ == "__main__":
    main()
