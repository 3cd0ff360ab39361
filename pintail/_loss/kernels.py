"""Kernels over a chunk of a row's classes, which the fused heads and the vocabulary-parallel
loss share (the chunk's logits written by a GEMM, or a rank's slice of them): the fold of a
chunk into each row's running state, the gradient over a chunk, and the eager target check."""

import triton
import triton.language as tl

from .._core.launch import aligned
from .rows import (chunk_program, class_gradient, fold_chunk, gradient_factors, load_class_weights, load_logits,
                   softcapped, store_row_loss, weight_sum)

# Columns of the running state a row carries from chunk to chunk (float32): the max, the sum
# of exp(x - max), the smoothing sum's anchor, sum_j v_j (x_j - anchor), the target's logit.
STATE_COLUMNS = 5


@triton.jit
def fold_kernel(x_ptr, x_row_stride, n, first_class, V, target_ptr, weight_ptr, weight_total_ptr, state_ptr,
                loss_ptr, stats_ptr, z_ratio_ptr, ignore_index, smoothing, z_scale, softcap,
                HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, FIRST: tl.constexpr,
                LAST: tl.constexpr, Z_RATIO: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One row of one chunk: the chunk's n logits (classes first_class ...) folded into the
    # row's running state (the online log-sum-exp of rows.fold_chunk, one exp an element); the last
    # chunk turns the state into the row's loss and (max, log-sum).
    n, x_row_stride = aligned(n, ALIGN), aligned(x_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    state = state_ptr + row * 5
    if FIRST:
        running_max, running_sum, anchor, weighted_x, target_x = -float("inf"), 0.0, 0.0, 0.0, 0.0
    else:
        running_max, running_sum = tl.load(state), tl.load(state + 1)
        anchor, weighted_x, target_x = tl.load(state + 2), tl.load(state + 3), tl.load(state + 4)
    weights = weight_ptr + first_class
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n
        x = load_logits(x_row, cols, mask, softcap, SOFTCAP)
        v = load_class_weights(weights, cols, mask, HAS_WEIGHT and SMOOTH)
        running_max, running_sum, anchor, weighted_x, _ = fold_chunk(
            x, v, running_max, running_sum, anchor, weighted_x, 0.0, SMOOTH, HAS_WEIGHT, False)
    t = tl.load(target_ptr + row).to(tl.int64)
    at = t - first_class
    hit = (at >= 0) & (at < n)
    x_t = tl.load(x_row + at, mask=hit, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = softcapped(x_t, softcap)
    target_x = tl.where(hit, x_t, target_x)
    if LAST:
        weight_total = 0.0
        if SMOOTH:  # W over the whole vocabulary
            weight_total = weight_sum(weight_total_ptr, 0, V, HAS_WEIGHT)
        store_row_loss(loss_ptr, stats_ptr, row, t, target_x, weight_ptr, running_max, running_sum, anchor, weighted_x,
                        weight_total, V, ignore_index, smoothing, z_scale, z_ratio_ptr, HAS_WEIGHT, SMOOTH, Z_RATIO)
    else:
        tl.store(state, running_max)
        tl.store(state + 1, running_sum)
        tl.store(state + 2, anchor)
        tl.store(state + 3, weighted_x)
        tl.store(state + 4, target_x)


@triton.jit
def gradient_kernel(x_ptr, x_row_stride, n, first_class, V, target_ptr, weight_ptr, weight_total_ptr, stats_ptr,
                    grad_ptr, grad_stride, z_ratio_ptr, ignore_index, smoothing, z_scale, softcap,
                    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, Z_RATIO: tl.constexpr,
                    BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One block of one row of one chunk: the gradient of the row's loss (times grad[row])
    # with respect to the chunk's logits, written over them (the GEMMs read it next).
    n, x_row_stride = aligned(n, ALIGN), aligned(x_row_stride, ALIGN)
    row, at, mask, t, ignored, in_range = chunk_program(target_ptr, n, ignore_index, V, BLOCK)
    target_at = tl.where(in_range, t - first_class, -1).to(tl.int32)  # outside the chunk: no class of it
    target_at = tl.where((target_at >= 0) & (target_at < n), target_at, -1)
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    g = tl.load(grad_ptr + row * grad_stride).to(tl.float32)
    g = tl.where(ignored, 0.0, tl.where(in_range, g, float("nan")))
    coef, hit, spread = gradient_factors(g, t, in_range, weight_ptr, row_max, log_sum, smoothing, z_scale,
                                          z_ratio_ptr, weight_total_ptr, 0, V, HAS_WEIGHT, SMOOTH, Z_RATIO)
    x_row = x_ptr + row * x_row_stride
    x = tl.load(x_row + at, mask=mask, other=0.0).to(tl.float32)
    d = class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap,
                        weight_ptr + first_class, HAS_WEIGHT, SMOOTH, SOFTCAP)
    tl.store(x_row + at, d.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def target_check_kernel(target_ptr, count_ptr, M, V, ignore_index, BLOCK: tl.constexpr):
    # One program: how many class indices lie outside [0, V) and are not ignore_index (the
    # eager check; the host waits for this kernel only, not for the forward behind it).
    bad = 0
    for start in range(0, M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + rows, mask=rows < M, other=ignore_index).to(tl.int64)
        bad += tl.sum(((t != ignore_index) & ((t < 0) | (t >= V))).to(tl.int32), axis=0)
    tl.store(count_ptr, bad)
