"""norm: argument checks, launch by plan, autograd and the torch.library ops with their fakes."""


import torch

from .. import reference
from .._core import cluster, split
from .._core.dtensor import is_dtensor, local_rows
from .._core.launch import (
    INTERPRET,
    KERNEL_DTYPES,
    cdiv,
    launch,
    next_power_of_2,
    no_second_derivative,
    packs_into_words,
    program_slots,
    row_alignment,
    runs_kernels,
    unit_stride,
    whole_tiles,
)
from . import plans
from .kernels_backward import (
    _backward_blocks_kernel,
    _backward_chunks_kernel,
    _backward_cluster_kernel,
    _backward_rows_kernel,
    _row_sums_kernel,
    _sum_partials_kernel,
)
from .kernels_forward import (
    _forward_cluster_kernel,
    _forward_long_kernel,
    _forward_packed_kernel,
    _forward_rows_kernel,
    _forward_split_kernel,
)

# --------------------------------------------------------------- tensor-level functions


def _kernels_take(x, residual, out_dtype):
    """The kernels take 16- and 32-bit rows; float64 anywhere goes to torch, in float64."""
    return x.dtype in KERNEL_DTYPES and out_dtype in KERNEL_DTYPES and (residual is None
                                                                         or residual.dtype in KERNEL_DTYPES)


def _stats_dtype(held_dtype):
    """mean / rstd (and the weight's and bias's gradient sums): float32, float64 for float64 rows."""
    return torch.promote_types(held_dtype, torch.float32)


def _forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
             bias: torch.Tensor | None, eps: float, weight_offset: float, rms: bool, out_dtype: torch.dtype,
             config: dict | None = None, stats: bool = True
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, h, mean, rstd) for rows x[M, N]; h = x + residual (empty without residual); mean
    is empty for RMS. stats=False (no backward will run): mean and rstd come back empty, and
    the rows and long plans do not store them."""
    if not (runs_kernels(x) and _kernels_take(x, residual, out_dtype)):
        y, h, mean, rstd = reference.norm_forward(x, residual, weight, bias, eps, weight_offset, rms, out_dtype)
        return (y, h, mean, rstd) if stats else (y, h, mean.new_empty(0), rstd.new_empty(0))
    M, N = x.shape
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    h = torch.empty(M if residual is not None else 0, N, device=x.device,
                    dtype=torch.promote_types(x.dtype, residual.dtype) if residual is not None else out_dtype)
    narrow = (bias is None and all(t.element_size() == 2 for t in (x, y, weight) if t is not None)
              and not any(size % 8 for size in (N, x.stride(0), y.stride(0))))
    packable = residual is None and packs_into_words(N, (x, y), (weight, bias))
    held = h if residual is not None else x  # the row normalised: bf16 rows take plans.FORWARD_CLUSTER_BF16
    cfg = config or plans.forward_config(N, rms, residual is not None, narrow, packable, cluster.available(x.device),
                                   held.dtype == torch.bfloat16)
    stored = stats or cfg["plan"] == "split"  # the split kernel stores them always (its rows are few)
    mean = torch.empty(0 if rms or not stored else M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M if stored else 0, dtype=torch.float32, device=x.device)
    if not (M and N):
        return y, h, mean, rstd
    args = (x, residual if residual is not None else x, h, weight if weight is not None else x,
            bias if bias is not None else x, y, mean, rstd)
    strides = (x.stride(0), residual.stride(0) if residual is not None else 0,
               h.stride(0) if residual is not None else 0, y.stride(0), eps, weight_offset)
    flags = dict(RMS=rms, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                 num_warps=cfg["num_warps"])
    align = row_alignment(N, *strides[:4])
    if cfg["plan"] == "rows":
        launch(_forward_rows_kernel, (cdiv(M, cfg["BLOCK_M"]),), *args, M, N, 1.0 / N, *strides, **flags,
               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TAIL=cfg.get("TAIL", 0), EVEN=whole_tiles(M, N, cfg),
               ALIGN=align, STATS=stats)
    elif cfg["plan"] == "packed":
        block = min(cfg["BLOCK"], next_power_of_2(N))
        launch(_forward_packed_kernel, (M,), x, args[3], args[4], y, mean, rstd, N, 1.0 / N, x.stride(0), y.stride(0),
               eps, 0, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BF16=x.dtype == torch.bfloat16,
               BLOCK=block, PARTS=min(cfg["PARTS"], block // 2), EVEN=N == block, STATS=stats,
               num_warps=cfg["num_warps"])
    elif cfg["plan"] == "long":
        block = min(cfg["BLOCK"], next_power_of_2(N))
        cap = {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}
        launch(_forward_long_kernel, (M,), *args, N, 1.0 / N, *strides, **flags, **cap,
               BLOCK=block, ONE_CHUNK=block >= N, EVEN=N % block == 0, ALIGN=align, STATS=stats)
    elif cfg["plan"] == "cluster":
        ctas = cdiv(N, cfg["BLOCK"])
        cluster.launch(_forward_cluster_kernel, M, ctas, *args, M, N, 1.0 / N, *strides, 0, 1, **flags, STATS=stats,
                       BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas), ALIGN=align,
                       BF16_HELD=held.dtype == torch.bfloat16 and cfg.get("HELD", not rms),
                       AHEAD=cfg.get("AHEAD", False), maxnreg=cfg.get("maxnreg"))
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
        launch(_forward_split_kernel, grid, *args, slots, M, N, 1.0 / N, *strides, slices, lag, **flags,
               BLOCK=cfg["BLOCK"], SLICES_POW2=next_power_of_2(slices), ALIGN=align)
    return (y, h, mean, rstd) if stats else (y, h, mean.new_empty(0), rstd.new_empty(0))


def _backward(dy: torch.Tensor, dh: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
              has_bias: bool, mean: torch.Tensor, rstd: torch.Tensor, weight_offset: float, rms: bool,
              x_dtype: torch.dtype, config: dict | None = None, *, dweight_dtype: torch.dtype | None = None,
              dbias_dtype: torch.dtype | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias) for rows: x[M, N] is the normalised input (h with a residual).
    dweight / dbias come in the dtypes asked for (default: float32, the sums' own)."""
    if not (runs_kernels(x) and x.dtype in KERNEL_DTYPES and dy.dtype in KERNEL_DTYPES):
        dx, dw, db = reference.norm_backward(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms, x_dtype)
        return dx, _cast(dw, dweight_dtype), _cast(db, dbias_dtype)
    M, N = x.shape
    dweight_dtype, dbias_dtype = dweight_dtype or torch.float32, dbias_dtype or torch.float32
    dx = torch.empty(M, N, dtype=x_dtype, device=x.device)
    if not (M and N):
        return (dx, torch.zeros(N, dtype=dweight_dtype, device=x.device) if weight is not None else None,
                torch.zeros(N, dtype=dbias_dtype, device=x.device) if has_bias else None)
    for grad in (dy, dh):  # the kernels read (M, N) rows with unit feature stride
        if grad is not None and (grad.shape != x.shape or grad.stride(-1) != 1):
            raise ValueError(f"norm backward: a gradient of shape {tuple(grad.shape)}, strides {grad.stride()}; "
                             f"expected ({M}, {N}) rows with unit feature stride")
    cfg = config or plans.backward_config(N, rms, dh is not None, cluster.available(x.device))
    if cfg["plan"] == "blocks":
        # The interpreter runs one program at a time, which cannot meet another: a slice per row.
        block = cfg["BLOCK"] if not INTERPRET else next_power_of_2(N)
        slices = cdiv(N, block)
        programs = program_slots(x.device, cfg["PROGRAMS_PER_SM"])
        # A row's slices wait for each other, so they must all run at once. A GPU holds at
        # least one program per SM whatever the kernel's registers (with a residual's
        # gradient and a bias it takes 166: 3 per SM, not the 4 the grid counts on).
        if slices > program_slots(x.device, 1):
            cfg = plans.BACKWARD_LONG
    strides = (x.stride(0), dy.stride(0), dh.stride(0) if dh is not None else 0, dx.stride(0), weight_offset)
    align = row_alignment(N, *strides[:4])
    if cfg["plan"] == "cluster":
        return _backward_across_cluster(dy, dh, x, weight, has_bias, mean, rstd, rms, cfg, dx, strides, align,
                                        dweight_dtype, dbias_dtype)
    if cfg["plan"] == "rows":
        block = cfg["BLOCK_N"]
        parts = max(1, min(cdiv(M, cfg["BLOCK_M"]), program_slots(x.device, cfg["PROGRAMS_PER_SM"])))
    elif cfg["plan"] == "blocks":
        parts = cdiv(M, cfg["ROWS"])
    else:
        block = min(cfg["BLOCK"], next_power_of_2(N))
        chunks = cdiv(N, block)
        parts = max(1, min(M, program_slots(x.device, cfg["PROGRAMS_PER_SM"]) // chunks))
    dw = torch.empty(parts, N, dtype=torch.float32, device=x.device) if weight is not None else None
    db = torch.empty(parts, N, dtype=torch.float32, device=x.device) if has_bias else None
    outputs = (dx, dw if dw is not None else rstd, db if db is not None else rstd)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, HAS_DH=dh is not None, ALIGN=align,
                 num_warps=cfg["num_warps"])
    w = weight if weight is not None else x
    dh_or_dy = dh if dh is not None else dy
    if cfg["plan"] == "rows":
        tail = cfg.get("TAIL", 0)
        launch(_backward_rows_kernel, (parts,), x, w, dy, dh_or_dy, mean, rstd, *outputs, M, N, 1.0 / N, *strides,
               RMS=rms, **flags, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=block, TAIL=tail, EVEN=N == block + tail)
    elif cfg["plan"] == "blocks":
        slots = torch.zeros(1 + M * slices, dtype=torch.int64, device=x.device)  # next ticket, a word per slice
        launch(_backward_blocks_kernel, (min(programs, parts * slices),), x, w, dy, dh_or_dy, rstd, slots, *outputs,
               M, N, 1.0 / N, slices, *strides, **flags, ROWS=cfg["ROWS"], BLOCK=block,
               SLICES_POW2=next_power_of_2(slices), EVEN=N % block == 0)
    else:
        sums = mean  # any pointer: read only when a row spans several chunks
        if chunks > 1:
            sums = torch.empty(2 * M, dtype=torch.float32, device=x.device)
            launch(_row_sums_kernel, (M,), x, w, dy, mean, rstd, sums, N, 1.0 / N, x.stride(0), dy.stride(0),
                   weight_offset, RMS=rms, HAS_WEIGHT=weight is not None, BLOCK=block, EVEN=N % block == 0,
                   ALIGN=align, num_warps=cfg["num_warps"])
        launch(_backward_chunks_kernel, (parts, chunks), x, w, dy, dh_or_dy, mean, rstd, sums, *outputs, M, N,
               1.0 / N, cdiv(M, parts), *strides, RMS=rms, **flags, ONE_CHUNK=chunks == 1, BLOCK=block,
               EVEN=N % block == 0)
    return (dx, *_sum_partials(dw, db, dweight_dtype, dbias_dtype))


def _backward_across_cluster(dy, dh, x, weight, has_bias, mean, rstd, rms, cfg, dx, strides, align, dweight_dtype,
                             dbias_dtype):
    """The cluster plan of _backward (its row strides and weight_offset, its ALIGN): one
    partial row of dweight / dbias a cluster, so the clusters are counted before those rows
    are made."""
    M, N = x.shape
    ctas = cdiv(N, cfg["BLOCK"])
    w = weight if weight is not None else x
    dh_or_dy = dh if dh is not None else dy

    def args(dw, db):
        return (x, w, dy, dh_or_dy, mean if mean.numel() else rstd, rstd, dx, dw, db, M, N, 1.0 / N, *strides, 0, 1)

    flags = dict(RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, HAS_DH=dh is not None, BLOCK=cfg["BLOCK"],
                 CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas), AHEAD=cfg["AHEAD"], ALIGN=align,
                 num_warps=cfg["num_warps"])
    # rstd stands in for the partial rows while counting: float32, and aligned as they will be
    parts = cluster.clusters_for(_backward_cluster_kernel, M, ctas, *args(rstd, rstd), **flags)
    dw = torch.empty(parts, N, dtype=torch.float32, device=x.device) if weight is not None else None
    db = torch.empty(parts, N, dtype=torch.float32, device=x.device) if has_bias else None
    cluster.launch(_backward_cluster_kernel, M, ctas, *args(dw if dw is not None else rstd,
                                                            db if db is not None else rstd), **flags)
    return (dx, *_sum_partials(dw, db, dweight_dtype, dbias_dtype))


def _sum_partials(dw_parts, db_parts, dweight_dtype, dbias_dtype):
    """dweight and dbias (or None) from their float32 partial rows, in one launch."""
    parts = dw_parts if dw_parts is not None else db_parts
    if parts is None:
        return None, None
    N = parts.shape[1]
    dw = torch.empty(N, dtype=dweight_dtype, device=parts.device) if dw_parts is not None else None
    db = torch.empty(N, dtype=dbias_dtype, device=parts.device) if db_parts is not None else None
    cfg = _sum_partials_config(parts.shape[0], N)
    launch(_sum_partials_kernel, (cdiv(N, cfg["BLOCK_N"]),), parts, db_parts if db_parts is not None else parts,
           dw if dw is not None else db, db if db is not None else dw, parts.shape[0], N,
           HAS_WEIGHT=dw_parts is not None, HAS_BIAS=db_parts is not None, **cfg)
    return dw, db


def _sum_partials_config(parts, N):
    """_sum_partials_kernel's launch for `parts` partial rows of N (plans.SUM_PARTIALS)."""
    if parts > plans.SUM_PARTIALS["PARTS_BLOCK"]:  # every partial in one step (up to MAX_PARTS_BLOCK)
        step = min(plans.SUM_PARTIALS["MAX_PARTS_BLOCK"], next_power_of_2(parts))
        return {"PARTS_BLOCK": step, "BLOCK_N": plans.SUM_PARTIALS["MIN_BLOCK_N"], "num_warps": 4 if step <= 128 else 8}
    # few partials (long rows): one step of them all, and as many columns as leave a tile of
    # ~TILE values, at least PROGRAMS programs
    step = next_power_of_2(parts)
    block_n = min(plans.SUM_PARTIALS["TILE"] // step, next_power_of_2(cdiv(N, plans.SUM_PARTIALS["PROGRAMS"])))
    return {"PARTS_BLOCK": step, "BLOCK_N": max(plans.SUM_PARTIALS["MIN_BLOCK_N"], block_n), "num_warps": 4}


def _cast(t, dtype):
    return t.to(dtype) if t is not None and dtype is not None else t


# ------------------------------------------------------------- autograd and torch.library
# Eager calls take a plain autograd.Function (host time, as for softmax); torch.compile
# reaches the same functions as custom ops (absent gradients as empty tensors there).


def _incoming(dy, dh, normalised, has_residual):
    """The gradients reaching y and h, as rows with unit feature stride (autograd hands out
    expanded ones, e.g. of y.sum(), whose strides are 0); h exists only with a residual."""
    if dy is None:  # only h was used downstream
        dy = torch.zeros_like(normalised)
    dh = dh if has_residual else None
    return unit_stride(dy), (unit_stride(dh) if dh is not None else None)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, weight_offset, rms, out_dtype):
        y, h, mean, rstd = _forward(x, residual, weight, bias, eps, weight_offset, rms, out_dtype)
        ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
        ctx.meta = (bias is not None, weight_offset, rms)
        ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None,
                      bias.dtype if bias is not None else None)
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        normalised, weight, mean, rstd = ctx.saved_tensors
        x_dtype, residual_dtype, bias_dtype = ctx.dtypes
        dy, dh = _incoming(dy, dh, normalised, residual_dtype is not None)
        dx, dw, db = _backward(dy, dh, normalised, weight, bias_dtype is not None, mean, rstd, *ctx.meta[1:],
                               normalised.dtype, dweight_dtype=weight.dtype if weight is not None else None,
                               dbias_dtype=bias_dtype)
        grads = (dx.to(x_dtype), dx.to(residual_dtype) if residual_dtype is not None else None, dw, db,
                 None, None, None, None)
        return no_second_derivative(grads, normalised, weight, dy, dh)


def _forward_for_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
                    bias: torch.Tensor | None, eps: float, weight_offset: float, rms: bool,
                    out_dtype: torch.dtype, stats: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _forward(x, residual, weight, bias, eps, weight_offset, rms, out_dtype, stats=stats)


_forward_op = torch.library.custom_op("pintail::norm_forward", _forward_for_op, mutates_args=())


@_forward_op.register_fake
def _norm_forward_fake(x, residual, weight, bias, eps, weight_offset, rms, out_dtype, stats):
    """y: (M, N) rows in out_dtype; h: x + residual in their promoted dtype, (0, N) without a
    residual; mean (not for RMS) and rstd: one a row, only when stats, in _stats_dtype."""
    M, N = x.shape
    held = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    h = x.new_empty(M if residual is not None else 0, N, dtype=held if residual is not None else out_dtype)
    dtype = _stats_dtype(held)
    return (x.new_empty(M, N, dtype=out_dtype), h, x.new_empty(0 if rms or not stats else M, dtype=dtype),
            x.new_empty(M if stats else 0, dtype=dtype))


def _backward_for_op(dy: torch.Tensor, dh: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor | None,
                     has_bias: bool, mean: torch.Tensor, rstd: torch.Tensor, weight_offset: float,
                     rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _backward(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms, x.dtype)
    empty = x.new_empty(0, dtype=_stats_dtype(x.dtype))
    return dx, dw if dw is not None else empty, db if db is not None else empty


_backward_op = torch.library.custom_op("pintail::norm_backward", _backward_for_op, mutates_args=())


@_backward_op.register_fake
def _norm_backward_fake(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms):
    """dx: (M, N) rows in x's dtype; the weight's and bias's gradients (N, or 0 where absent)
    in _stats_dtype."""
    M, N = x.shape
    dtype = _stats_dtype(x.dtype)
    return (x.new_empty(M, N), x.new_empty(N if weight is not None else 0, dtype=dtype),
            x.new_empty(N if has_bias else 0, dtype=dtype))


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _, weight_offset, rms, _ = inputs[:8]
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.meta = (bias is not None, weight_offset, rms)
    ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None, bias.dtype if bias is not None else None)


def _backward_of_op(ctx, dy, dh, _mean, _rstd):
    normalised, weight, mean, rstd = ctx.saved_tensors
    if rstd.shape[0] != normalised.shape[0]:  # _normalise asks for them whenever a gradient is wanted
        raise RuntimeError("pintail::norm_forward ran with stats=False, which keeps no mean / rstd for a backward")
    has_bias, weight_offset, rms = ctx.meta
    x_dtype, residual_dtype, bias_dtype = ctx.dtypes
    dy, dh = _incoming(dy, dh, normalised, residual_dtype is not None)
    dx, dw, db = _backward_op(dy, dh, normalised, weight, has_bias, mean, rstd, weight_offset, rms)
    return (dx.to(x_dtype), dx.to(residual_dtype) if residual_dtype is not None else None,
            dw.to(weight.dtype) if weight is not None else None, db.to(bias_dtype) if has_bias else None,
            None, None, None, None, None)


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


# ------------------------------------------------------------------------ public API


def _normalise(name, input, normalized_shape, weight, bias, residual, eps, weight_offset, rms, out_dtype):
    if not isinstance(input, torch.Tensor) or not input.dtype.is_floating_point:
        raise TypeError(f"{name}: input must be a floating point tensor, got "
                        f"{input.dtype if isinstance(input, torch.Tensor) else type(input).__name__}")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if any(is_dtensor(t) for t in (input, weight, bias, residual)):  # tensor / sequence parallelism
        def local(x, r, w, b):
            return _normalise(name, x, shape, w, b, r, eps, weight_offset, rms, out_dtype)
        return local_rows(name, local, input, range(-len(shape), 0), [("residual", residual)],
                          [("weight", weight), ("bias", bias)])
    if not shape or tuple(input.shape[input.dim() - len(shape):]) != shape or len(shape) > input.dim():
        raise ValueError(f"{name}: normalized_shape={list(shape)} must be the trailing dims of input, "
                         f"got input of shape {list(input.shape)}")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: {label} must have shape normalized_shape={list(shape)}, got {list(t.shape)}")
            if t.device != input.device or not t.dtype.is_floating_point:
                raise ValueError(f"{name}: {label} must be a floating point tensor on {input.device}, got "
                                 f"{t.dtype} on {t.device}")
    if residual is not None and (residual.shape != input.shape or residual.device != input.device
                                 or not residual.dtype.is_floating_point):
        raise ValueError(f"{name}: residual must be a floating point tensor of input's shape {list(input.shape)} "
                         f"on {input.device}, got {list(residual.shape)} {residual.dtype} on {residual.device}")
    if eps < 0:
        raise ValueError(f"{name}: eps must be >= 0, got {eps}")
    N = 1
    for d in shape:
        N *= d
    M = 1
    for d in input.shape[:input.dim() - len(shape)]:
        M *= d
    rows = input.dim() == 2 and len(shape) == 1  # already (M, N): no views (each costs host time)
    x = unit_stride(input if rows else input.reshape(M, N))  # (M, N), not (-1, N): N may be 0
    r = unit_stride(residual if rows else residual.reshape(M, N)) if residual is not None else None
    w = _vector(weight, N)
    b = _vector(bias, N)
    # y in the dtype of what is normalised: x, or x + residual as torch promotes it
    out_dtype = out_dtype or (torch.promote_types(input.dtype, residual.dtype) if residual is not None else input.dtype)
    # Without a backward to come, mean and rstd are not stored (as torch.compile's kernels)
    stats = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, r, w, b))
    if torch.compiler.is_compiling():
        y, h, _, _ = _forward_op(x, r, w, b, float(eps), float(weight_offset), rms, out_dtype, stats)
    elif stats:
        y, h = _Norm.apply(x, r, w, b, float(eps), float(weight_offset), rms, out_dtype)
    else:
        y, h, _, _ = _forward(x, r, w, b, float(eps), float(weight_offset), rms, out_dtype, stats=False)
    if residual is None:
        return y if rows else y.reshape(input.shape)
    return (y, h) if rows else (y.reshape(input.shape), h.reshape(input.shape))


def _vector(t, N):
    """A weight or bias as N contiguous elements (or None)."""
    if t is None:
        return None
    return (t if t.dim() == 1 else t.reshape(N)).contiguous()


def rms_norm(input, normalized_shape, weight=None, eps=None, *, residual=None, bias=None, weight_offset=0.0,
             out_dtype=None):
    """torch.nn.functional.rms_norm(input, normalized_shape, weight, eps), with Triton kernels.

    eps=None means what torch means: the epsilon of float32 for fp16 / bf16 / fp32 inputs
    (the type it computes in). Keyword-only extras:
    residual (returns (y, input + residual): the pre-norm block's normalised output and its new
    residual stream), bias (added after the weight), weight_offset (y = x^ * (offset + weight),
    Gemma), out_dtype (y's dtype; default the input's).
    """
    if eps is None:  # torch: the machine epsilon of the type it computes in (float32 for fp16 / bf16)
        dtype = input.dtype if isinstance(input, torch.Tensor) and input.dtype.is_floating_point else torch.float32
        eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    return _normalise("pintail.rms_norm", input, normalized_shape, weight, bias, residual, eps, weight_offset,
                      True, out_dtype)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm, with Triton kernels."""
    return _normalise("pintail.layer_norm", input, normalized_shape, weight, bias, None, eps, 0.0, False, None)
