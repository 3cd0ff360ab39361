"""The log_probs Triton kernels: a row's log-probability of its target and the entropy of its
distribution z = cap(x) / temperature, and their gradient over the logits."""

import triton
import triton.language as tl

from .._core.launch import aligned
from .._loss.rows import LN2, LOG2E, chunk_program, load_logits, softcapped, tanh_and_slope


@triton.jit
def _forward_kernel(x_ptr, x_row_stride, target_ptr, lp_ptr, entropy_ptr, stats_ptr, V, first_class, num_classes,
                    ignore_index, inv_temperature, softcap, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
                    PARTIAL: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One row of V classes (first_class ... of num_classes) in one pass: the online max and
    # sum of exp(z - max), with ENTROPY also sum exp(z - max) (z - max), rescaled as the max
    # moves; then lp = z_t - lse and H = log-sum - (that sum) / (sum of exp), and (max,
    # log-sum) for the backward. PARTIAL (a rank's slice of the vocabulary): the row's (max,
    # sum, entropy sum, z_t or 0) into stats instead, 4 a row, for the ranks to combine.
    V, x_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    running_max = -float("inf")
    running_sum = 0.0
    moment = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = load_logits(x_row, cols, mask, softcap, SOFTCAP) * inv_temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # a chunk of -inf adds 0, not NaN
        terms = tl.exp2((z - shift) * LOG2E)
        scale = tl.exp2((running_max - shift) * LOG2E)
        if ENTROPY:  # sum p (z - max) about the new max: the old sum moves by (old max - new max) a unit
            step = tl.where(running_max == -float("inf"), 0.0, running_max - shift)
            chunk_moment = tl.sum(tl.where(terms > 0.0, terms * (z - shift), 0.0), axis=0)
            moment = scale * (moment + step * running_sum) + chunk_moment
        running_sum = running_sum * scale + tl.sum(terms, axis=0)
        running_max = new_max
    t = tl.load(target_ptr + row).to(tl.int64)
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < num_classes)
    at = t - first_class
    z_t = tl.load(x_row + at, mask=(at >= 0) & (at < V) & ~ignored, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = softcapped(z_t, softcap)
    z_t *= inv_temperature
    if PARTIAL:
        tl.store(stats_ptr + 4 * row, running_max)
        tl.store(stats_ptr + 4 * row + 1, running_sum)
        tl.store(stats_ptr + 4 * row + 2, moment)
        tl.store(stats_ptr + 4 * row + 3, z_t)
        return
    log_sum = tl.log2(running_sum) * LN2
    lp = (z_t - running_max) - log_sum
    lp = tl.where(ignored, 0.0, tl.where(in_range, lp, float("nan")))  # a bad target: NaN, never a wild read
    tl.store(lp_ptr + row, lp)
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)
    if ENTROPY:
        entropy = log_sum - moment / running_sum
        tl.store(entropy_ptr + row, tl.where(ignored, 0.0, tl.where(in_range, entropy, float("nan"))))


@triton.jit
def _backward_kernel(dx_ptr, dx_row_stride, x_ptr, x_row_stride, target_ptr, stats_ptr, entropy_ptr, grad_lp_ptr,
                     grad_entropy_ptr, V, first_class, num_classes, ignore_index, inv_temperature, softcap,
                     SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    # One chunk of one row of V classes (first_class ... of num_classes): with p = softmax(z)
    # over all of them and log p = z - lse,
    #   d lp / dz_k = [k == t] - p_k,   d H / dz_k = -p_k (log p_k + H),
    # times the incoming gradients, 1 / temperature and the softcap's slope. dx may be x.
    V, x_row_stride, dx_row_stride = aligned(V, ALIGN), aligned(x_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    row, at, mask, t, ignored, in_range = chunk_program(target_ptr, V, ignore_index, num_classes, BLOCK)
    keep = tl.where(ignored, 0.0, tl.where(in_range, 1.0, float("nan")))  # ignored rows: no gradient
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    g_lp = tl.load(grad_lp_ptr + row) * keep
    x = tl.load(x_ptr + row * x_row_stride + at, mask=mask, other=0.0).to(tl.float32)
    if SOFTCAP:
        tanh, slope = tanh_and_slope(x, softcap)
        x = softcap * tanh
    log_p = (x * inv_temperature - row_max) - log_sum
    p = tl.exp2(log_p * LOG2E)
    d = tl.where(at == t - first_class, g_lp, 0.0) - g_lp * p
    if ENTROPY:
        g_h = tl.load(grad_entropy_ptr + row) * keep
        d -= g_h * tl.where(p > 0.0, p * (log_p + tl.load(entropy_ptr + row)), 0.0)  # p = 0: no term, not NaN
    d *= inv_temperature
    if SOFTCAP:
        d *= slope
    tl.store(dx_ptr + row * dx_row_stride + at, d.to(dx_ptr.dtype.element_ty), mask=mask)
