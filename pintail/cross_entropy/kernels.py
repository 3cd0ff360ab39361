"""The cross_entropy Triton kernels: what each reads and writes is in its comments."""

import triton
import triton.language as tl

from .._core import cluster
from .._core.launch import aligned, in_row
from .._loss.rows import (LN2, LOG2E, about_max, class_gradient, fold_chunk, gradient_factors, load_class_weights,
                          load_logits, softcapped, store_row_loss, tanh_and_slope)


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


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fold_piece(x_chunks, y_chunks, weights, cols, mask, V, smoothing, softcap, running_max, running_sum, anchor,
                smoothed, mass, PROBS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr,
                SOFTCAP: tl.constexpr):
    """fold_chunk over the classes `cols` (where mask) of a row, each with its weight in the
    smoothed sum (_fold_row)."""
    x = load_logits(x_chunks, cols, mask, softcap, SOFTCAP)
    if PROBS:
        v = _target_weights(y_chunks, cols, mask, weights, smoothing, V, HAS_WEIGHT)
    else:
        v = load_class_weights(weights, cols, mask, HAS_WEIGHT and SMOOTH)
    return fold_chunk(x, v, running_max, running_sum, anchor, smoothed, mass, SMOOTH, HAS_WEIGHT or PROBS,
                      HAS_WEIGHT or PROBS)


@triton.jit
def _fold_row(x_chunks, y_chunks, row_weights, end_weights, row, x_row_stride, V, span, smoothing, softcap,
              PROBS: tl.constexpr, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr,
              BLOCK: tl.constexpr, SHIFT: tl.constexpr, EVEN: tl.constexpr):
    """A row's (max, sum of exp, anchor, smoothed sum, mass) by fold_chunk over its chunks
    (`span` classes from x_chunks) and, with SHIFT, its ends. Each class's weight in the
    smoothed sum: PROBS, w_j y'_j (_target_weights, y from y_chunks); else w_j (smoothing
    with weights: the mass is W) or 1. The chunks' weights from row_weights, the ends' from
    end_weights (_weight_rows' table)."""
    running_max = -float("inf")
    running_sum = 0.0
    anchor = 0.0
    smoothed = 0.0
    mass = 0.0
    for start in range(0, span, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        running_max, running_sum, anchor, smoothed, mass = _fold_piece(
            x_chunks, y_chunks, row_weights, cols, in_row(cols, span, EVEN), V, smoothing, softcap,
            running_max, running_sum, anchor, smoothed, mass, PROBS, HAS_WEIGHT, SMOOTH, SOFTCAP)
    if SHIFT:
        at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
        running_max, running_sum, anchor, smoothed, mass = _fold_piece(
            x_chunks, y_chunks, end_weights, at, ends, V, smoothing, softcap,
            running_max, running_sum, anchor, smoothed, mass, PROBS, HAS_WEIGHT, SMOOTH, SOFTCAP)
    return running_max, running_sum, anchor, smoothed, mass


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
    # the chunks' weights from row `first` of _weight_rows' table; the ends' (at < 0 too) from
    # its row 0, the weights themselves
    running_max, running_sum, anchor, weighted_x, weight_total = _fold_row(
        chunks, chunks, weight_ptr + first * weight_stride, weight_ptr + first, row, x_row_stride, V, span, smoothing,
        softcap, False, HAS_WEIGHT, SMOOTH, SOFTCAP, BLOCK, SHIFT, EVEN)
    t = tl.load(target_ptr + row).to(tl.int64)
    readable = (t >= 0) & (t < V) & (t != ignore_index)
    x_t = tl.load(x_row + t, mask=readable, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = softcapped(x_t, softcap)
    if SMOOTH:
        if HAS_WEIGHT:
            tl.store(mass_ptr + row, weight_total)
        else:
            weight_total = V * 1.0
    store_row_loss(loss_ptr, stats_ptr, row, t, x_t, weight_ptr, running_max, running_sum, anchor, weighted_x,
                    weight_total, V, ignore_index, smoothing, z_scale, z_ratio_ptr, HAS_WEIGHT, SMOOTH, Z_RATIO)


@triton.jit
def _target_weights(y_chunks, at, mask, weights, smoothing, V, HAS_WEIGHT: tl.constexpr):
    """w_j y'_j of the classes `at` (where mask; 0 elsewhere), y' = (1 - e) y + e / V."""
    y = tl.load(y_chunks + at, mask=mask, other=0.0).to(tl.float32)
    y = tl.where(mask, (1.0 - smoothing) * y + smoothing / V, 0.0)
    if HAS_WEIGHT:
        y *= load_class_weights(weights, at, mask, True)
    return y


@triton.jit
def _forward_probs_kernel(x_ptr, y_ptr, weight_ptr, weight_stride, loss_ptr, stats_ptr, mass_ptr, V, x_row_stride,
                          y_row_stride, smoothing, z_scale, softcap, HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                          BLOCK: tl.constexpr, ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0,
                          EVEN: tl.constexpr = False):
    # Probability targets: one pass for (max, log-sum), A = sum_j w_j y'_j (x_j - max) (from
    # its sum about the anchor, fold_chunk) and B = sum_j w_j y'_j; loss = B * log-sum - A.
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
    running_max, running_sum, anchor, target_x, mass = _fold_row(
        x_chunks, y_chunks, weight_ptr + first * weight_stride, weight_ptr + first, row, x_row_stride, V, span,
        smoothing, softcap, True, HAS_WEIGHT, True, SOFTCAP, BLOCK, SHIFT, EVEN)
    log_sum = tl.log2(running_sum) * LN2
    lse = running_max + log_sum
    tl.store(loss_ptr + row, mass * log_sum - about_max(target_x, mass, running_max, anchor) + z_scale * lse * lse)
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
    coef, hit, spread = gradient_factors(g, t, in_range, weight_ptr, row_max, log_sum, smoothing, z_scale,
                                          z_ratio_ptr, mass_ptr, row, V, HAS_WEIGHT, SMOOTH, Z_RATIO)
    x_chunks = x_ptr + cluster.slice_start(row, x_row_stride, SHIFT)
    dx_chunks = dx_ptr + cluster.slice_start(row, dx_row_stride, SHIFT)
    x = tl.load(x_chunks + at, mask=mask, other=0.0).to(tl.float32)
    d = class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap, weight_ptr + first,
                        HAS_WEIGHT, SMOOTH, SOFTCAP)
    tl.store(dx_chunks + at, d.to(dx_ptr.dtype.element_ty), mask=mask)
    if SHIFT:
        if tl.program_id(1) == 0:
            ends_at, ends = cluster.row_ends(row, x_row_stride, V, 0, BLOCK, SHIFT, 1)
            x_ends = tl.load(x_chunks + ends_at, mask=ends, other=0.0).to(tl.float32)
            d_ends = class_gradient(x_ends, ends_at, ends, target_at, row_max, log_sum, coef, hit, spread, softcap,
                                     weight_ptr + first, HAS_WEIGHT, SMOOTH, SOFTCAP)
            tl.store(dx_chunks + ends_at, d_ends.to(dx_ptr.dtype.element_ty), mask=ends)


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
        tanh, slope = tanh_and_slope(x, softcap)
        x = softcap * tanh
    y = tl.load(y_chunks + at, mask=mask, other=0.0).to(tl.float32)
    y = y * ((1.0 - smoothing) * g) + smoothing / V * g
    if HAS_WEIGHT:
        y *= load_class_weights(weights, at, mask, True)
    d = tl.exp2((x - row_max) * LOG2E - log_sum * LOG2E) * coef - y
    if SOFTCAP:
        d *= slope
    return d
