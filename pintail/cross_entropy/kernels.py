"""The cross_entropy Triton kernels: what each reads and writes is in its comments."""

import triton
import triton.language as tl

from .._core import cluster
from .._core.launch import aligned, in_row

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

REDUCTIONS = ("none", "mean", "sum")


@triton.jit
def _tanh_and_slope(x, softcap):
    """tanh(x / softcap) and 1 - tanh^2, each within about torch's float32 error, from exp2
    (no libdevice in the interpreter). Below |y| = 0.8 an odd polynomial (least-squares in
    y^2 on [0, 0.64], 3e-11 from tanh), where 1 - 2 t / (1 + t) with t = exp(-2 |y|) would
    lose the small result to cancellation; above, that form (its 2 t / (1 + t) at most 0.34,
    a fast reciprocal's error scaled down by it), and the slope as 4 t / (1 + t)^2."""
    y = x * (1.0 / softcap)
    a = tl.abs(y)
    t = tl.exp2(a * (-2.0 * LOG2E))
    q = tl.fdiv(1.0, 1.0 + t)
    s = a * a
    series = 0.00020485865386519523
    series = series * s - 0.0010893255770868563
    series = series * s + 0.0033817294366315104
    series = series * s - 0.008789334321345434
    series = series * s + 0.021853849615883523
    series = series * s - 0.053966369859698944
    series = series * s + 0.13333321976539103
    series = series * s - 0.3333333308631655
    small = a + a * s * series
    is_small = a < 0.8
    tanh = tl.where(is_small, small, 1.0 - 2.0 * t * q)
    slope = tl.where(is_small, (1.0 - small) * (1.0 + small), 4.0 * t * q * q)
    return tl.where(y < 0, -tanh, tanh), slope


@triton.jit
def _tanh_over(x, softcap):
    """tanh(x / softcap) (the slope's arithmetic is left out by the compiler)."""
    tanh, _ = _tanh_and_slope(x, softcap)
    return tanh


@triton.jit
def _softcapped(x, softcap):
    """softcap * tanh(x / softcap)."""
    return softcap * _tanh_over(x, softcap)


@triton.jit
def _weight_total(mass_ptr, row, V, HAS_WEIGHT: tl.constexpr):
    """W = sum of the class weights that smoothing spreads over: V without weights, else the
    sum the forward took of the weights it read for the row (mass[row]; a torch sum instead
    cost two small kernels a call, forward and backward, and their host time)."""
    if HAS_WEIGHT:
        return tl.load(mass_ptr + row)
    return V * 1.0


@triton.jit
def _z_scale(z_scale, z_ratio_ptr, Z_RATIO: tl.constexpr):
    """The z-loss factor of a row: z, times the mean's (sum of the kept rows' class weights /
    kept rows) where the loss is a weighted mean, so that the z-loss term is a mean over kept
    rows whatever the weights' scale."""
    if Z_RATIO:
        z_scale = z_scale * tl.load(z_ratio_ptr)
    return z_scale


@triton.jit
def _reduce_kernel(loss_ptr, target_ptr, weight_ptr, out_ptr, denom_ptr, M, V, ignore_index,
                   REDUCE: tl.constexpr, HAS_WEIGHT: tl.constexpr, PROB: tl.constexpr, BLOCK: tl.constexpr):
    # sum / mean of the M row losses, one program, in a fixed order (deterministic), and for
    # mean the kept rows' class weights. A launch of its own: when every row program of the
    # forward counted its arrival with an acq_rel atomic for the last one to reduce, the
    # forward at V = 32768 took 74.6 us instead of 65.8.
    total = 0.0
    denominator = 0.0
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        in_rows = rows < M
        total += tl.sum(tl.load(loss_ptr + rows, mask=in_rows, other=0.0), axis=0)
        if REDUCE == 2:
            if PROB:  # probability targets: mean over rows
                denominator += tl.sum(in_rows.to(tl.float32), axis=0)
            else:
                t = tl.load(target_ptr + rows, mask=in_rows, other=ignore_index).to(tl.int64)
                kept = in_rows & (t != ignore_index)
                if HAS_WEIGHT:
                    denominator += tl.sum(tl.load(weight_ptr + t, mask=kept & (t >= 0) & (t < V),
                                                  other=0.0).to(tl.float32), axis=0)
                else:
                    denominator += tl.sum(kept.to(tl.float32), axis=0)
    if REDUCE == 2:
        total = total / denominator  # all rows ignored: 0 / 0 = NaN, as torch
        tl.store(denom_ptr, denominator)
    tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _target_check_kernel(target_ptr, count_ptr, M, V, ignore_index, BLOCK: tl.constexpr):
    # One program: how many class indices lie outside [0, V) and are not ignore_index (the
    # eager check; the host waits for this kernel only, not for the forward behind it).
    bad = 0
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index).to(tl.int64)
        bad += tl.sum(((t != ignore_index) & ((t < 0) | (t >= V))).to(tl.int32), axis=0)
    tl.store(count_ptr, bad)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _logits(x_row, cols, mask, softcap, SOFTCAP: tl.constexpr):
    """A chunk of a row's logits in float32, softcapped if asked; -inf past the row's end."""
    x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if SOFTCAP:
        x = tl.where(mask, _softcapped(x, softcap), -float("inf"))
    return x


@triton.jit
def _class_weights(weights, classes, mask, HAS_WEIGHT: tl.constexpr):
    """The class weights of a chunk in float32 (0 past the row's end), or the mask without
    weights."""
    if HAS_WEIGHT:
        v = tl.load(weights + classes, mask=mask, other=0.0).to(tl.float32)
    else:
        v = mask
    return v


@triton.jit
def _fold_chunk(x, v, running_max, running_sum, anchor, weighted_x, mass, SMOOTH: tl.constexpr,
                WEIGHTED: tl.constexpr, MASS: tl.constexpr):
    """Fold a chunk of logits x into the row's running (max, sum of exp(x - max)) and, for
    smoothing, into sum_j v_j (x_j - anchor), with v the chunk's weights of that sum
    (WEIGHTED; else v is the chunk's mask: weight 1) and, with MASS, into sum_j v_j. The
    caller loads v beside x, before the max: a load the compiler finds after the max's
    barrier is issued there and waits alone (weights + smoothing: 0.38 of
    copy). The anchor is the row's first finite max (0 before it, while every logit so far is
    -inf, whatever the anchor): the terms need no rescaling when the max moves, and every
    sum of a chunk goes through one reduction (one barrier a chunk fewer than two sums; a
    tl.reduce of the tuple is the same code on the GPU, but a Python loop in the interpreter)."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a chunk of -inf adds 0, not NaN
    terms = tl.exp2((x - shift) * LOG2E)
    if SMOOTH:
        anchor = tl.where(running_max == -float("inf"), shift, anchor)
        if WEIGHTED:
            smoothed = tl.where(v != 0.0, v * (x - anchor), 0.0)  # v = 0 drops x = -inf (0 * -inf: NaN)
        else:
            smoothed = tl.where(v, x - anchor, 0.0)
        if MASS:
            sums, masses = tl.split(tl.sum(tl.join(tl.join(terms, smoothed), tl.join(v, v)), axis=0))
            chunk_sum, chunk_smoothed = tl.split(sums)
            mass += tl.split(masses)[0]
        else:
            chunk_sum, chunk_smoothed = tl.split(tl.sum(tl.join(terms, smoothed), axis=0))
        weighted_x += chunk_smoothed
    else:
        chunk_sum = tl.sum(terms, axis=0)
    running_sum = running_sum * tl.exp2((running_max - shift) * LOG2E) + chunk_sum
    return new_max, running_sum, anchor, weighted_x, mass


@triton.jit
def _about_max(weighted_x, mass, running_max, anchor):
    """sum_j v_j (x_j - max) from the sum about the anchor and mass = sum_j v_j."""
    return weighted_x - mass * (tl.where(running_max == -float("inf"), 0.0, running_max) - anchor)


@triton.jit
def _store_row_loss(loss_ptr, stats_ptr, row, t, x_t, weight_ptr, running_max, running_sum, anchor, weighted_x,
                    weight_total, V, ignore_index, smoothing, z_scale, z_ratio_ptr, HAS_WEIGHT: tl.constexpr,
                    SMOOTH: tl.constexpr, Z_RATIO: tl.constexpr):
    """A class-index row's loss (0 where ignored, NaN where its target is out of range) and its
    (max, log-sum) from its folded sums (_fold_chunk), its target t, the target's logit x_t
    and W = weight_total (read with SMOOTH only)."""
    log_sum = tl.log2(running_sum) * LN2
    lse = running_max + log_sum
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < V)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    z_scale = _z_scale(z_scale, z_ratio_ptr, Z_RATIO)
    loss = (1.0 - smoothing) * w_t * ((running_max - x_t) + log_sum) + z_scale * lse * lse
    if SMOOTH:  # W * lse - sum_j w_j x_j; sum_j w_j (x_j - max) from the sum about the anchor
        loss += smoothing / V * (weight_total * log_sum - _about_max(weighted_x, weight_total, running_max, anchor))
    loss = tl.where(ignored, 0.0, loss)
    loss = tl.where(in_range | ignored, loss, float("nan"))  # a bad target: NaN, never a wild read
    tl.store(loss_ptr + row, loss)
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)


@triton.jit
def _forward_kernel(x_ptr, target_ptr, weight_ptr, weight_stride, loss_ptr, stats_ptr, mass_ptr, V, x_row_stride,
                    ignore_index, smoothing, z_scale, softcap, z_ratio_ptr, HAS_WEIGHT: tl.constexpr,
                    SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
                    SHIFT: tl.constexpr = 0, EVEN: tl.constexpr = False, Z_RATIO: tl.constexpr = False):
    # One row: its (max, log-sum) in one pass (and, for smoothing, sum_j w_j (x_j - max) and,
    # with weights, W = sum_j w_j, stored in mass for the backward), then the loss. SHIFT
    # (rows whose starts no vector width divides): the chunks from the row's first boundary
    # of SHIFT elements (class `first`), over its whole pieces between boundaries, and the up
    # to 2 x (SHIFT - 1) classes outside them one at a time (cluster.window). EVEN: rows of
    # whole chunks, loaded without a mask (launch.in_row).
    # vector loads for rows of 8- or 4-divisible length (launch.row_alignment)
    V, x_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    chunks, first, span = x_row, 0, V
    if SHIFT:
        chunks = x_ptr + cluster.slice_start(row, x_row_stride, SHIFT)
        first = cluster.row_head(row, x_row_stride, SHIFT)
        span = cluster.whole_end(row, x_row_stride, V, SHIFT)
    # the chunks' weights from row `first` of _weight_rows' table; the ends' (at < 0 too) from its
    # row 0, the weights themselves
    row_weights = weight_ptr + first * weight_stride
    running_max = -float("inf")
    running_sum = 0.0
    anchor = 0.0
    weighted_x = 0.0
    weight_total = 0.0
    for start in range(0, span, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, span, EVEN)
        x = _logits(chunks, cols, mask, softcap, SOFTCAP)
        v = _class_weights(row_weights, cols, mask, HAS_WEIGHT and SMOOTH)
        running_max, running_sum, anchor, weighted_x, weight_total = _fold_chunk(
            x, v, running_max, running_sum, anchor, weighted_x, weight_total, SMOOTH, HAS_WEIGHT, HAS_WEIGHT)
    if SHIFT:
        at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
        x = _logits(chunks, at, ends, softcap, SOFTCAP)
        v = _class_weights(weight_ptr + first, at, ends, HAS_WEIGHT and SMOOTH)
        running_max, running_sum, anchor, weighted_x, weight_total = _fold_chunk(
            x, v, running_max, running_sum, anchor, weighted_x, weight_total, SMOOTH, HAS_WEIGHT, HAS_WEIGHT)
    t = tl.load(target_ptr + row).to(tl.int64)
    readable = (t >= 0) & (t < V) & (t != ignore_index)
    x_t = tl.load(x_row + t, mask=readable, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = _softcapped(x_t, softcap)
    if SMOOTH:
        if HAS_WEIGHT:
            tl.store(mass_ptr + row, weight_total)
        else:
            weight_total = V * 1.0
    _store_row_loss(loss_ptr, stats_ptr, row, t, x_t, weight_ptr, running_max, running_sum, anchor, weighted_x,
                    weight_total, V, ignore_index, smoothing, z_scale, z_ratio_ptr, HAS_WEIGHT, SMOOTH, Z_RATIO)


@triton.jit
def _target_weights(y_chunks, at, mask, weights, smoothing, V, HAS_WEIGHT: tl.constexpr):
    """w_j y'_j of the classes `at` (where mask; 0 elsewhere), y' = (1 - e) y + e / V."""
    y = tl.load(y_chunks + at, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(mask, (1.0 - smoothing) * y + smoothing / V, 0.0)
    if HAS_WEIGHT:
        y *= _class_weights(weights, at, mask, True)
    return y


@triton.jit
def _forward_probs_kernel(x_ptr, y_ptr, weight_ptr, weight_stride, loss_ptr, stats_ptr, mass_ptr, V, x_row_stride,
                          y_row_stride, smoothing, z_scale, softcap, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                          BLOCK: tl.constexpr, ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0,
                          EVEN: tl.constexpr = False):
    # Probability targets: one pass for (max, log-sum), A = sum_j w_j y'_j (x_j - max) (from
    # its sum about the anchor, _fold_chunk) and B = sum_j w_j y'_j; loss = B * log-sum - A.
    # SHIFT: the logits' and the targets' rows from the same boundary, as in _forward_kernel
    # (cluster.window: their row strides agree modulo SHIFT). EVEN as in _forward_kernel.
    V, x_row_stride, y_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_chunks = x_ptr + cluster.slice_start(row, x_row_stride, SHIFT)
    y_chunks = y_ptr + cluster.slice_start(row, y_row_stride, SHIFT)
    first, span = 0, V
    if SHIFT:
        first = cluster.row_head(row, x_row_stride, SHIFT)
        span = cluster.whole_end(row, x_row_stride, V, SHIFT)
    row_weights = weight_ptr + first * weight_stride  # as in _forward_kernel
    running_max = -float("inf")
    running_sum = 0.0
    anchor = 0.0
    target_x = 0.0
    mass = 0.0
    for start in range(0, span, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, span, EVEN)
        x = _logits(x_chunks, cols, mask, softcap, SOFTCAP)
        y = _target_weights(y_chunks, cols, mask, row_weights, smoothing, V, HAS_WEIGHT)
        running_max, running_sum, anchor, target_x, mass = _fold_chunk(
            x, y, running_max, running_sum, anchor, target_x, mass, True, True, True)
    if SHIFT:
        at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
        x = _logits(x_chunks, at, ends, softcap, SOFTCAP)
        y = _target_weights(y_chunks, at, ends, weight_ptr + first, smoothing, V, HAS_WEIGHT)
        running_max, running_sum, anchor, target_x, mass = _fold_chunk(
            x, y, running_max, running_sum, anchor, target_x, mass, True, True, True)
    log_sum = tl.log2(running_sum) * LN2
    lse = running_max + log_sum
    tl.store(loss_ptr + row, mass * log_sum - _about_max(target_x, mass, running_max, anchor) + z_scale * lse * lse)
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)
    tl.store(mass_ptr + row, mass)


# ---------------------------------------------------------------------------- backward


@triton.jit
def _row_gradient(grad_ptr, denom_ptr, row, grad_stride, MEAN: tl.constexpr):
    """d(returned loss)/d(row loss): grad[row] (reduction none: stride 1) or the scalar grad
    (stride 0), divided by the mean's denominator."""
    g = tl.load(grad_ptr + row * grad_stride).to(tl.float32)
    if MEAN:
        g = g / tl.load(denom_ptr)
    return g


@triton.jit
def _backward_kernel(dx_ptr, x_ptr, target_ptr, weight_ptr, stats_ptr, mass_ptr, grad_ptr, denom_ptr, V,
                     x_row_stride, dx_row_stride, grad_stride, ignore_index, smoothing, z_scale, softcap, z_ratio_ptr,
                     HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, MEAN: tl.constexpr,
                     BLOCK: tl.constexpr, ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0, Z_RATIO: tl.constexpr = False):
    # One chunk of one row: read the logits again, write the gradient. SHIFT: the chunks as
    # in the forward (from 128-byte boundaries where they allow: VOCAB_BOUNDARY_BYTES); chunk
    # 0 also takes the classes outside the row's whole pieces. Everything a row shares is
    # folded into scalars first (the gradient g, the ignored row, the bad target), so that
    # an element costs a load, two FADD/FFMA, an exp, a compare and a select, an FFMA and a
    # store (the issue rate, not the bytes, held the options' body: 0.44-0.62 of copy).
    V, x_row_stride, dx_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # classes from the chunks' start, class `first`
    first = 0
    if SHIFT:
        first = cluster.row_head(row, x_row_stride, SHIFT)
    mask = cluster.slice_mask(row, x_row_stride, V, tl.program_id(1), BLOCK, SHIFT)
    t = tl.load(target_ptr + row).to(tl.int64)
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < V)
    target_at = tl.where(in_range, t - first, -SHIFT - 1).to(tl.int32)  # -SHIFT - 1: no class
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    # 0 in an ignored row, NaN where the target is out of range
    g = tl.where(ignored, 0.0, tl.where(in_range, _row_gradient(grad_ptr, denom_ptr, row, grad_stride, MEAN),
                                         float("nan")))
    coef, hit, spread = _gradient_factors(g, t, in_range, weight_ptr, row_max, log_sum, smoothing, z_scale,
                                          z_ratio_ptr, mass_ptr, row, V, HAS_WEIGHT, SMOOTH, Z_RATIO)
    x_chunks = x_ptr + cluster.slice_start(row, x_row_stride, SHIFT)
    dx_chunks = dx_ptr + cluster.slice_start(row, dx_row_stride, SHIFT)
    x = tl.load(x_chunks + at, mask=mask, other=0.0).to(tl.float32)
    d = _class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap, weight_ptr + first,
                        HAS_WEIGHT, SMOOTH, SOFTCAP)
    tl.store(dx_chunks + at, d.to(dx_ptr.dtype.element_ty), mask=mask)
    if SHIFT:
        if tl.program_id(1) == 0:
            ends_at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
            x_ends = tl.load(x_chunks + ends_at, mask=ends, other=0.0).to(tl.float32)
            d_ends = _class_gradient(x_ends, ends_at, ends, target_at, row_max, log_sum, coef, hit, spread, softcap,
                                     weight_ptr + first, HAS_WEIGHT, SMOOTH, SOFTCAP)
            tl.store(dx_chunks + ends_at, d_ends.to(dx_ptr.dtype.element_ty), mask=ends)


@triton.jit
def _gradient_factors(g, t, in_range, weight_ptr, row_max, log_sum, smoothing, z_scale, z_ratio_ptr, total_ptr,
                      total_index, V, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, Z_RATIO: tl.constexpr):
    """(coef, hit, spread) of a class-index row, each times its loss gradient g:
    dloss/dx_k = p_k * coef - hit [k == t] - spread * w_k. W (smoothing with weights) is
    total_ptr[total_index] (_weight_total)."""
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    coef = (1.0 - smoothing) * w_t + 2.0 * _z_scale(z_scale, z_ratio_ptr, Z_RATIO) * (row_max + log_sum)
    if SMOOTH:
        coef += smoothing / V * _weight_total(total_ptr, total_index, V, HAS_WEIGHT)
    return coef * g, (1.0 - smoothing) * w_t * g, smoothing / V * g


@triton.jit
def _class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap, weights,
                    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr):
    """The gradient of logits x at classes `at` (from `weights`' class, where mask), the
    target at `target_at`, with the row's factors already times its loss gradient."""
    if SOFTCAP:
        tanh, slope = _tanh_and_slope(x, softcap)
        x = softcap * tanh
    # x - max exact, as in the forward (logits of 1e4 keep their probabilities)
    p = tl.exp2((x - row_max) * LOG2E - log_sum * LOG2E)
    d = p * coef - tl.where(at == target_at, hit, 0.0)
    if SMOOTH:
        if HAS_WEIGHT:
            d -= spread * _class_weights(weights, at, mask, True)
        else:
            d -= spread
    if SOFTCAP:
        d *= slope
    return d


@triton.jit
def _backward_probs_kernel(dx_ptr, x_ptr, y_ptr, weight_ptr, stats_ptr, mass_ptr, grad_ptr, denom_ptr, V,
                           x_row_stride, y_row_stride, dx_row_stride, grad_stride, smoothing, z_scale, softcap,
                           HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
                           ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0):
    # One chunk of one row; SHIFT as in _backward_kernel, the targets' rows from the same
    # boundary as the logits' (cluster.window).
    V, x_row_stride, dx_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    y_row_stride = aligned(y_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    first = 0
    if SHIFT:
        first = cluster.row_head(row, x_row_stride, SHIFT)
    mask = cluster.slice_mask(row, x_row_stride, V, tl.program_id(1), BLOCK, SHIFT)
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    g = _row_gradient(grad_ptr, denom_ptr, row, grad_stride, MEAN)
    coef = (tl.load(mass_ptr + row) + 2.0 * z_scale * (row_max + log_sum)) * g  # the row's factors times g
    x_chunks = x_ptr + cluster.slice_start(row, x_row_stride, SHIFT)
    y_chunks = y_ptr + cluster.slice_start(row, y_row_stride, SHIFT)
    dx_chunks = dx_ptr + cluster.slice_start(row, dx_row_stride, SHIFT)
    d = _probs_gradient(x_chunks, y_chunks, at, mask, weight_ptr + first, row_max, log_sum, coef, g, smoothing, V,
                        softcap, HAS_WEIGHT, SOFTCAP)
    tl.store(dx_chunks + at, d.to(dx_ptr.dtype.element_ty), mask=mask)
    if SHIFT:
        if tl.program_id(1) == 0:
            ends_at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
            d_ends = _probs_gradient(x_chunks, y_chunks, ends_at, ends, weight_ptr + first, row_max, log_sum, coef, g,
                                     smoothing, V, softcap, HAS_WEIGHT, SOFTCAP)
            tl.store(dx_chunks + ends_at, d_ends.to(dx_ptr.dtype.element_ty), mask=ends)


@triton.jit
def _probs_gradient(x_chunks, y_chunks, at, mask, weights, row_max, log_sum, coef, g, smoothing, V, softcap,
                    HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr):
    """The gradient at classes `at` (where mask) of a row with probability targets:
    g (p_k coef' - w_k y'_k), coef' = B + 2 z lse, times the softcap's derivative."""
    x = tl.load(x_chunks + at, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:
        tanh, slope = _tanh_and_slope(x, softcap)
        x = softcap * tanh
    y = tl.load(y_chunks + at, mask=mask, other=0.0).to(tl.float32)
    y = y * ((1.0 - smoothing) * g) + smoothing / V * g
    if HAS_WEIGHT:
        y *= _class_weights(weights, at, mask, True)
    d = tl.exp2((x - row_max) * LOG2E - log_sum * LOG2E) * coef - y
    if SOFTCAP:
        d *= slope
    return d
