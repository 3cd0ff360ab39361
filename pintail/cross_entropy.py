"""cross_entropy: Triton kernels, autograd, torch.library registration.

The loss works on rows: logits x[M, V] (classes along a row) and a target per row. The
kernels produce per-row results (the loss of each row and its log-sum-exp, lse). In eager
mode a one-program kernel after the forward reduces them (sum, or mean over kept rows or
their weights, in a fixed order) and the backward kernel takes the 0-d gradient and the
mean's denominator; under torch.compile the reduction is traced
torch ops and the backward kernel gets the gradient of each row's loss.

Class-index targets, per row with target t, class weights w (all 1 without weights),
W = sum(w), smoothing e, V classes, logp = x - lse, lse = m + log(sum_j exp(x_j - m)) with m
the row's max (kept as the pair (m, log-sum) per row: x - m is exact where x is near m, so
losses and probabilities stay accurate for logits of 1e4, as torch's log_softmax):
    loss = (1 - e) * w_t * (lse - x_t) + (e / V) * (W * lse - sum_j w_j x_j) + z * lse^2
    dloss/dx_k = p_k * ((1 - e) w_t + (e / V) W + 2 z lse) - (1 - e) w_t [k == t] - (e / V) w_k
Probability targets y, smoothed y' = (1 - e) y + e / V, B = sum_j w_j y'_j:
    loss = B * lse - sum_j w_j y'_j x_j + z * lse^2
    dloss/dx_k = p_k * (B + 2 z lse) - w_k y'_k
Softcap c: every logit is first c * tanh(x / c); the gradient gains a factor 1 - tanh^2.

Bytes: the forward reads the logits once (one program per row, an online log-sum-exp with
one exp per element: a scalar max per chunk, exp2 of pre-shifted logits); the backward reads
them again and writes the gradient (a program per row and chunk). No (M, V) temporaries.
"""

import torch
import triton
import triton.language as tl

from . import _cluster as cluster, reference
from ._launch import (KERNEL_DTYPES, aligned, as_rows, cdiv, in_row, launch, next_power_of_2, no_second_derivative,
                      row_alignment, runs_kernels)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

REDUCTIONS = ("none", "mean", "sum")


@triton.jit
def _tanh_over(x, softcap):
    """tanh(x / softcap) = 1 - 2 / (exp(2 x / softcap) + 1), from exp2 (no libdevice in the
    interpreter). The reciprocal is rsqrt squared, a MUFU.RSQ and a multiply: a float32
    quotient costs ~8 instructions with its range checks. exp(...) + 1 >= 1, inf gives 1."""
    r = tl.math.rsqrt(tl.exp2(x * (2.0 * LOG2E / softcap)) + 1.0)
    return 1.0 - 2.0 * r * r


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
def _forward_kernel(x_ptr, target_ptr, weight_ptr, weight_stride, loss_ptr, stats_ptr, mass_ptr, V, x_row_stride,
                    ignore_index, smoothing, z_scale, softcap, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr,
                    SOFTCAP: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0,
                    EVEN: tl.constexpr = False):
    # One row: its (max, log-sum) in one pass (and, for smoothing, sum_j w_j (x_j - max) and,
    # with weights, W = sum_j w_j, stored in mass for the backward), then the loss. SHIFT
    # (rows whose starts no vector width divides): the chunks from the row's first boundary
    # of SHIFT elements (class `first`), over its whole pieces between boundaries, and the up
    # to 2 x (SHIFT - 1) classes outside them one at a time (cluster.window). EVEN: rows of
    # whole chunks, loaded without a mask (_launch.in_row).
    if ALIGN > 1:  # vector loads for rows of 8- or 4-divisible length (_launch.row_alignment)
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
    log_sum = tl.log2(running_sum) * LN2
    lse = running_max + log_sum

    t = tl.load(target_ptr + row).to(tl.int64)
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < V)
    x_t = tl.load(x_row + t, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = _softcapped(x_t, softcap)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    loss = (1.0 - smoothing) * w_t * ((running_max - x_t) + log_sum) + z_scale * lse * lse
    if SMOOTH:  # W * lse - sum_j w_j x_j; sum_j w_j (x_j - max) from the sum about the anchor
        if HAS_WEIGHT:
            tl.store(mass_ptr + row, weight_total)
        else:
            weight_total = V * 1.0
        loss += smoothing / V * (weight_total * log_sum - _about_max(weighted_x, weight_total, running_max, anchor))
    loss = tl.where(ignored, 0.0, loss)
    loss = tl.where(in_range | ignored, loss, float("nan"))  # a bad target: NaN, never a wild read
    tl.store(loss_ptr + row, loss)
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)


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
    if ALIGN > 1:  # as in _forward_kernel
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
                     x_row_stride, dx_row_stride, grad_stride, ignore_index, smoothing, z_scale, softcap,
                     HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr, MEAN: tl.constexpr,
                     BLOCK: tl.constexpr, ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0):
    # One chunk of one row: read the logits again, write the gradient. SHIFT: the chunks as
    # in the forward (from 128-byte boundaries where they allow: VOCAB_BOUNDARY_BYTES); chunk
    # 0 also takes the classes outside the row's whole pieces. Everything a row shares is
    # folded into scalars first (the gradient g, the ignored row, the bad target), so that
    # an element costs a load, two FADD/FFMA, an exp, a compare and a select, an FFMA and a
    # store (the issue rate, not the bytes, held the options' body: 0.44-0.62 of copy).
    if ALIGN > 1:  # as in the forward
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
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    # dloss/dx_k = g * (p_k * coef - hit [k == t] - spread * w_k)
    coef = (1.0 - smoothing) * w_t + 2.0 * z_scale * (row_max + log_sum)
    if SMOOTH:
        coef += smoothing / V * _weight_total(mass_ptr, row, V, HAS_WEIGHT)
    coef, hit, spread = coef * g, (1.0 - smoothing) * w_t * g, smoothing / V * g
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
def _class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap, weights,
                    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr):
    """The gradient of logits x at classes `at` (from `weights`' class, where mask), the
    target at `target_at`, with the row's factors already times its loss gradient."""
    if SOFTCAP:
        tanh = _tanh_over(x, softcap)
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
        d *= 1.0 - tanh * tanh
    return d


@triton.jit
def _backward_probs_kernel(dx_ptr, x_ptr, y_ptr, weight_ptr, stats_ptr, mass_ptr, grad_ptr, denom_ptr, V,
                           x_row_stride, y_row_stride, dx_row_stride, grad_stride, smoothing, z_scale, softcap,
                           HAS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr,
                           ALIGN: tl.constexpr, SHIFT: tl.constexpr = 0):
    # One chunk of one row; SHIFT as in _backward_kernel, the targets' rows from the same
    # boundary as the logits' (cluster.window).
    if ALIGN > 1:  # as in the forward
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
        tanh = _tanh_over(x, softcap)
        x = softcap * tanh
    y = tl.load(y_chunks + at, mask=mask, other=0.0).to(tl.float32)
    y = y * ((1.0 - smoothing) * g) + smoothing / V * g
    if HAS_WEIGHT:
        y *= _class_weights(weights, at, mask, True)
    d = tl.exp2((x - row_max) * LOG2E - log_sum * LOG2E) * coef - y
    if SOFTCAP:
        d *= 1.0 - tanh * tanh
    return d


# ------------------------------------------------------------------ launch heuristics
# BENCHMARKS.md probes on the H200: the online forward at BLOCK 8192 / 4 warps reached
# 0.84-1.02 of copy; the backward on a (rows x 8192-column chunks) grid 0.93. The forward's
# chunk: the first of FORWARD_BLOCKS for the class-index loss without smoothing, the second
# for the bodies that hold more a chunk (probability targets: 165-207 registers at 8192, two
# programs an SM; label smoothing). H200, bf16, M = 4096, kernel alone, one run
# each, 8192 -> 4096 (4 warps), V = 32768 / 50257 / 131072: probability targets 0.68 / 0.65
# / 0.75 -> 0.83 / 0.83 / 0.88 (262144: 0.75 -> 0.86; 2048 read 0.80-0.84, 8 warps below 4
# but at 8192), smoothing 0.70 / 0.68 / 0.80 -> 0.71 / 0.72 / 0.82, weights and smoothing
# 0.53 / 0.39 / 0.62 -> 0.54 / 0.41 / 0.64. A softcap alone stays at 8192 (0.55 there at
# 131072, 4096 no better at 32768).
FORWARD_BLOCKS, FORWARD_WARPS = (8192, 4096), 4
# One program each, a block of rows per step: in steps of 1024 (a load latency each) the
# reduction of 4096 rows took 6.8 us and the check of 4096 targets 2.8 us. The check in one
# step, with its count written into pinned memory (no copy after it): checked forward
# 0.87-0.89 -> 0.91-0.93 of copy at V = 128256-131072.
REDUCE_BLOCK, REDUCE_WARPS = 4096, 8
TARGET_CHECK_BLOCK = 4096
# The backward's chunks. A program takes about the same time however full its chunk is (one
# load round trip, one store), so a row's last, partly empty chunk costs a whole program:
# V = 50304 in chunks of 8192 fills them to 0.88, and read 0.83 against 0.89 at 32768. The
# largest of BACKWARD_BLOCKS whose chunks fill the row's sliced part to BACKWARD_FILL, else
# the smallest. H200, bf16, M = 4096, kernel alone, one run each, (8192, 8 warps)
# -> this: 50304 0.825 -> 0.910 (2048), 50257 0.790 -> 0.862 (2048), 128256 0.902 -> 0.921
# (2048), 151936 0.899 -> 0.913 (2048), 131072 0.914 -> 0.928 (8192), 262144 0.910 -> 0.926
# (8192), 32768 0.886 -> 0.885 (8192; 2048 read 0.913 there), 128257 0.876 -> 0.873 (2048).
# 4 warps: at 8192 4 read 0.000-0.016 above 8 at all eight sizes; at 2048 2 and 4 tied.
# Heavy bodies (softcap, or class weights with smoothing: 127-254 registers at 8192 / 4
# warps, 32-56 at 2048) take the smallest chunk whatever the fill. Kernel alone,
# V = 32768 / 50257 / 131072, 8192 -> 2048 (4 warps): softcap 0.59 / 0.73 / 0.61 -> 0.88 /
# 0.88 / 0.80, weights and smoothing 0.77 / 0.67 / 0.83 -> 0.84 / 0.82 / 0.88, every option
# 0.53 / 0.60 / 0.56 -> 0.78 / 0.73 / 0.72 (4096 / 8 warps: 0.84 and 0.77 at 131072, below
# 2048 at the other two).
BACKWARD_BLOCKS, BACKWARD_FILL, BACKWARD_WARPS = (8192, 4096, 2048), 0.99, 4


# Vocabularies no vector width divides (32001, 50257) go from each row's first 16-byte
# boundary, the classes outside its whole 16-byte pieces one at a time (SHIFT, as softmax's
# long rows); probability targets too (their rows from the same boundary as
# the logits', where their strides agree). Class indices, H200, bf16, M*V = 2^27, kernels
# alone, off / on alternating, forward / backward fraction of copy (2-byte loads -> SHIFT): 32001
# 0.66 / 0.57 -> 0.77 / 0.83, 50257 0.68 / 0.53 -> 0.80 / 0.77, 128257 0.78 / 0.57 -> 0.94 /
# 0.85, 151937 0.79 / 0.57 -> 0.95 / 0.84, 256001 0.80 / 0.57 -> 0.97 / 0.84 (4 runs each at
# 32001 and 50257, 2 elsewhere; two single readings of 0.37 and 0.52 in one run were not
# repeated). ODD_VOCAB_SHIFT False: the 2-byte loads (tune_cross_entropy.py --odd-vocab-shift
# compares the two).
ODD_VOCAB_SHIFT = True
# Where SHIFT starts the slices (cluster.window's `boundary`, bytes): 16 -> 128,
# backward 0.85 -> 0.88 at V = 128257, 0.77 -> 0.79 at 50257; forward 0.946 -> 0.943 and
# 0.80 -> 0.79 (two runs each, alternating).
VOCAB_BOUNDARY_BYTES = {"forward": 16, "backward": 128}


def _block(V, block):
    return min(block, max(16, next_power_of_2(V)))


def _forward_block(V, smoothing, prob_target):
    """The forward's chunk for rows of V classes (FORWARD_BLOCKS)."""
    return _block(V, FORWARD_BLOCKS[-1] if smoothing > 0 or prob_target else FORWARD_BLOCKS[0])


def _heavy_body(weight, smoothing, softcap):
    """Whether the backward's body is heavy (BACKWARD_BLOCKS): softcap, or class weights with
    smoothing."""
    return softcap > 0 or (weight is not None and smoothing > 0)


def _backward_chunks(V, shift, heavy=False):
    """(BLOCK, chunks a row) of the backward for rows of V > 0 classes whose chunks start
    SHIFT-aligned (0: at the row's start; the classes outside them go with chunk 0), for a
    plain or a `heavy` body: see BACKWARD_BLOCKS."""
    sliced = V // shift * shift if shift else V  # what the chunks cover (cluster.window)
    for block in BACKWARD_BLOCKS[-1:] if heavy else BACKWARD_BLOCKS:
        chunk = _block(V, block)
        if sliced >= cdiv(sliced, chunk) * chunk * BACKWARD_FILL or block == BACKWARD_BLOCKS[-1]:
            return chunk, cdiv(sliced, chunk)


def _vectors(V, direction, rows):
    """(ALIGN, SHIFT) of the `direction` kernel's accesses to the rows of `rows` (the row
    tensors it reads or writes): SHIFT where their rows start short of 16-byte alignment
    (ODD_VOCAB_SHIFT: cluster.vector_shift), else ALIGN from the row length and strides."""
    boundary = VOCAB_BOUNDARY_BYTES[direction]
    strides = [t.stride(0) for t in rows]
    shift = cluster.vector_shift(V, *rows, boundary=boundary) if ODD_VOCAB_SHIFT else 0
    return (1 if shift else row_alignment(V, *strides)), shift


# --------------------------------------------------------------- tensor-level functions


def _weight_rows(weight, V, shift, per_class, placeholder):
    """(weights, row stride) as the forward kernels read them: with SHIFT (rows from their
    first boundary, `shift` elements apart) where the kernel reads every class's weight
    (per_class: smoothing, or probability targets), a table of `shift` rows, row h =
    weight[h:] (0 past V), each on a 16-byte boundary: a logits row with h classes before its
    first boundary reads its chunks' weights as vectors from table row h (from the weights
    themselves, at weight + h + j, they are 2-byte loads). Row 0 is the weights: w[t] reads
    it. Else the weights themselves (stride 1), or the placeholder without weights (never
    read). The backward reads the weights themselves: its table (SHIFT 64) cost more than it
    saved."""
    if weight is None:
        return placeholder, 1
    if not (shift and per_class):
        return weight, 1
    stride = cdiv(V, 16) * 16  # Triton specialises it as 16-divisible: the rows' loads are vectors
    padded = torch.nn.functional.pad(weight, (0, stride + shift - V))
    return padded.as_strided((shift, stride), (1, 1)).contiguous(), stride


def _mass_rows(M, weight, smoothing, prob_target):
    """Rows of the forward's mass output: B = sum_j w_j y'_j a row for probability targets,
    W = sum_j w_j a row for class weights with smoothing; else none."""
    return M if prob_target or (weight is not None and smoothing > 0) else 0


REDUCE_CODES = {"none": 0, "sum": 1, "mean": 2}


def _launch_forward(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target, reduction):
    """Per-row loss, (max, log-sum) pairs and mass (_mass_rows), float32, of x[M, V] (lse =
    max + log-sum); with reduction sum / mean also the reduced loss (0-d, x's dtype) and the
    mean's denominator (float32), from a second one-program kernel."""
    M, V = x.shape
    device = x.device
    loss = torch.empty(M, dtype=torch.float32, device=device)
    stats = torch.empty(M, 2, dtype=torch.float32, device=device)
    mass = torch.empty(_mass_rows(M, weight, smoothing, prob_target), dtype=torch.float32, device=device)
    reduce = REDUCE_CODES[reduction]
    out = torch.empty((), dtype=x.dtype, device=device) if reduce else loss
    denominator = torch.empty((), dtype=torch.float32, device=device) if reduce == 2 else loss
    if M == 0:
        return loss, stats, mass, out.fill_(0.0 if reduce == 1 else float("nan")), denominator.fill_(0.0)
    has_weight = weight is not None
    w = weight if has_weight else loss  # any pointer: never read without HAS_WEIGHT
    align, shift = _vectors(V, "forward", (x, target) if prob_target else (x,))
    weights, weight_stride = _weight_rows(weight, V, shift, smoothing > 0 or prob_target, loss)
    block = _forward_block(V, smoothing, prob_target)
    common = dict(HAS_WEIGHT=has_weight, SOFTCAP=softcap > 0, BLOCK=block, ALIGN=align, SHIFT=shift,
                  EVEN=shift == 0 and V % block == 0, num_warps=FORWARD_WARPS)
    if prob_target:
        launch(_forward_probs_kernel, (M,), x, target, weights, weight_stride, loss, stats, mass, V, x.stride(0),
               target.stride(0), smoothing, z_scale, softcap, **common)
    else:
        launch(_forward_kernel, (M,), x, target, weights, weight_stride, loss, stats, mass, V, x.stride(0),
               ignore_index, smoothing, z_scale, softcap, SMOOTH=smoothing > 0, **common)
    if reduce:
        launch(_reduce_kernel, (1,), loss, target, w, out, denominator, M, V, ignore_index, REDUCE=reduce,
               HAS_WEIGHT=has_weight, PROB=prob_target, BLOCK=REDUCE_BLOCK, num_warps=REDUCE_WARPS)
    return loss, stats, mass, out, denominator


def _forward(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int,
             smoothing: float, z_scale: float, softcap: float, prob_target: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, (max, log-sum) pair and mass (_mass_rows), all float32, of x[M, V]:
    lse = max + log-sum."""
    if not (runs_kernels(x) and x.dtype in KERNEL_DTYPES):
        return reference.cross_entropy_rows(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target)
    return _launch_forward(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target, "none")[:3]


def _backward(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
              stats: torch.Tensor, mass: torch.Tensor, ignore_index: int, smoothing: float, z_scale: float,
              softcap: float, prob_target: bool, inplace: bool, denominator: torch.Tensor | None = None
              ) -> torch.Tensor:
    """dloss/dx[M, V] from the gradient of each row's loss (grad of shape (M,)), or from the
    gradient of their sum (a 0-d grad), or of their mean (0-d, with its denominator)."""
    M, V = x.shape
    if not (runs_kernels(x) and x.dtype in KERNEL_DTYPES):
        if denominator is not None:  # the eager reduction's 0-d gradient, as the kernel takes it
            grad = grad / denominator
        dx = reference.cross_entropy_rows_backward(grad.expand(x.shape[0]), x, target, weight, stats, ignore_index,
                                                   smoothing, z_scale, softcap, prob_target)
        return x.copy_(dx) if inplace else dx
    dx = x if inplace else torch.empty_like(x)
    if M == 0 or V == 0:
        return dx
    has_weight = weight is not None
    w = weight if has_weight else stats
    grad_stride = grad.stride(0) if grad.dim() else 0
    align, shift = _vectors(V, "backward", (x, dx, target) if prob_target else (x, dx))
    block, chunks = _backward_chunks(V, shift, _heavy_body(weight, smoothing, softcap))
    grid = (M, chunks)
    common = dict(HAS_WEIGHT=has_weight, SOFTCAP=softcap > 0, MEAN=denominator is not None, BLOCK=block,
                  ALIGN=align, SHIFT=shift, num_warps=BACKWARD_WARPS)
    denominator = denominator if denominator is not None else stats
    if prob_target:
        launch(_backward_probs_kernel, grid, dx, x, target, w, stats, mass, grad, denominator, V, x.stride(0),
               target.stride(0), dx.stride(0), grad_stride, smoothing, z_scale, softcap, **common)
    else:
        launch(_backward_kernel, grid, dx, x, target, w, stats, mass, grad, denominator, V, x.stride(0), dx.stride(0),
               grad_stride, ignore_index, smoothing, z_scale, softcap, SMOOTH=smoothing > 0, **common)
    return dx


# ------------------------------------------------------------- autograd and torch.library
# As for softmax: eager calls take a plain autograd.Function (custom-op dispatch costs tens
# of microseconds of host time); torch.compile reaches the same functions as custom ops.


def _probability_target_grads(grad, x, y, weight, stats, smoothing, softcap, need_target, need_weight):
    """(dloss/dy, dloss/dweight) for probability targets, in torch (an (M, V) temporary, made
    only when the targets or the class weights require a gradient). Per row, with
    lse - x' = (max - x') + log-sum and y' = (1 - e) y + e / V:
        loss = sum_j w_j y'_j (lse - x'_j) + z lse^2
        dloss/dy_j = (1 - e) w_j (lse - x'_j),   dloss/dw_j = y'_j (lse - x'_j)"""
    compute = stats.dtype  # float32, float64 for float64 logits
    x = x.to(compute)
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    gap = ((stats[:, :1] - x) + stats[:, 1:]) * grad.to(compute)[:, None]
    dtarget = dweight = None
    if need_target:
        dtarget = gap * (1 - smoothing)
        dtarget = (dtarget * weight.to(compute) if weight is not None else dtarget).to(y.dtype)
    if need_weight:
        dweight = (gap * ((1 - smoothing) * y.to(compute) + smoothing / x.shape[1])).sum(0).to(weight.dtype)
    return dtarget, dweight


class _Reduction:
    """How the per-row losses become the returned loss: none (the target's shape), sum, or
    mean (divided by the kept rows' summed class weights; by the row count for probability
    targets). Also the derivative of that step, for the eager backward."""

    def __init__(self, reduction, target, weight, ignore_index, prob_target, batch_shape, dtype):
        self.reduction, self.batch_shape, self.dtype = reduction, batch_shape, dtype  # dtype: of the row losses
        self.target, self.weight, self.ignore_index, self.prob_target = target, weight, ignore_index, prob_target
        self._denominator = None

    def denominator(self):
        """The mean's denominator, made when first asked (the eager kernels compute their own)."""
        if self._denominator is None:
            target, kept, dtype = self.target, self.target != self.ignore_index, self.dtype
            if self.prob_target:
                self._denominator = torch.full((), float(target.shape[0]), dtype=dtype, device=target.device)
            elif self.weight is None:
                self._denominator = kept.sum().to(dtype)
            else:
                self._denominator = (self.weight.to(dtype)[torch.where(kept, target, 0).long()] * kept).sum()
        return self._denominator

    def __call__(self, rows):
        if self.reduction == "none":
            return rows.reshape(self.batch_shape)
        return rows.sum() if self.reduction == "sum" else rows.sum() / self.denominator()

    def row_gradients(self, grad, M):
        if self.reduction == "none":
            return grad.reshape(M)
        return (grad if self.reduction == "sum" else grad / self.denominator()).to(self.dtype).expand(M)


class _CrossEntropy(torch.autograd.Function):
    """Eager path: the kernels and the reduction as one autograd node. sum and mean are
    reduced by one kernel after the forward and un-reduced inside the backward kernel: a
    chain of small torch ops costs more host time than the kernels at LM sizes."""

    @staticmethod
    def forward(ctx, x, target, weight, options, reduce, inplace):
        fused = runs_kernels(x) and x.dtype in KERNEL_DTYPES and reduce.reduction != "none"
        if fused:
            _, stats, mass, loss, denominator = _launch_forward(x, target, weight, *options, reduce.reduction)
            denominator = denominator if reduce.reduction == "mean" else None
        else:
            rows, stats, mass = _forward(x, target, weight, *options)
            loss, denominator = reduce(rows).to(x.dtype), None
        ctx.save_for_backward(x, target, weight, stats, mass, denominator)
        ctx.options, ctx.reduce, ctx.inplace, ctx.fused = options, reduce, inplace, fused
        ctx.mark_non_differentiable(stats)
        ctx.set_materialize_grads(False)
        return loss, stats

    @staticmethod
    def backward(ctx, grad, _):
        x, target, weight, stats, mass, denominator = ctx.saved_tensors
        dtarget = dweight = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:  # first: they read the logits, which an
            grad_rows = ctx.reduce.row_gradients(grad, x.shape[0])  # in-place dx overwrites
            dtarget, dweight = _probability_target_grads(grad_rows, x, target, weight, stats, ctx.options[1],
                                                         ctx.options[3], *ctx.needs_input_grad[1:3])
        if ctx.fused and ctx.reduce.reduction != "none":  # the kernel un-reduces the scalar grad itself
            dx = _backward(grad, x, target, weight, stats, mass, *ctx.options, ctx.inplace, denominator)
        else:
            dx = _backward(ctx.reduce.row_gradients(grad, x.shape[0]), x, target, weight, stats, mass,
                           *ctx.options, ctx.inplace)
        if ctx.inplace:
            # The kernel wrote over the logits behind autograd's back: any other node that saved
            # them now raises autograd's "modified by an inplace operation" instead of
            # computing with the gradient's values.
            torch.autograd.graph.increment_version(x)
        return no_second_derivative((dx, dtarget, dweight, None, None, None), x, target, weight, grad)


_forward_op = torch.library.custom_op("pintail::cross_entropy_forward", _forward, mutates_args=())


@_forward_op.register_fake
def _cross_entropy_forward_fake(x, target, weight, ignore_index, smoothing, z_scale, softcap, prob_target):
    """Per row: loss (M,), (max, log-sum) (M, 2) and mass (_mass_rows); float32, float64 for
    float64 logits."""
    M, dtype = x.shape[0], torch.promote_types(x.dtype, torch.float32)
    return (x.new_empty(M, dtype=dtype), x.new_empty(M, 2, dtype=dtype),
            x.new_empty(_mass_rows(M, weight, smoothing, prob_target), dtype=dtype))


def _backward_no_inplace(grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                         stats: torch.Tensor, mass: torch.Tensor, ignore_index: int, smoothing: float,
                         z_scale: float, softcap: float, prob_target: bool) -> torch.Tensor:
    return _backward(grad, x, target, weight, stats, mass, ignore_index, smoothing, z_scale, softcap,
                     prob_target, inplace=False)


_backward_op = torch.library.custom_op("pintail::cross_entropy_backward", _backward_no_inplace, mutates_args=())


@_backward_op.register_fake
def _cross_entropy_backward_fake(grad, x, target, weight, stats, mass, ignore_index, smoothing, z_scale, softcap,
                                 prob_target):
    """dx: torch.empty_like of the (M, V) logits."""
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, target, weight, *options = inputs
    _, stats, mass = output
    ctx.save_for_backward(x, target, weight, stats, mass)
    ctx.options = tuple(options)


def _backward_of_op(ctx, grad, _stats, _mass):
    x, target, weight, stats, mass = ctx.saved_tensors
    dx = _backward_op(grad, x, target, weight, stats, mass, *ctx.options)
    dtarget = dweight = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        dtarget, dweight = _probability_target_grads(grad, x, target, weight, stats, ctx.options[1], ctx.options[3],
                                                     *ctx.needs_input_grad[1:3])
    return dx, dtarget, dweight, None, None, None, None, None


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


def _loss_and_stats(x, target, weight, options, reduce, inplace):
    """(the reduced loss in x's dtype, (max, log-sum) per row). Under torch.compile through the custom
    ops, with the reduction as traced torch ops (and the gradient never written in place)."""
    if torch.compiler.is_compiling():
        rows, stats, _ = _forward_op(x, target, weight, *options)
        return reduce(rows).to(x.dtype), stats
    return _CrossEntropy.apply(x, target, weight, options, reduce, inplace)


# ------------------------------------------------------------------------ public API


def _check(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """Validate the arguments as torch does; returns whether targets are probabilities."""
    name = "pintail.cross_entropy"
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError(f"{name}: input and target must be tensors, got {type(input).__name__} and "
                        f"{type(target).__name__}")
    if not input.dtype.is_floating_point:
        raise TypeError(f"{name}: input must be floating point logits, got dtype {input.dtype}")
    if input.dim() == 0:
        raise ValueError(f"{name}: input must have shape (C), (N, C) or (N, C, d1, ...), got a 0-d tensor")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: {reduction!r} is not a valid value for reduction; expected one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if z_loss < 0:
        raise ValueError(f"{name}: z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{name}: softcap must be None or > 0, got {softcap}")
    if target.device != input.device:
        raise ValueError(f"{name}: target is on {target.device}, expected input's device {input.device}")
    C = input.shape[0] if input.dim() == 1 else input.shape[1]
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.shape != (C,):
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{name}: weight must have shape ({C},), one per class, got {shape}")
        if weight.device != input.device:
            raise ValueError(f"{name}: weight is on {weight.device}, expected input's device {input.device}")
        if not weight.dtype.is_floating_point:
            raise TypeError(f"{name}: weight must be floating point, got dtype {weight.dtype}")
    prob_target = target.dtype.is_floating_point
    if prob_target:
        if target.shape != input.shape:
            raise ValueError(f"{name}: probability targets must have the input's shape {tuple(input.shape)}, "
                             f"got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError(f"{name}: ignore_index is not supported for probability (floating point) "
                             f"targets, got ignore_index={ignore_index}")
    else:
        if target.dtype not in (torch.int64, torch.int32, torch.uint8):
            raise TypeError(f"{name}: class-index targets must be int64, int32 or uint8, got {target.dtype}")
        expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
        if tuple(target.shape) != expected:
            raise ValueError(f"{name}: target must have shape {expected} for input of shape "
                             f"{tuple(input.shape)}, got {tuple(target.shape)}")
    return prob_target


def _check_target_values(target, C, ignore_index):
    """Raise on a class index outside [0, C) that is not ignore_index. This reads the
    targets on the host: one synchronisation."""
    bad = (target != ignore_index) & ((target < 0) | (target >= C))
    if bad.any():
        position = int(bad.nonzero()[0, 0])
        raise IndexError(f"pintail.cross_entropy: target[{position}] = {int(target[position])} is out of "
                         f"bounds: expected a class index in [0, {C}) or ignore_index ({ignore_index})")


class _TargetCheck:
    """The eager check of class indices, in two steps around the forward launch: making one
    launches a one-program kernel that counts the bad targets and records an event; finish()
    waits for that event (the forward kernel, launched in between, keeps running) and, if a
    target is bad, names it. On a GPU the kernel writes the count straight into pinned host
    memory (mapped into the GPU's address space), so no copy follows it on the stream."""

    def __init__(self, target, C, ignore_index):
        self.target, self.C, self.ignore_index = target, C, ignore_index
        if target.is_cuda:
            self.count = torch.empty(1, dtype=torch.int32, pin_memory=True)
        else:
            self.count = torch.empty(1, dtype=torch.int32, device=target.device)
        launch(_target_check_kernel, (1,), target, self.count, target.numel(), C, ignore_index,
               BLOCK=TARGET_CHECK_BLOCK, num_warps=4)
        self.done = None
        if target.is_cuda:
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(target.device))

    def wait(self):
        """Until the kernel is done: also before the pinned count may be freed, since torch's
        host allocator does not know that a kernel writes into it."""
        if self.done is not None:
            self.done.synchronize()

    def bad_targets(self) -> int:
        self.wait()
        return self.count.item()

    def finish(self):
        if self.bad_targets():
            _check_target_values(self.target, self.C, self.ignore_index)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  z_loss=0.0, softcap=None, return_z_loss=False, return_lse=False, inplace_backward=False,
                  check_target=True):
    """torch.nn.functional.cross_entropy, with Triton kernels on CUDA, plus extras.

    Takes what torch takes: input (C), (N, C) or (N, C, d1, ...) with classes on dim 1;
    class-index targets (int64, int32 or uint8) or class-probability targets (floating point,
    the input's shape); weight, ignore_index, reduction, label_smoothing. Returns what torch
    returns, in the input's dtype (computed in float32).

    Keyword-only extras:
    - z_loss: adds z_loss * lse^2 for every kept row (lse: the row's log-sum-exp), reduced
      with the loss (mean: by the same denominator).
    - softcap: logits become softcap * tanh(logits / softcap) first; the gradient goes through.
    - return_z_loss / return_lse: also return the z-loss term alone (reduced as the loss) and
      the float32 log-sum-exp of each row (target's shape), both without gradient, in that
      order after the loss: (loss, z_loss, lse).
    - inplace_backward: write the gradient into the logits' storage instead of a new tensor.
      Saves the (N, C) gradient's memory; the logits hold the gradient after backward, so use
      it only when nothing reads them afterwards. Another autograd node that saved the logits
      and runs its backward later raises autograd's "modified by an inplace operation" error.
      Leaf logits (made by the caller, not by an op) are never overwritten, and under
      torch.compile the gradient gets its own tensor.
    - check_target: in eager mode an out-of-range class index raises IndexError. A
      one-program kernel counts such targets before the forward; the host waits for that
      kernel only (not for the forward, which is launched before the wait), and scans the
      targets to name the bad one only when the count is not 0. With check_target=False, under
      torch.compile and while a CUDA graph is being captured there is no check: the kernels
      never read out of bounds, and a row with an out-of-range target gets a NaN loss and a
      NaN gradient, so the error shows in the loss.

    Rows of (N, C, d1, ...) inputs are gathered into an (N*d1*..., C) copy (classes are not
    contiguous there); (C) and (N, C) inputs with unit class stride are used in place.
    """
    prob_target = _check(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap)
    if not prob_target and weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("pintail.cross_entropy: not differentiable with respect to weight for class-index "
                           "targets (as torch's nll_loss); pass a weight that does not require grad")
    softcap = 0.0 if softcap is None else softcap  # 0: none, for the kernels
    C = input.shape[0] if input.dim() == 1 else input.shape[1]
    batch_shape = target.shape if not prob_target else (input.shape[:1] + input.shape[2:] if input.dim() > 1 else ())
    class_dim = 1 if input.dim() > 1 else 0
    x = as_rows(input, class_dim)
    if prob_target:
        t = as_rows(target, class_dim)
    else:  # the kernels index targets and weights with unit stride
        t = (target if target.dim() == 1 else target.reshape(-1)).contiguous()
    weight = weight.contiguous() if weight is not None else None
    target_check = None
    if not prob_target:
        tracing = torch.compiler.is_compiling() or (input.is_cuda and torch.cuda.is_current_stream_capturing())
        if check_target and not tracing and t.numel() > 0:
            if runs_kernels(x) and x.dtype in KERNEL_DTYPES:
                target_check = _TargetCheck(t, C, ignore_index)
            else:
                _check_target_values(t, C, ignore_index)
    options = (ignore_index, float(label_smoothing), float(z_loss), float(softcap), prob_target)
    reduce = _Reduction(reduction, t, weight, ignore_index, prob_target, batch_shape,
                        torch.promote_types(input.dtype, torch.float32))
    # in place only over an intermediate (e.g. a matmul's output), never over a leaf the caller made
    try:
        loss, stats = _loss_and_stats(x, t, weight, options, reduce, inplace_backward and not input.is_leaf)
    except BaseException:
        if target_check is not None:
            target_check.wait()
        raise
    if target_check is not None:
        target_check.finish()
    outputs = [loss]
    lse = stats.detach().sum(1) if return_z_loss or return_lse else None
    if return_z_loss:
        kept = torch.ones_like(lse) if prob_target else (t != ignore_index).float()
        outputs.append(reduce(z_loss * lse**2 * kept).to(input.dtype))
    if return_lse:
        outputs.append(lse.reshape(batch_shape))
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
