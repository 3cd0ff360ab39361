"""Experiment, measured (session 4): the RMSNorm / LayerNorm backward past the rows plan as
"groups". Rows are cut into slices; program (group, slice) owns that slice of rows group,
group + GROUPS, ...; the SLICES programs of a group exchange each row's sums (sum g x^, and
sum g for LayerNorm) through 64-bit self-flagging words in global memory (pintail/_split.py)
and write dx from the slice they hold, so x and dy are read once; dweight / dbias stay in
registers per group (one float32 partial row per group, summed by torch: deterministic). A
program publishes the next row's sums before it waits for the current row. Every program of
a group must be running at once, so the launch is cooperative and its grid sized by the
driver's occupancy (cuOccupancyMaxActiveBlocksPerMultiprocessor through ctypes).

H200, bf16, M*N = 2^27, kernel alone (docs/tune-*-groups-backward-2026-11-29.json), against
the library's long plan (row sums, then chunks: x and dy read twice):
    RMSNorm    N = 32768 / 131072 / 262144: 0.68-0.70 / 0.68 / 0.61-0.63   (long 0.55)
    LayerNorm                                0.54    / 0.57 / 0.56        (long 0.53-0.54)
Not in the library: through autograd (pintail.bench run 9, the plan briefly the default)
RMSNorm measured 0.35 / 0.63 / 0.58 (run 10: 0.39 / 0.45 / 0.61), below the long plan's 0.55
at 32768, unexplained; and a cooperative launch waits until its whole grid fits on the GPU,
so a communication kernel running beside it (overlapped all-reduce) would delay it, which
was not measured. The interpreter runs one program at a time: there a row is one slice.

    python scripts/exp_norm_groups_backward.py
"""

import ctypes
import functools
import importlib

import torch
import triton
import triton.language as tl
from measure import long_rows, print_fraction

split = importlib.import_module("pintail._split")
norm = importlib.import_module("pintail.norm")
INTERPRET = importlib.import_module("pintail._launch").INTERPRET


# SLICES specialised to 1 fails Triton 3.6's compile; GROUPS is left general so that the
# occupancy measured before the grid is known (resident_programs) is the launched kernel's
@triton.jit(do_not_specialize=["GROUPS", "SLICES"])
def _backward_groups_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, db_ptr,
                            M, N, inv_n, GROUPS, SLICES, x_row_stride, dy_row_stride, dh_row_stride, dx_row_stride,
                            weight_offset, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            HAS_DH: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Program (group, slice): slice `slice` of rows group, group + GROUPS, ... The SLICES
    # programs of a group (all running: a cooperative launch) meet at every row through its
    # published sums. A program publishes the next row's sums before it waits for the
    # current row, so each wait overlaps the other programs' next loads. dweight / dbias
    # of the slice stay in registers over the group's rows: one partial row per group,
    # summed by torch (deterministic).
    group = tl.program_id(0) // SLICES
    slice_index = tl.program_id(0) % SLICES
    cols = slice_index * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_WEIGHT:
        w_eff = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    else:
        w_eff = 1.0
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    row = group.to(tl.int64)
    x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask & (row < M), other=0.0)
    dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask & (row < M), other=0.0)
    if row < M:
        _publish_row_sums(slots_ptr, x_raw, dy_raw, w_eff, mask, mean_ptr, rstd_ptr, row, SLICES, slice_index, RMS)
    while row < M:
        next_row = row + GROUPS
        x_next = tl.load(x_ptr + next_row * x_row_stride + cols, mask=mask & (next_row < M), other=0.0)
        dy_next = tl.load(dy_ptr + next_row * dy_row_stride + cols, mask=mask & (next_row < M), other=0.0)
        if next_row < M:
            _publish_row_sums(slots_ptr, x_next, dy_next, w_eff, mask, mean_ptr, rstd_ptr, next_row, SLICES,
                              slice_index, RMS)
        if HAS_DH:
            dh = tl.load(dh_ptr + row * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            dh = 0.0
        x_hat, dy = _write_row_dx(slots_ptr, x_raw, dy_raw, w_eff, dh, mask, mean_ptr, rstd_ptr, dx_ptr, row, cols,
                                  dx_row_stride, inv_n, SLICES, SLICES_POW2, RMS)
        dw += dy * x_hat
        db += dy
        row, x_raw, dy_raw = next_row, x_next, dy_next
    if HAS_WEIGHT:
        tl.store(dw_ptr + group.to(tl.int64) * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_ptr + group.to(tl.int64) * N + cols, db, mask=mask)


@triton.jit
def _x_hat_and_dy(x_raw, dy_raw, mask, mean_ptr, rstd_ptr, row, RMS: tl.constexpr):
    rstd = tl.load(rstd_ptr + row)
    if RMS:
        x_hat = x_raw.to(tl.float32) * rstd
    else:
        x_hat = tl.where(mask, x_raw.to(tl.float32) - tl.load(mean_ptr + row), 0.0) * rstd
    return x_hat, dy_raw.to(tl.float32), rstd


@triton.jit
def _write_row_dx(slots_ptr, x_raw, dy_raw, w_eff, dh, mask, mean_ptr, rstd_ptr, dx_ptr, row, cols, dx_row_stride,
                  inv_n, SLICES, SLICES_POW2: tl.constexpr, RMS: tl.constexpr):
    """Wait for the row's sums from every slice, write dx (+ dh) of this slice; returns
    (x^, dy) for the weight and bias gradients."""
    sums_g, sums_gx, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
    x_hat, dy, rstd = _x_hat_and_dy(x_raw, dy_raw, mask, mean_ptr, rstd_ptr, row, RMS)
    g = dy * w_eff
    mean_gx = tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n
    if RMS:
        dx = rstd * (g - x_hat * mean_gx) + dh
    else:
        dx = rstd * (g - tl.sum(tl.where(valid, sums_g, 0.0), axis=0) * inv_n - x_hat * mean_gx) + dh
    tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    return x_hat, dy


@triton.jit
def _publish_row_sums(slots_ptr, x_raw, dy_raw, w_eff, mask, mean_ptr, rstd_ptr, row, SLICES, slice_index,
                      RMS: tl.constexpr):
    """A slice's sums, RMS: (1.0, sum g x^); LayerNorm: (sum g, sum g x^ with its lowest
    mantissa bit set, so that the word is never 0)."""
    x_hat, dy, _ = _x_hat_and_dy(x_raw, dy_raw, mask, mean_ptr, rstd_ptr, row, RMS)
    g = dy * w_eff
    sum_gx = tl.sum(g * x_hat, axis=0)
    if RMS:
        split.publish(slots_ptr, row * SLICES + slice_index, tl.full((), 1.0, tl.float32), sum_gx)
    else:
        flagged = (sum_gx.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
        split.publish(slots_ptr, row * SLICES + slice_index, tl.sum(g, axis=0), flagged)


@functools.cache
def _driver():
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                 ctypes.c_int, ctypes.c_size_t]
    return cuda


def resident_programs(compiled, device):
    """How many programs of a compiled kernel the GPU holds at once."""
    blocks = ctypes.c_int(0)
    compiled._init_handles()  # a kernel only compiled (warmup) has no function handle yet
    status = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), compiled.function, compiled.metadata.num_warps * 32, compiled.metadata.shared)
    assert status == 0, f"cuOccupancyMaxActiveBlocksPerMultiprocessor: CUresult {status}"
    return blocks.value * torch.cuda.get_device_properties(device).multi_processor_count


def backward(dy, dh, x, w, has_bias, mean, rstd, rms, cfg):
    """(dx, dweight, dbias) of rows x[M, N] (RMS: mean unused) with a weight."""
    M, N = x.shape
    dx = torch.empty_like(x)
    block = cfg["BLOCK"] if not INTERPRET else triton.next_power_of_2(N)
    slices = triton.cdiv(N, block)
    slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)  # a word per (row, slice)
    programs = cfg["PROGRAMS_PER_SM"] * (torch.cuda.get_device_properties(x.device).multi_processor_count
                                         if x.is_cuda else 1)
    args = lambda groups, dw, db: (x, w, dy, dh if dh is not None else dy, mean, rstd, slots, dx, dw, db, M, N,
                                   1.0 / N, groups, slices, x.stride(0), dy.stride(0),
                                   dh.stride(0) if dh is not None else 0, dx.stride(0), 0.0)
    flags = dict(RMS=rms, HAS_WEIGHT=True, HAS_BIAS=has_bias, HAS_DH=dh is not None, BLOCK=block,
                 SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"], launch_cooperative_grid=True)
    if x.is_cuda:  # GROUPS is not specialised, so a placeholder compiles the kernel that runs
        compiled = _backward_groups_kernel.warmup(*args(1, rstd, rstd), **flags, grid=(1,))
        programs = min(programs, resident_programs(compiled, x.device))
    groups = min(M, programs // slices)
    assert groups > 0, "a row of more slices than the GPU holds programs"
    dw = torch.empty(groups, N, dtype=torch.float32, device=x.device)
    db = torch.empty(groups if has_bias else 0, N, dtype=torch.float32, device=x.device)
    _backward_groups_kernel[(groups * slices,)](*args(groups, dw, db if has_bias else rstd), **flags)
    return dx, dw.sum(0), (db.sum(0) if has_bias else None)


def check_against_long(name, backward, cases, device, with_dh=True):
    """backward(dy, dh, x, w, has_bias, mean, rstd, rms, cfg) against the library's long plan
    (itself tested against torch) for each (M, N, cfg) of cases, RMSNorm and LayerNorm (rows
    of mean 1000), with the residual's gradient if with_dh; dweight bit-identical across runs."""
    for rms in (True, False):
        for M, N, cfg in cases:
            x = torch.randn(M, N, device=device) * (1 if rms else 0.1) + (0 if rms else 1000.0)
            w, b = torch.randn(N, device=device), torch.randn(N, device=device)
            dy = torch.randn(M, N, device=device)
            dh = torch.randn(M, N, device=device) if with_dh else None
            _, _, mean, rstd = norm._forward(x, None, w, None if rms else b, 1e-5, 0.0, rms, torch.float32)
            got = backward(dy, dh, x, w, not rms, mean, rstd, rms, cfg)
            want = norm._backward(dy, dh, x, w, not rms, mean, rstd, 0.0, rms, torch.float32,
                                  {**norm.BACKWARD_LONG, "BLOCK": 64})
            for g, r in zip(got, want):
                if r is not None:
                    # relative to max(|r|, 1): at N = 1 dx is a cancellation near 0 (1e-6)
                    err = ((g - r).abs().max() / r.abs().max().clamp_min(1.0)).item()
                    assert err < 1e-4, f"rms={rms} M={M} N={N}: relative error {err}"
            assert torch.equal(backward(dy, dh, x, w, not rms, mean, rstd, rms, cfg)[1], got[1])
    print(f"{name} backward matches the long plan ({device})", flush=True)


def check(device):
    cases = [(M, N, {"BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 3})
             for M, N, block in ((13, 300, 64), (5, 1000, 256), (3, 4097, 1024), (9, 33, 64), (2, 1, 64))]
    check_against_long("groups", backward, cases, device)


def time_against_long(check, name, configs, plan):
    """After check(device): per long-row size, RMSNorm and LayerNorm, the library's long plan
    and plan(dy, x, w, has_bias, mean, rstd, rms, cfg) for each cfg, as fractions of copy."""
    for N, M, copy_bw in long_rows(check):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        for rms in (True, False):
            _, _, mean, rstd = norm._forward(x, None, w, None if rms else w, 1e-6, 0.0, rms, x.dtype)
            runs = {"long": lambda: norm._backward(dy, None, x, w, not rms, mean, rstd, 0.0, rms, x.dtype)}
            for cfg in configs:
                runs[f"{name} {cfg}"] = lambda cfg=cfg: plan(dy, x, w, not rms, mean, rstd, rms, cfg)
            for label, fn in runs.items():
                print_fraction(f"N={N} {'rms' if rms else 'layer'} {label}", fn, 3 * x.numel() * 2, copy_bw)


def main():
    configs = [{"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
               for block, warps, per_sm in ((2048, 4, 4), (4096, 8, 2), (8192, 16, 1))]
    time_against_long(check, "groups", configs, lambda dy, *rest: backward(dy, None, *rest))


if __name__ == "__main__":
    main()
