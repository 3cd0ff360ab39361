"""softmax: argument checks, launch by plan, autograd and the torch.library ops with their fakes."""

import torch

from .. import reference
from .._core import cluster, split
from .._core.dtensor import is_dtensor, local_rows
from .._core.launch import (
    KERNEL_DTYPES,
    as_rows,
    canonical_dim,
    cdiv,
    empty_like_rows,
    launch,
    multiprocessors,
    next_power_of_2,
    no_second_derivative,
    packs_into_words,
    row_alignment,
    runs_kernels,
    whole_tiles,
)
from . import plans
from .kernels import (
    _backward_cluster_kernel,
    _backward_own_row_kernel,
    _backward_row_shift_kernel,
    _backward_rows_kernel,
    _backward_split_kernel,
    _forward_cluster_kernel,
    _forward_packed_kernel,
    _forward_row_shift_kernel,
    _forward_rows_kernel,
    _forward_split_kernel,
    _forward_two_pass_kernel,
)


def _launch_row_shift(kernel, M, N, cfg, *tensors, LOG):
    """One row a program of `kernel` (a row-shift kernel) over the rows of `tensors`."""
    launch(kernel, (M,), *tensors, M, N, *(t.stride(0) for t in tensors), LOG=LOG, BLOCK=cfg["BLOCK"],
           SHIFT=cfg["SHIFT"], num_warps=cfg["num_warps"])


def planned_forward(x, y, log):
    """The forward's plan for these tensors: plans.forward_config's, or the row-shift plan where the
    rows plan's lengths have starts no vector width divides."""
    N = x.shape[1]
    cfg = plans.forward_config(N, log, x.element_size(), packs_into_words(N, (x, y)), cluster.available(x.device),
                         _whole_vectors(N, x, y))
    if cfg["plan"] == "rows":
        cfg = plans._row_shift_config(N, "forward", log, x, y) or cfg
    return cfg


def _whole_vectors(N, *rows):
    """Whether rows of N elements of `rows` are whole 16-byte vectors: N and every row stride
    a multiple of the vector, every tensor starting on one."""
    vec = 16 // rows[0].element_size()
    return N % vec == 0 and all(t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0 for t in rows)


def planned_backward(y, dy, dx, log):
    """The backward's plan for these tensors (as planned_forward; log_softmax's part-filled
    cluster rows too, plans.PART_FILLED_CLUSTER_TILE)."""
    N = y.shape[1]
    cfg = plans.backward_config(N, log, y.element_size(), cluster.available(y.device))
    if cfg["plan"] == "rows" or (log and N < plans.PART_FILLED_CLUSTER_TILE):
        cfg = plans._row_shift_config(N, "backward", log, y, dy, dx) or cfg
    return cfg


def launch_forward(x, y, log, config=None):
    """y[M, N] = (log_)softmax(x[M, N]) along rows; both have unit column stride."""
    M, N = x.shape
    cfg = config or planned_forward(x, y, log)
    align = row_alignment(N, x.stride(0), y.stride(0))  # the rows, two-pass and split kernels' ALIGN
    if cfg["plan"] == "rows":
        grid = (cdiv(M, cfg["BLOCK_M"]),)
        launch(_forward_rows_kernel, grid, x, y, M, N, x.stride(0), y.stride(0), LOG=log,
               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TAIL=cfg.get("TAIL", 0), EVEN=whole_tiles(M, N, cfg),
               ALIGN=align, num_warps=cfg["num_warps"])
    elif cfg["plan"] == "row_shift":
        _launch_row_shift(_forward_row_shift_kernel, M, N, cfg, x, y, LOG=log)
    elif cfg["plan"] == "packed":
        launch(_forward_packed_kernel, (M,), x, y, N, x.stride(0), y.stride(0), 0, LOG=log,
               BF16=x.dtype == torch.bfloat16, BLOCK=min(cfg["BLOCK"], next_power_of_2(N)),
               num_warps=cfg["num_warps"])
    elif cfg["plan"] == "cluster":
        _launch_cluster_forward(x, y, cfg, log, align)
    elif cfg["plan"] == "two_pass":
        launch(_forward_two_pass_kernel, (M,), x, y, N, x.stride(0), y.stride(0), 0, LOG=log, BLOCK=cfg["BLOCK"],
               ALIGN=align, num_warps=cfg["num_warps"])
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
        launch(
            _forward_split_kernel, grid,
            x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=next_power_of_2(slices), ALIGN=align, num_warps=cfg["num_warps"])


def _launch_cluster_forward(x, y, cfg, log, align):
    """The cluster plan on rows of x, the last plans.side_rows of them (plans.SIDE_ROWS) by the two-pass
    kernel on the SMs the clusters leave idle."""
    M, N = x.shape
    ctas, shift = cluster.window(N, cfg["BLOCK"], x, y)
    args = (x, y, M, N, x.stride(0), y.stride(0), 0, 1)
    kwargs = dict(LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas),
                  PERSISTENT=cfg["PERSISTENT"], LATE_WAIT=cfg.get("LATE_WAIT", False), SHIFT=shift,
                  num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg"))
    side = 0
    if cfg.get("SIDE_ROWS"):
        key = (x.device.index, x.dtype, y.dtype, log, cfg["BLOCK"], ctas, shift)
        fit = _CLUSTERS_FIT.get(key)
        if fit is None:  # the occupancy query's clusters and the SMs, once (host time: ~20 us a call)
            clusters = cluster.clusters_for(_forward_cluster_kernel, 2**31, ctas, *args, **kwargs)
            fit = _CLUSTERS_FIT[key] = (clusters, multiprocessors(x.device.index))
        side = plans.side_rows(M, min(fit[0], M), ctas, fit[1])
    cluster.launch(_forward_cluster_kernel, M - side, ctas, x, y, M - side, *args[3:], **kwargs)
    if side:
        launch(_forward_two_pass_kernel, (side,), x, y, N, x.stride(0), y.stride(0), M - side, LOG=log, ALIGN=align,
               AFTER_CLUSTERS=True, launch_pdl=True, **plans.SIDE_ROWS)


_CLUSTERS_FIT = {}  # (device, dtypes, log, slice, CTAs, shift) -> (clusters that fit, SMs)


def launch_backward(y, dy, dx, log, config=None):
    """dx[M, N] from y and dy along rows; all three have unit column stride."""
    M, N = y.shape
    cfg = config or planned_backward(y, dy, dx, log)
    align = row_alignment(N, y.stride(0), dy.stride(0), dx.stride(0))  # the rows, own-row and split kernels' ALIGN
    if cfg["plan"] == "rows":
        grid = (cdiv(M, cfg["BLOCK_M"]),)
        launch(_backward_rows_kernel, grid, y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0), LOG=log,
               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], ALIGN=align, num_warps=cfg["num_warps"])
    elif cfg["plan"] == "row_shift":
        _launch_row_shift(_backward_row_shift_kernel, M, N, cfg, y, dy, dx, LOG=log)
    elif cfg["plan"] == "cluster":
        ctas, shift = cluster.window(N, cfg["BLOCK"], y, dy, dx)
        cluster.launch(_backward_cluster_kernel, M, ctas, y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0),
                       0, 1, LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas),
                       PERSISTENT=cfg["PERSISTENT"], SHIFT=shift, num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg"))
    elif cfg["plan"] == "own_row":
        block, slices, grid, slots = split.own_row_plan(M, N, cfg, y.device)
        launch(_backward_own_row_kernel, grid, y, dy, dx, slots, M, N, y.stride(0), dy.stride(0), dx.stride(0),
               slices, LOG=log, BLOCK=block, SLICES_POW2=next_power_of_2(slices), ALIGN=align,
               num_warps=cfg["num_warps"])
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, y.device)
        launch(
            _backward_split_kernel, grid,
            y, dy, dx, slots, M, N, y.stride(0), dy.stride(0), dx.stride(0), slices, lag, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=next_power_of_2(slices), ALIGN=align, num_warps=cfg["num_warps"])


# --------------------------------------------------------------- tensor-level functions


def _kernels_take(*dtypes):
    return all(d in KERNEL_DTYPES for d in dtypes)


def _forward(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    y = empty_like_rows(x, dim, out_dtype)
    if not (runs_kernels(x) and _kernels_take(x.dtype, out_dtype)):
        return y.copy_(reference.softmax_forward(x, dim, log, out_dtype))
    if x.numel() > 0:
        launch_forward(as_rows(x, dim), as_rows(y, dim), log)
    return y


def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool, in_dtype: torch.dtype) -> torch.Tensor:
    dx = empty_like_rows(y, dim, in_dtype)
    if not (runs_kernels(y) and _kernels_take(y.dtype, in_dtype)):
        return dx.copy_(reference.softmax_backward(y, dy, dim, log, in_dtype))
    if y.numel() > 0:
        launch_backward(as_rows(y, dim), as_rows(dy.to(y.dtype), dim), as_rows(dx, dim), log)
    return dx


# ------------------------------------------------------------- autograd and torch.library
# Eager calls take a plain autograd.Function: torch.library's custom-op dispatch costs about
# 70 us of host time a call, more than the
# kernel itself at some sizes. Under torch.compile the same functions are reached as custom
# ops with fake implementations: one graph node each, no graph break.


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log, out_dtype):
        y = _forward(x, dim, log, out_dtype)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return no_second_derivative((_backward(y, dy, ctx.dim, ctx.log, ctx.in_dtype), None, None, None), y, dy)


_forward_op = torch.library.custom_op("pintail::softmax_forward", _forward, mutates_args=())
_backward_op = torch.library.custom_op("pintail::softmax_backward", _backward, mutates_args=())


@_forward_op.register_fake
def _softmax_forward_fake(x, dim, log, out_dtype):
    """x's shape in out_dtype, each row along dim contiguous (empty_like_rows), on every path."""
    return empty_like_rows(x, dim, out_dtype)


@_backward_op.register_fake
def _softmax_backward_fake(y, dy, dim, log, in_dtype):
    """y's shape in in_dtype, each row along dim contiguous (empty_like_rows)."""
    return empty_like_rows(y, dim, in_dtype)


def _setup_context(ctx, inputs, output):
    x, dim, log, _ = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype


def _backward_of_op(ctx, dy):
    (y,) = ctx.saved_tensors
    return _backward_op(y, dy, ctx.dim, ctx.log, ctx.in_dtype), None, None, None


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


def _softmax(x, dim, log, out_dtype):
    if torch.compiler.is_compiling():
        return _forward_op(x, dim, log, out_dtype)
    return _Softmax.apply(x, dim, log, out_dtype)


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
    if is_dtensor(input):  # each rank's rows, where dim is whole on it
        return local_rows("pintail.softmax", lambda x: softmax(x, dim, dtype), input, [dim])
    input, dim, out_dtype = _checked("softmax", input, dim, dtype)
    return _softmax(input, dim, False, out_dtype)


def log_softmax(input, dim=-1, dtype=None):
    """torch.nn.functional.log_softmax(input, dim, dtype=dtype), with Triton kernels on CUDA."""
    if is_dtensor(input):
        return local_rows("pintail.log_softmax", lambda x: log_softmax(x, dim, dtype), input, [dim])
    input, dim, out_dtype = _checked("log_softmax", input, dim, dtype)
    return _softmax(input, dim, True, out_dtype)
