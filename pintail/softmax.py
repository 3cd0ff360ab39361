"""softmax and log_softmax along any dim: Triton kernels, launch heuristics, autograd,
and torch.library registration.

Bytes per element (the floor): forward reads x and writes y; backward reads y and dy and
writes dx. Every kernel here moves each of those once through HBM.

Two plans, picked by row length N:
- rows: N fits on chip. A program loads a tile of whole rows into registers, reduces,
  and writes; one read, one write, one exp per element.
- split: N is too long for one program. The row is cut into slices, one program each.
  Every program reads its slice and publishes a partial (max, sum) for it; the last
  program of a row to arrive (an atomic counter says which) combines the partials and
  writes the whole row, re-reading x from L2, where its peers left it moments ago. No
  program ever waits for another, so this runs in the interpreter too (where programs
  run one after another) and cannot deadlock on the GPU.
"""

import torch
import triton
import triton.language as tl

from . import reference
from ._launch import KERNEL_DTYPES, as_rows, canonical_dim, empty_like_rows, runs_kernels

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------- forward


@triton.jit
def _forward_rows_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride,
                         LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One tile of BLOCK_M whole rows: read once, reduce in registers, write once.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=-float("inf")).to(tl.float32)
    row_max = tl.max(x, axis=1)
    e = tl.exp2((x - row_max[:, None]) * 1.4426950408889634)
    total = tl.sum(e, axis=1)
    if LOG:
        y = (x - row_max[:, None]) - tl.log(total)[:, None]  # x - max first: exact, no cancellation
    else:
        y = e * (1.0 / total)[:, None]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_split_kernel(x_ptr, y_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
                          N, x_row_stride, y_row_stride, SLICES,
                          LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // SLICES
    x_row = x_ptr + row.to(tl.int64) * x_row_stride
    y_row = y_ptr + row.to(tl.int64) * y_row_stride

    # 1. This program's slice: its max and its sum of exp(x - max).
    cols = (pid % SLICES) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
    slice_max = tl.max(x, axis=0)
    # A slice of -inf alone has sum 0 (not exp(-inf - -inf) = nan).
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    slice_sum = tl.sum(tl.exp2((x - shift) * 1.4426950408889634), axis=0)
    tl.store(part_max_ptr + pid, slice_max)
    tl.store(part_sum_ptr + pid, slice_sum)

    # 2. Arrive. The atomic is acq_rel: it publishes this partial, and the last arrival
    #    sees every peer's.
    arrived = tl.atomic_add(arrivals_ptr + row, 1)
    if arrived == SLICES - 1:
        # 3. Last to arrive: log-sum-exp of the row from the partials, then the whole row.
        k = tl.arange(0, SLICES_POW2)
        first = row * SLICES
        maxes = tl.load(part_max_ptr + first + k, mask=k < SLICES, other=-float("inf"),
                        cache_modifier=".cg")
        sums = tl.load(part_sum_ptr + first + k, mask=k < SLICES, other=0.0, cache_modifier=".cg")
        row_max = tl.max(maxes, axis=0)
        total = tl.sum(sums * tl.exp2((maxes - row_max) * 1.4426950408889634), axis=0)
        # y = x - max - log(total) or its exp; x - max first, as it is exact
        log2_total = tl.log2(total)
        for start in range(0, N, BLOCK):
            c = start + tl.arange(0, BLOCK)
            xc = tl.load(x_row + c, mask=c < N, other=0.0).to(tl.float32) - row_max
            if LOG:
                y = xc - log2_total * 0.6931471805599453
            else:
                y = tl.exp2(xc * 1.4426950408889634 - log2_total)
            tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < N)


# ---------------------------------------------------------------------------- backward
# softmax:     dx = y * (dy - sum(y * dy))
# log_softmax: dx = dy - exp(y) * sum(dy)


@triton.jit
def _backward_rows_kernel(y_ptr, dy_ptr, dx_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                          LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    y = tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOG:
        dx = dy - tl.exp2(y * 1.4426950408889634) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_split_kernel(y_ptr, dy_ptr, dx_ptr, part_ptr, arrivals_ptr,
                           N, y_row_stride, dy_row_stride, dx_row_stride, SLICES,
                           LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Same plan as the forward split kernel, with one partial sum per slice.
    pid = tl.program_id(0)
    row = pid // SLICES
    y_row = y_ptr + row.to(tl.int64) * y_row_stride
    dy_row = dy_ptr + row.to(tl.int64) * dy_row_stride
    dx_row = dx_ptr + row.to(tl.int64) * dx_row_stride

    cols = (pid % SLICES) * BLOCK + tl.arange(0, BLOCK)
    dy = tl.load(dy_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    if LOG:
        part = tl.sum(dy, axis=0)
    else:
        y = tl.load(y_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        part = tl.sum(y * dy, axis=0)
    tl.store(part_ptr + pid, part)

    arrived = tl.atomic_add(arrivals_ptr + row, 1)
    if arrived == SLICES - 1:
        k = tl.arange(0, SLICES_POW2)
        total = tl.sum(tl.load(part_ptr + row * SLICES + k, mask=k < SLICES, other=0.0,
                               cache_modifier=".cg"), axis=0)
        for start in range(0, N, BLOCK):
            c = start + tl.arange(0, BLOCK)
            yc = tl.load(y_row + c, mask=c < N, other=0.0).to(tl.float32)
            dyc = tl.load(dy_row + c, mask=c < N, other=0.0).to(tl.float32)
            if LOG:
                dx = dyc - tl.exp2(yc * 1.4426950408889634) * total
            else:
                dx = yc * (dyc - total)
            tl.store(dx_row + c, dx.to(dx_ptr.dtype.element_ty), mask=c < N)


# ------------------------------------------------------------------ launch heuristics
# Measured on the H200, bf16 (docs/perf-notes.md). Rows up to ROWS_MAX_N stay on chip;
# longer rows take the split plan.
FORWARD_ROWS_MAX_N = 16384
BACKWARD_ROWS_MAX_N = 16384
# (tile elements up to, warps) for the rows plan
ROWS_WARPS = [(1024, 4), (8192, 8), (16384, 16), (float("inf"), 32)]
ROWS_TILE = 4096  # at least this many elements per program, so short rows come in tiles
SPLIT_BLOCK = 8192
SPLIT_WARPS = 8


def _rows_config(N):
    block_n = triton.next_power_of_2(N)
    block_m = max(1, ROWS_TILE // block_n)
    warps = next(w for limit, w in ROWS_WARPS if block_m * block_n <= limit)
    return {"plan": "rows", "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps}


def _split_config(N):
    return {"plan": "split", "BLOCK": SPLIT_BLOCK, "num_warps": SPLIT_WARPS}


def forward_config(N):
    return _rows_config(N) if N <= FORWARD_ROWS_MAX_N else _split_config(N)


def backward_config(N):
    return _rows_config(N) if N <= BACKWARD_ROWS_MAX_N else _split_config(N)


def _arrivals_and_slices(M, N, block, device):
    slices = triton.cdiv(N, block)
    return torch.zeros(M, dtype=torch.int32, device=device), slices


def launch_forward(x, y, log, config=None):
    """y[M, N] = (log_)softmax(x[M, N]) along rows; both have unit column stride."""
    M, N = x.shape
    cfg = config or forward_config(N)
    if cfg["plan"] == "rows":
        grid = (triton.cdiv(M, cfg["BLOCK_M"]),)
        _forward_rows_kernel[grid](x, y, M, N, x.stride(0), y.stride(0), LOG=log,
                                   BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                   num_warps=cfg["num_warps"])
    else:
        arrivals, slices = _arrivals_and_slices(M, N, cfg["BLOCK"], x.device)
        part_max = torch.empty(M * slices, dtype=torch.float32, device=x.device)
        part_sum = torch.empty_like(part_max)
        _forward_split_kernel[(M * slices,)](
            x, y, part_max, part_sum, arrivals, N, x.stride(0), y.stride(0), slices, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])


def launch_backward(y, dy, dx, log, config=None):
    """dx[M, N] from y and dy along rows; all three have unit column stride."""
    M, N = y.shape
    cfg = config or backward_config(N)
    if cfg["plan"] == "rows":
        grid = (triton.cdiv(M, cfg["BLOCK_M"]),)
        _backward_rows_kernel[grid](y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0), LOG=log,
                                    BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                    num_warps=cfg["num_warps"])
    else:
        arrivals, slices = _arrivals_and_slices(M, N, cfg["BLOCK"], y.device)
        part = torch.empty(M * slices, dtype=torch.float32, device=y.device)
        _backward_split_kernel[(M * slices,)](
            y, dy, dx, part, arrivals, N, y.stride(0), dy.stride(0), dx.stride(0), slices, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])


# ------------------------------------------------------------------------ custom ops


def _kernels_take(*dtypes):
    return all(d in KERNEL_DTYPES for d in dtypes)


@torch.library.custom_op("pintail::softmax_forward", mutates_args=())
def _softmax_forward(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    if not (runs_kernels(x) and _kernels_take(x.dtype, out_dtype)):
        return reference.softmax_forward(x, dim, log, out_dtype)
    y = empty_like_rows(x, dim, out_dtype)
    if x.numel() > 0:
        launch_forward(as_rows(x, dim), as_rows(y, dim), log)
    return y


@_softmax_forward.register_fake
def _(x, dim, log, out_dtype):
    return empty_like_rows(x, dim, out_dtype)


@torch.library.custom_op("pintail::softmax_backward", mutates_args=())
def _softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool,
                      in_dtype: torch.dtype) -> torch.Tensor:
    if not (runs_kernels(y) and _kernels_take(y.dtype, in_dtype)):
        return reference.softmax_backward(y, dy, dim, log, in_dtype)
    dx = empty_like_rows(y, dim, in_dtype)
    if y.numel() > 0:
        launch_backward(as_rows(y, dim), as_rows(dy.to(y.dtype), dim), as_rows(dx, dim), log)
    return dx


@_softmax_backward.register_fake
def _(y, dy, dim, log, in_dtype):
    return empty_like_rows(y, dim, in_dtype)


def _setup_context(ctx, inputs, output):
    x, dim, log, _ = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype


def _backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return _softmax_backward(y, dy, ctx.dim, ctx.log, ctx.in_dtype), None, None, None


_softmax_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------ public API


def _checked(name, input, dim, dtype):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"pintail.{name}: input must be a torch.Tensor, got {type(input).__name__}")
    if dim is None:
        raise TypeError(f"pintail.{name}: dim must be an int, got None (implicit dim choice is "
                        "deprecated in torch; pass dim explicitly)")
    dim = canonical_dim(int(dim), input.dim())
    if dtype is not None:
        if not dtype.is_floating_point:
            raise TypeError(f"pintail.{name}: dtype must be a floating point dtype, got {dtype}")
        if not input.dtype.is_floating_point:
            input = input.to(dtype)  # torch casts first, then computes in dtype
    elif not input.dtype.is_floating_point:
        raise NotImplementedError(
            f"pintail.{name}: input has dtype {input.dtype}, expected a floating point dtype "
            f"(or pass dtype=torch.float32 to compute in float, as torch does)")
    return input, dim, dtype or input.dtype


def softmax(input, dim=-1, dtype=None):
    """torch.nn.functional.softmax(input, dim, dtype=dtype), with Triton kernels on CUDA."""
    input, dim, out_dtype = _checked("softmax", input, dim, dtype)
    return _softmax_forward(input, dim, False, out_dtype)


def log_softmax(input, dim=-1, dtype=None):
    """torch.nn.functional.log_softmax(input, dim, dtype=dtype), with Triton kernels on CUDA."""
    input, dim, out_dtype = _checked("log_softmax", input, dim, dtype)
    return _softmax_forward(input, dim, True, out_dtype)
