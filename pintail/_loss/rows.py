"""The per-row arithmetic every cross-entropy kernel shares, as Triton functions: the logits
of a chunk (softcapped), the online log-sum-exp fold, a row's loss from its folded sums, and
the gradient of a class-index row. cross_entropy's kernels and the chunk kernels of the
fused heads (kernels.py) are built from them."""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

@triton.jit
def tanh_and_slope(x, softcap):
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
def tanh_over(x, softcap):
    """tanh(x / softcap) (the slope's arithmetic is left out by the compiler)."""
    tanh, _ = tanh_and_slope(x, softcap)
    return tanh


@triton.jit
def softcapped(x, softcap):
    """softcap * tanh(x / softcap)."""
    return softcap * tanh_over(x, softcap)


@triton.jit
def weight_sum(mass_ptr, row, V, HAS_WEIGHT: tl.constexpr):
    """W = sum of the class weights that smoothing spreads over: V without weights, else the
    sum the forward took of the weights it read for the row (mass[row]; a torch sum instead
    cost two small kernels a call, forward and backward, and their host time)."""
    if HAS_WEIGHT:
        return tl.load(mass_ptr + row)
    return V * 1.0


@triton.jit
def z_factor(z_scale, z_ratio_ptr, Z_RATIO: tl.constexpr):
    """The z-loss factor of a row: z, times the mean's (sum of the kept rows' class weights /
    kept rows) where the loss is a weighted mean, so that the z-loss term is a mean over kept
    rows whatever the weights' scale."""
    if Z_RATIO:
        z_scale = z_scale * tl.load(z_ratio_ptr)
    return z_scale


@triton.jit
def load_logits(x_row, cols, mask, softcap, SOFTCAP: tl.constexpr):
    """A chunk of a row's logits in float32, softcapped if asked; -inf past the row's end."""
    x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
    if SOFTCAP:
        x = tl.where(mask, softcapped(x, softcap), -float("inf"))
    return x


@triton.jit
def load_class_weights(weights, classes, mask, HAS_WEIGHT: tl.constexpr):
    """The class weights of a chunk in float32 (0 past the row's end), or the mask without
    weights."""
    if HAS_WEIGHT:
        v = tl.load(weights + classes, mask=mask, other=0.0).to(tl.float32)
    else:
        v = mask
    return v


@triton.jit
def fold_chunk(x, v, running_max, running_sum, anchor, weighted_x, mass, SMOOTH: tl.constexpr,
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
def about_max(weighted_x, mass, running_max, anchor):
    """sum_j v_j (x_j - max) from the sum about the anchor and mass = sum_j v_j."""
    return weighted_x - mass * (tl.where(running_max == -float("inf"), 0.0, running_max) - anchor)


@triton.jit
def store_row_loss(loss_ptr, stats_ptr, row, t, x_t, weight_ptr, running_max, running_sum, anchor, weighted_x,
                    weight_total, V, ignore_index, smoothing, z_scale, z_ratio_ptr, HAS_WEIGHT: tl.constexpr,
                    SMOOTH: tl.constexpr, Z_RATIO: tl.constexpr):
    """A class-index row's loss (0 where ignored, NaN where its target is out of range) and its
    (max, log-sum) from its folded sums (fold_chunk), its target t, the target's logit x_t
    and W = weight_total (read with SMOOTH only)."""
    log_sum = tl.log2(running_sum) * LN2
    lse = running_max + log_sum
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < V)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range & ~ignored, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    z_scale = z_factor(z_scale, z_ratio_ptr, Z_RATIO)
    loss = (1.0 - smoothing) * w_t * ((running_max - x_t) + log_sum) + z_scale * lse * lse
    if SMOOTH:  # W * lse - sum_j w_j x_j; sum_j w_j (x_j - max) from the sum about the anchor
        loss += smoothing / V * (weight_total * log_sum - about_max(weighted_x, weight_total, running_max, anchor))
    loss = tl.where(ignored, 0.0, loss)
    loss = tl.where(in_range | ignored, loss, float("nan"))  # a bad target: NaN, never a wild read
    tl.store(loss_ptr + row, loss)
    tl.store(stats_ptr + 2 * row, running_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)


@triton.jit
def gradient_factors(g, t, in_range, weight_ptr, row_max, log_sum, smoothing, z_scale, z_ratio_ptr, total_ptr,
                      total_index, V, HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, Z_RATIO: tl.constexpr):
    """(coef, hit, spread) of a class-index row, each times its loss gradient g:
    dloss/dx_k = p_k * coef - hit [k == t] - spread * w_k. W (smoothing with weights) is
    total_ptr[total_index] (weight_sum)."""
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t, mask=in_range, other=0.0).to(tl.float32)
    else:
        w_t = 1.0
    coef = (1.0 - smoothing) * w_t + 2.0 * z_factor(z_scale, z_ratio_ptr, Z_RATIO) * (row_max + log_sum)
    if SMOOTH:
        coef += smoothing / V * weight_sum(total_ptr, total_index, V, HAS_WEIGHT)
    return coef * g, (1.0 - smoothing) * w_t * g, smoothing / V * g


@triton.jit
def class_gradient(x, at, mask, target_at, row_max, log_sum, coef, hit, spread, softcap, weights,
                    HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, SOFTCAP: tl.constexpr):
    """The gradient of logits x at classes `at` (from `weights`' class, where mask), the
    target at `target_at`, with the row's factors already times its loss gradient."""
    if SOFTCAP:
        tanh, slope = tanh_and_slope(x, softcap)
        x = softcap * tanh
    # x - max exact, as in the forward (logits of 1e4 keep their probabilities)
    p = tl.exp2((x - row_max) * LOG2E - log_sum * LOG2E)
    d = p * coef - tl.where(at == target_at, hit, 0.0)
    if SMOOTH:
        if HAS_WEIGHT:
            d -= spread * load_class_weights(weights, at, mask, True)
        else:
            d -= spread
    if SOFTCAP:
        d *= slope
    return d


@triton.jit
def chunk_program(target_ptr, n, ignore_index, num_classes, BLOCK: tl.constexpr):
    """A program over BLOCK of the n classes of a row's chunk (row: program_id 0, block:
    program_id 1): the row, the classes, their mask, the row's target, whether it is
    ignore_index and whether it is one of the num_classes classes."""
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(target_ptr + row).to(tl.int64)
    return row, at, at < n, t, t == ignore_index, (t >= 0) & (t < num_classes)
