"""rms_norm and layer_norm: Triton kernels, autograd, torch.library registration.

Per row of N features (RMS: mean = 0), with w_eff = weight + weight_offset:
    rstd = 1 / sqrt(mean((x - mean)^2) + eps),  x^ = (x - mean) * rstd,  y = x^ * w_eff + bias
Backward, with g = dy * w_eff:
    dx = rstd * (g - x^ * mean(g x^))                (RMS)
    dx = rstd * (g - mean(g) - x^ * mean(g x^))      (LayerNorm)
    dweight = sum over rows of dy * x^,  dbias = sum over rows of dy
A fused residual (pre-norm blocks): h = x + residual is normalised and returned too; the
gradient reaching h from downstream adds to dx (and is also the residual's gradient).

Kernels, six plans by row length N (tables at the end of the kernels):
- rows: whole rows in registers. The forward reads a tile of rows once and writes it once;
  the backward is persistent, each program walking a fixed set of row tiles, writing dx
  and keeping dweight / dbias of its rows in registers, written once as a partial row.
  Where a row would leave its next_power_of_2(N) tile part empty, it can go as two tiles
  (rows_tail: 5120 = 4096 + 1024), so that no lane computes past the row.
- long: a program per row in two passes (statistics, then the output), the second pass
  re-reading the row (also RMSNorm's forward of rows of 513-16384, as one chunk); the
  backward (LayerNorm) on a grid of (row blocks x column chunks), each program keeping its
  chunk's dweight / dbias in registers, after a first small kernel has computed each row's
  sums mean(g x^), mean(g) (x and dy are read twice).
- packed (LayerNorm's forward of 16-bit rows of 28672-32768): the row in registers as
  32-bit words of two values, read once, the output written in parts.
- split (forward, the longest rows): ticket-ordered slices (pintail/_split.py), each
  publishing its sums, the output written `lag` rows behind from a re-read that hits L2:
  x read from HBM once, y written once.
- blocks (RMSNorm backward, rows past the rows plan): ticket-ordered (block of rows, slice)
  pairs; a block's slices exchange each row's sum of g x^ and write dx from registers: x
  and dy read once, dx written once.
- cluster (GPUs with thread-block clusters; the backward of rows of 8193-32768 without a
  residual's gradient, RMSNorm's forward of rows of 32769-262144 without a residual): a
  row across the CTAs of a cluster (pintail/_cluster.py), each holding its slice of x (and
  dy), the slices' sums (of x^2; of g and g x^) traded through distributed shared memory;
  every tensor read once and written once, one partial row of dweight / dbias a cluster.
The backward's partial rows of dweight / dbias are summed in a fixed order by one more
kernel (deterministic: no atomics), which writes them in the parameters' dtypes.
Means divide by multiplying with 1/N from the host: Triton's float32 division is approximate,
and sum(g)/1 must be g exactly (the LayerNorm gradient of a row of one element is 0).
"""

import math

import torch
import triton
import triton.language as tl

from . import _cluster as cluster, _split as split, reference
from ._launch import (INTERPRET, KERNEL_DTYPES, aligned, cdiv, in_row, launch, next_power_of_2, no_second_derivative,
                      pack_pairs, packs_into_words, program_slots, row_alignment, rows_tail, runs_kernels,
                      unit_stride, unpack_pairs, whole_tiles, widened_tail)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _forward_rows_kernel(x_ptr, residual_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, inv_n,
                         x_row_stride, residual_row_stride, h_row_stride, y_row_stride, eps, weight_offset,
                         RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         TAIL: tl.constexpr, EVEN: tl.constexpr, ALIGN: tl.constexpr, STATS: tl.constexpr):
    # A tile of BLOCK_M whole rows in registers: x read once, y written once; the variance
    # from deviations about the mean (two passes over registers, not over HBM). A program
    # per tile: a persistent grid that loaded the weight once measured 0.05 lower. EVEN
    # (N == BLOCK_N + TAIL, M a multiple of BLOCK_M): no masks (_launch.in_row). STATS: store
    # mean / rstd for the backward (4-byte stores a row cost LayerNorm 0.025 of copy at 1024).
    # TAIL > 0: the row is two tiles, BLOCK_N columns and TAIL more, so that a row of
    # 5120 = 4096 + 1024 computes on 5120 lanes, not on a tile of 8192 (rows_tail).
    if ALIGN > 1:  # row length and strides multiples of ALIGN (_launch.row_alignment): vector loads
        N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
        residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = in_row(rows, M, EVEN)
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    HEAD_IN_ROW: tl.constexpr = EVEN or TAIL > 0  # with a tail every head column is in the row (rows_tail)
    x, mask = _rows_piece(x_ptr, residual_ptr, h_ptr, rows, row_mask, cols, N, x_row_stride, residual_row_stride,
                          h_row_stride, HAS_RESIDUAL, HEAD_IN_ROW)
    if TAIL > 0:
        tail_cols = BLOCK_N + tl.arange(0, TAIL)
        x_tail, tail_mask = _rows_piece(x_ptr, residual_ptr, h_ptr, rows, row_mask, tail_cols, N, x_row_stride,
                                        residual_row_stride, h_row_stride, HAS_RESIDUAL, EVEN)
    mean = tl.zeros((BLOCK_M,), tl.float32)  # RMS
    if RMS:
        var = tl.sum(x * x, axis=1)
        if TAIL > 0:
            var += tl.sum(x_tail * x_tail, axis=1)
        var *= inv_n
    else:  # the row's first value, from L1: the pilot below (layer_norm takes no residual)
        pilot = tl.load(x_ptr + rows * x_row_stride, mask=row_mask, other=0.0).to(tl.float32)
        squares, sums = _shifted_sums(x, pilot[:, None], mask, 1)
        if TAIL > 0:
            squares, sums = _add_pairs(squares, sums, *_shifted_sums(x_tail, pilot[:, None], tail_mask, 1))
        shifted_mean, var, flagged = _moments(squares, sums, inv_n)
        mean = pilot + shifted_mean
        if tl.max(flagged.to(tl.int32), axis=0) > 0:  # rare: the deviations, from the registers
            deviations, drift = _deviation_sums(x, mean[:, None], mask, 1)
            if TAIL > 0:
                deviations, drift = _add_pairs(deviations, drift,
                                               *_deviation_sums(x_tail, mean[:, None], tail_mask, 1))
            exact_mean, exact_var = _corrected(mean, deviations, drift, inv_n)
            mean = tl.where(flagged, exact_mean, mean)
            var = tl.where(flagged, exact_var, var)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(var + eps)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    _write_rows_piece(y_ptr, w_ptr, b_ptr, x, mean, rstd, rows, cols, mask, N, y_row_stride, weight_offset,
                      RMS, HAS_WEIGHT, HAS_BIAS, HEAD_IN_ROW)
    if TAIL > 0:
        _write_rows_piece(y_ptr, w_ptr, b_ptr, x_tail, mean, rstd, rows, tail_cols, tail_mask, N, y_row_stride,
                          weight_offset, RMS, HAS_WEIGHT, HAS_BIAS, EVEN)


@triton.jit
def _rows_piece(x_ptr, residual_ptr, h_ptr, rows, row_mask, cols, N, x_row_stride, residual_row_stride, h_row_stride,
                HAS_RESIDUAL: tl.constexpr, WHOLE: tl.constexpr):
    """The rows' columns `cols` of x, or of h = x + residual (rounded to its dtype once, as
    torch's x + residual, and stored), in float32; and their mask. WHOLE: cols all in the row."""
    mask = row_mask[:, None] & in_row(cols, N, WHOLE)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + rows[:, None] * residual_row_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        h = x.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * h_row_stride + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x, mask


@triton.jit
def _write_rows_piece(y_ptr, w_ptr, b_ptr, x, mean, rstd, rows, cols, mask, N, y_row_stride, weight_offset,
                      RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, WHOLE: tl.constexpr):
    """y = (x - mean) * rstd * (weight + weight_offset) + bias at the rows' columns `cols`
    (RMS: mean 0; WHOLE: cols all in the row)."""
    col_mask = in_row(cols, N, WHOLE)
    y = x * rstd[:, None] if RMS else (x - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + weight_offset
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_long_kernel(x_ptr, residual_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, inv_n,
                    x_row_stride, residual_row_stride, h_row_stride, y_row_stride, eps, weight_offset,
                    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr, EVEN: tl.constexpr,
                    ALIGN: tl.constexpr, STATS: tl.constexpr):
    # One row, two passes: the second re-reads the row from L2, which keeps it when the rows
    # in flight fit and pass 1 marks its loads evict_last (pass 2's evict_first). With a
    # residual, pass 2 reads the h just stored: no hints there (not measured). ONE_CHUNK
    # (BLOCK >= N): loops of one trip known at compile time, so straight-line code, where the
    # compiler may issue pass 2's loads before pass 1's reduction ends. EVEN: unmasked
    # (_launch.in_row).
    if ALIGN > 1:  # as in the rows kernel
        N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
        residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    end = BLOCK if ONE_CHUNK else N
    keep: tl.constexpr = "" if HAS_RESIDUAL else "evict_last"
    drop: tl.constexpr = "" if HAS_RESIDUAL else "evict_first"
    row = tl.program_id(0).to(tl.int64)
    # pass 1: statistics (and h = x + residual, written once); LayerNorm's as in the rows
    # plan (_shifted_sums), chunk by chunk, and for a flagged row (_moments) a pass more
    # over the chunks, from L2.
    pilot = tl.load(x_ptr + row * x_row_stride).to(tl.float32)  # LayerNorm's (which takes no residual)
    squares = 0.0  # RMS: of x; LayerNorm: of s = x - pilot
    sums = 0.0  # LayerNorm: of s
    for start in range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, N, EVEN)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=keep).to(tl.float32)
        if HAS_RESIDUAL:  # h = x + residual, rounded to its dtype once, as torch's x + residual
            x += tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            h = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * h_row_stride + cols, h, mask=mask)
            x = h.to(tl.float32)
        if RMS:
            squares += tl.sum(x * x, axis=0)
        else:
            chunk_squares, chunk_sums = _shifted_sums(x, pilot, mask, 0)
            squares += chunk_squares
            sums += chunk_sums
    shifted_mean, var, flagged = _moments(squares, sums, inv_n)
    mean = pilot + shifted_mean
    if not RMS and flagged:  # rare; s from x again, from L2 (layer_norm takes no residual)
        deviations = 0.0
        drift = 0.0
        for start in range(0, end, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = in_row(cols, N, EVEN)
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=keep).to(tl.float32)
            chunk_deviations, chunk_drift = _deviation_sums(x, mean, mask, 0)
            deviations += chunk_deviations
            drift += chunk_drift
        mean, var = _corrected(mean, deviations, drift, inv_n)
    rstd = 1.0 / tl.sqrt(var + eps)
    # pass 2: the output
    for start in range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, N, EVEN)
        if HAS_RESIDUAL:  # h as stored, so that forward and backward see the same rounding
            x = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=drop).to(tl.float32)
        y = (x - mean) * rstd if not RMS else x * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    # mean / rstd last: stored before pass 2, LayerNorm's 16384 / 8 warps took 100 registers
    # on sm_90 (two programs an SM) against 71 without them, 74 stored here (three)
    if STATS:
        if not RMS:
            tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)


@triton.jit
def _forward_packed_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, inv_n, x_row_stride, y_row_stride,
                           eps, zero, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BF16: tl.constexpr,
                           BLOCK: tl.constexpr, PARTS: tl.constexpr, EVEN: tl.constexpr, STATS: tl.constexpr):
    # LayerNorm of a row of N (even, <= BLOCK) 16-bit values held as BLOCK / 2 words of two
    # (softmax's packed plan): x read from HBM once, the exact two-pass statistics from the
    # registers, then y in PARTS parts. `zero` is a runtime 0 the compiler cannot fold: each
    # pass unpacks the words again through `words ^ (zero & bits of the last reduction)`,
    # and each part's weight / bias loads wait for the previous part's output the same way,
    # so only the words and one part's w and b live at once (64 registers at 32768 / 16 warps
    # / 4 parts: two programs an SM; 70 as one part).
    row = tl.program_id(0).to(tl.int64)
    WORDS: tl.constexpr = BLOCK // 2
    PART: tl.constexpr = WORDS // PARTS
    words = tl.arange(0, WORDS)
    in_words = in_row(words, N // 2, EVEN)
    packed = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (x_row_stride // 2) + words, mask=in_words,
                     other=0)
    low, high = unpack_pairs(packed, BF16)
    mean = tl.sum(low + high, axis=0) * inv_n
    low, high = unpack_pairs(packed ^ (zero & mean.to(tl.int32, bitcast=True)), BF16)
    squares = tl.where(in_words, (low - mean) * (low - mean) + (high - mean) * (high - mean), 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) * inv_n + eps)
    if STATS:
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)
    tie = zero & rstd.to(tl.int32, bitcast=True)
    parts = tl.reshape(packed, [PARTS, PART])
    offs = tl.arange(0, PART)
    for p in tl.static_range(PARTS):
        part = tl.sum(tl.where(tl.arange(0, PARTS)[:, None] == p, parts, 0), axis=0)  # row p of the tile
        low, high = unpack_pairs(part ^ tie, BF16)
        cols = p * PART + tie * 16 + offs  # tie * 16: known 16-divisible, so the loads stay 16 bytes wide
        mask = in_row(cols, N // 2, EVEN)
        low = (low - mean) * rstd
        high = (high - mean) * rstd
        if HAS_WEIGHT:
            w_low, w_high = unpack_pairs(tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + cols, mask=mask, other=0), BF16)
            low *= w_low
            high *= w_high
        if HAS_BIAS:
            b_low, b_high = unpack_pairs(tl.load(b_ptr.to(tl.pointer_type(tl.int32)) + cols, mask=mask, other=0), BF16)
            low += b_low
            high += b_high
        y = pack_pairs(low, high, BF16)
        tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + row * (y_row_stride // 2) + cols, y, mask=mask)
        tie = zero & tl.max(y, axis=0)


@triton.jit
def _load_normalised(x_ptr, residual_ptr, h_ptr, row, cols, mask, x_row_stride, residual_row_stride,
                     HAS_RESIDUAL: tl.constexpr):
    """x, or h = x + residual rounded to h's dtype, in float32: what the norm normalises."""
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(h_ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


_INTERPRETED = tl.constexpr(INTERPRET)


@triton.jit
def _pair_sums(a, b, axis: tl.constexpr):
    """(sum a, sum b) over `axis` as one reduction: one round of barriers on the GPU, where
    two sums take two. The interpreter runs a reduction with its own combine as a Python
    loop in element order (float32 error ~N ulps, where the GPU's tree has ~log N; and
    slow), so there the pair is two tl.sum, numpy's pairwise sums, as accurate as the tree."""
    if _INTERPRETED:
        return tl.sum(a, axis), tl.sum(b, axis)
    else:
        return tl.reduce((a, b), axis, _add_pairs)


@triton.jit
def _shifted_sums(x, pilot, mask, axis: tl.constexpr):
    """LayerNorm's (sum s^2, sum s) of s = x - pilot (the row's first value, a shift that
    keeps a large mean from swamping the spread) over `axis`, in x's dtype (float32; the
    split plan's float64), as one reduction (one round of barriers; two sums took two).
    In float32, E[s^2] - E[s]^2 still cancels when the values sit far from the pilot
    against their spread (a first value that stands out): _moments flags those rows. The
    output centres x itself, x - mean: s rounds at the scale of x - pilot, which for those
    rows is the outlier's."""
    s = tl.where(mask, x - pilot, 0.0)
    return _pair_sums(s * s, s, axis)


@triton.jit
def _moments(squares, sums, inv_count):
    """(mean, biased variance) of s from its sums, and whether E[s^2] - E[s]^2 cancelled
    past 3 bits (E[s^2] > 8 var: a first value more than ~2.6 standard deviations from the
    mean, ~1 % of rows of normal values). A flagged row takes _deviation_sums. Float64 sums
    instead (exact for every row) cost 0.05-0.15 of copy."""
    mean = sums * inv_count
    var = tl.maximum(squares * inv_count - mean * mean, 0.0)
    # also flagged: squares that overflowed (inf, or NaN from inf - inf), which the
    # deviations may not (values of ~1e19 far from the pilot)
    return mean, var, ~(squares * inv_count <= 8.0 * var) | (squares == float("inf"))


@triton.jit
def _deviation_sums(x, mean, mask, axis: tl.constexpr):
    """(sum d^2, sum d) of d = x - mean, the first estimate of the mean: E[d] ~ 0, so they
    cannot cancel (the corrected two-pass form)."""
    d = tl.where(mask, x - mean, 0.0)
    return _pair_sums(d * d, d, axis)


@triton.jit
def _corrected(mean, squares, sums, inv_count):
    """(mean, variance) from the deviations' sums: sum d also mends the first mean, whose
    float32 sum of large s was off by ~1e-6 of it. Where sum d^2 overflowed (values past
    ~1e19) the variance is inf, as torch's float32 one: rstd 0, not the NaN of inf minus a
    correction^2 that overflowed with it."""
    correction = sums * inv_count
    var = tl.maximum(squares * inv_count - correction * correction, 0.0)
    return mean + correction, tl.where(squares == float("inf"), float("inf"), var)


@triton.jit
def _forward_split_kernel(x_ptr, residual_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slots_ptr, M, N,
                          inv_n, x_row_stride, residual_row_stride, h_row_stride, y_row_stride, eps, weight_offset,
                          SLICES, LAG, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr,
                          ALIGN: tl.constexpr):
    # Ticket-ordered slices (pintail/_split.py). Each slice publishes, RMS: (sum x^2, 1.0);
    # LayerNorm: (sum of squared deviations from the slice's own mean, sum x), from float64
    # sums of s = x - first (the row's first value); the first word with its lowest mantissa
    # bit set so that it is never 0 (it adds one ulp, or 1.4e-45 to a zero). The waiter
    # merges them (Chan et al.): a sum of squares that cannot cancel, and a mean of x itself,
    # not first + mean(s), which would round at the scale of x - first. The lagged write
    # recomputes h = x + residual from its inputs (from L2) rather than re-reading the h just
    # stored by another program, which would need a release / acquire pair to be visible.
    if ALIGN > 1:  # as in the rows kernel
        N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
        residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        new = (cols < N) & (row < M)
        old = (cols < N) & (done >= 0)
        if HAS_RESIDUAL:
            x_new = _load_normalised(x_ptr, residual_ptr, h_ptr, row, cols, new, x_row_stride, residual_row_stride,
                                     HAS_RESIDUAL)
            x_old = _load_normalised(x_ptr, residual_ptr, h_ptr, done, cols, old, x_row_stride, residual_row_stride,
                                     HAS_RESIDUAL)
        else:  # held in the input's dtype until used: LayerNorm at 4 warps takes 128 registers, not 168
            x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=new, other=0.0)
            x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=old, other=0.0)
        if not RMS:  # the row's first value (the shift), issued with the slices' loads
            first = tl.load(x_ptr + row * x_row_stride, mask=row < M, other=0.0).to(tl.float64)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            if HAS_RESIDUAL:
                tl.store(h_ptr + row * h_row_stride + cols, x_new.to(h_ptr.dtype.element_ty), mask=new)
            if RMS:
                x32 = x_new.to(tl.float32)
                split.publish(slots_ptr, ticket, tl.sum(x32 * x32, axis=0), tl.full((), 1.0, tl.float32))
            else:
                # float64 sums here (exact for every slice): the flagged form measured 0.03-0.05 lower
                squares, sums = _shifted_sums(x_new.to(tl.float64), first, new, 0)
                count = tl.minimum(N - (ticket % SLICES) * BLOCK, BLOCK).to(tl.float64)
                deviations = tl.maximum(squares - sums * sums / count, 0.0).to(tl.float32)
                marked = (deviations.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
                deviations = tl.where(deviations == float("inf"), deviations, marked)  # inf | 1 would be NaN
                split.publish(slots_ptr, ticket, deviations, (sums + count * first).to(tl.float32))
        if done >= 0:
            squares, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            if RMS:
                centred = x_old.to(tl.float32)
                var = tl.sum(tl.where(valid, squares, 0.0), axis=0) * inv_n
            else:  # squares: each slice's squared deviations from its own mean
                counts = tl.maximum(tl.minimum(N - tl.arange(0, SLICES_POW2) * BLOCK, BLOCK), 1).to(tl.float32)
                mean = tl.sum(tl.where(valid, sums, 0.0), axis=0) * inv_n
                between = tl.where(valid, sums / counts - mean, 0.0)
                var = tl.sum(tl.where(valid, squares, 0.0) + counts * between * between, axis=0) * inv_n
                centred = x_old.to(tl.float32) - mean
                tl.store(mean_ptr + done, mean, mask=ticket % SLICES == 0)
            rstd = 1.0 / tl.sqrt(var + eps)
            tl.store(rstd_ptr + done, rstd, mask=ticket % SLICES == 0)
            y = centred * rstd
            if HAS_WEIGHT:
                y *= tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32) + weight_offset
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


@triton.jit
def _widened_bf16(x):
    """bf16 x as float32 through its bits: the compiler merges a second x.to(tl.float32)
    with the first and then holds the float32 values across everything between."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _cluster_row(x_ptr, residual_ptr, row, M, cols, col_mask, x_row_stride, residual_row_stride,
                 RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """This CTA's slice of x's row and of the residual's (HAS_RESIDUAL; else x again), in their
    own dtypes, zeros past M, and for LayerNorm the row's first value as float32 (the pilot
    its sums are shifted by)."""
    in_rows = row < M
    row64 = row.to(tl.int64)
    x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=col_mask & in_rows, other=0.0)
    residual = x
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row64 * residual_row_stride + cols, mask=col_mask & in_rows, other=0.0)
    pilot = 0.0
    if not RMS:
        pilot = tl.load(x_ptr + row64 * x_row_stride, mask=in_rows, other=0.0).to(tl.float32)
    return x, residual, pilot


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_kernel(x_ptr, residual_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, inv_n,
                            x_row_stride, residual_row_stride, h_row_stride, y_row_stride, eps, weight_offset,
                            WORDS, ROUNDS, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                            HAS_BIAS: tl.constexpr, STATS: tl.constexpr, BLOCK: tl.constexpr,
                            CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, ALIGN: tl.constexpr,
                            BF16_HELD: tl.constexpr, AHEAD: tl.constexpr = False):
    # A row across the CLUSTER CTAs of a cluster (softmax's cluster plan),
    # the clusters persistent: CTA `rank` holds slice `rank` of the row in registers, trades
    # its statistics with its peers (RMSNorm: its sum of squares; LayerNorm: its sums of x
    # shifted by the row's first value, and for a flagged row a second round, _moments) and
    # writes its slice of y: x read once, y written once. The weight and bias are re-read
    # each row after the exchange, so their registers are not live across it (Nsight
    # Compute: two in three to three in four of those loads hit L1).
    # BF16_HELD (bf16 x: LayerNorm's always, RMSNorm's with AHEAD): x is held across the
    # exchange in its 16 bits and widened again after it by a shift (exact), not as float32
    # (twice the registers): 157 -> 119 registers at 8192 / 4 warps, +0.015-0.02 of copy.
    # RMSNorm lost 0.09 with it alone at 131072 (128 -> 80 registers, 6 CTAs an SM instead of
    # 4).
    # AHEAD: the next row's x (and pilot) is loaded at the top of this row, so its bytes are
    # in flight across this row's exchange and stores (softmax's persistent plan); with x
    # held in 16 bits it fits the registers that held float32 x (FORWARD_CLUSTER_BF16, where
    # RMSNorm takes both at 131073-262144).
    # HAS_RESIDUAL (RMSNorm): the row normalised is h = x + residual, rounded to h's dtype once
    # as torch's, stored before the exchange and held in that dtype (BF16_HELD: h is bf16).
    tl.static_assert(RMS or not HAS_RESIDUAL, "LayerNorm takes no residual")
    if ALIGN > 1:  # as in the rows kernel
        N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
        residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    exchanges = 0  # the exchanges so far (they take the buffers in turn): LayerNorm's flagged rows take two
    if AHEAD:
        x_next, residual_next, pilot_next = _cluster_row(x_ptr, residual_ptr, first_row, M, cols, col_mask,
                                                         x_row_stride, residual_row_stride, RMS, HAS_RESIDUAL)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters  # every CTA runs every round: rows past M join with zeros
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        if AHEAD:
            x_held, residual, pilot = x_next, residual_next, pilot_next
            x_next, residual_next, pilot_next = _cluster_row(x_ptr, residual_ptr, row + clusters, M, cols, col_mask,
                                                             x_row_stride, residual_row_stride, RMS, HAS_RESIDUAL)
        else:
            x_held, residual, pilot = _cluster_row(x_ptr, residual_ptr, row, M, cols, col_mask, x_row_stride,
                                                   residual_row_stride, RMS, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            x_held = (x_held.to(tl.float32) + residual.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row64 * h_row_stride + cols, x_held, mask=mask)
        x = x_held.to(tl.float32)
        if RMS:
            _, squares, token = cluster.exchange_sums(WORDS, exchanges, tl.full((), 0.0, tl.float32),
                                                      tl.sum(x * x, axis=0), token, CLUSTER, CLUSTER_POW2)
            exchanges += 1
            mean = 0.0
            rstd = 1.0 / tl.sqrt(squares * inv_n + eps)
        else:  # one exchange of the shifted sums about the row's first value, as the rows kernel
            squares, sums = _shifted_sums(x, pilot, mask, 0)
            squares, sums, token = cluster.exchange_sums(WORDS, exchanges, squares, sums, token, CLUSTER,
                                                         CLUSTER_POW2)
            exchanges += 1
            shifted_mean, var, flagged = _moments(squares, sums, inv_n)
            mean = pilot + shifted_mean
            if flagged:  # rare; every CTA has the same sums, so the whole cluster trades again
                if BF16_HELD:
                    x = _widened_bf16(x_held)
                deviations, drift = _deviation_sums(x, mean, mask, 0)
                deviations, drift, token = cluster.exchange_sums(WORDS, exchanges, deviations, drift, token,
                                                                 CLUSTER, CLUSTER_POW2)
                exchanges += 1
                mean, var = _corrected(mean, deviations, drift, inv_n)
            rstd = 1.0 / tl.sqrt(var + eps)
        if BF16_HELD:
            x = _widened_bf16(x_held)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row64 * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(rstd_ptr + row, rstd, mask=in_rows & (rank == 0))
            if not RMS:
                tl.store(mean_ptr + row, mean, mask=in_rows & (rank == 0))


# ---------------------------------------------------------------------------- backward


@triton.jit
def _backward_rows_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                          x_row_stride, dy_row_stride, dh_row_stride, dx_row_stride, weight_offset,
                          RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr,
                          EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # Persistent: program p takes the tiles p, p + P, ... of BLOCK_M whole rows (a fixed
    # order, so dweight / dbias come out the same on every run), writes their dx and keeps
    # dy * x^ and dy summed over its rows in registers; one partial row each at the end.
    # The next tile's x and dy are loaded before this tile is computed and stored, so that
    # a program always has reads in flight (few programs fit on an SM at these registers).
    # TAIL > 0: the row as two tiles, BLOCK_N columns and TAIL more (as the forward's).
    if ALIGN > 1:  # as in the forward: vector loads and stores for rows of 8- or 4-divisible length
        N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
        dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    HEAD_IN_ROW: tl.constexpr = EVEN or TAIL > 0  # with a tail every head column is in the row (rows_tail)
    cols = tl.arange(0, BLOCK_N)
    w_eff = _weight_piece(w_ptr, cols, N, weight_offset, HAS_WEIGHT, HEAD_IN_ROW)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if TAIL > 0:
        tail_cols = BLOCK_N + tl.arange(0, TAIL)
        w_tail = _weight_piece(w_ptr, tail_cols, N, weight_offset, HAS_WEIGHT, EVEN)
        dw_tail = tl.zeros([BLOCK_M, TAIL], dtype=tl.float32)
        db_tail = tl.zeros([BLOCK_M, TAIL], dtype=tl.float32)
    tiles = tl.cdiv(M, BLOCK_M)
    step = tl.num_programs(0)
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    x_next, dy_next = _rows_x_dy(x_ptr, dy_ptr, rows, cols, M, N, x_row_stride, dy_row_stride, HEAD_IN_ROW)
    if TAIL > 0:
        x_tail_next, dy_tail_next = _rows_x_dy(x_ptr, dy_ptr, rows, tail_cols, M, N, x_row_stride, dy_row_stride,
                                               EVEN)
    for tile in range(tl.program_id(0), tiles, step):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        if TAIL > 0:
            x_tail = x_tail_next.to(tl.float32)
            dy_tail = dy_tail_next.to(tl.float32)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows = rows.to(tl.int64)
        following = rows + step * BLOCK_M
        x_next, dy_next = _rows_x_dy(x_ptr, dy_ptr, following, cols, M, N, x_row_stride, dy_row_stride, HEAD_IN_ROW)
        if TAIL > 0:
            x_tail_next, dy_tail_next = _rows_x_dy(x_ptr, dy_ptr, following, tail_cols, M, N, x_row_stride,
                                                   dy_row_stride, EVEN)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        mean = rstd  # RMS: not read
        if not RMS:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)[:, None]
        mask = row_mask[:, None] & in_row(cols, N, HEAD_IN_ROW)[None, :]
        x_hat, g = _gradient_terms(x, dy, w_eff, mean, rstd, mask, RMS, HAS_WEIGHT)
        if TAIL > 0:
            tail_mask = row_mask[:, None] & in_row(tail_cols, N, EVEN)[None, :]
            x_hat_tail, g_tail = _gradient_terms(x_tail, dy_tail, w_tail, mean, rstd, tail_mask, RMS, HAS_WEIGHT)
        if RMS:
            sum_gx = tl.sum(g * x_hat, axis=1)
            if TAIL > 0:
                sum_gx += tl.sum(g_tail * x_hat_tail, axis=1)
            sum_g = sum_gx  # not read
        elif BLOCK_N <= 4096:  # one reduction, one round of barriers: 0.87 of copy at 4096, 0.80 with two
            sum_gx, sum_g = _pair_sums(g * x_hat, g, 1)
            if TAIL > 0:
                sum_gx, sum_g = _add_pairs(sum_gx, sum_g, *_pair_sums(g_tail * x_hat_tail, g_tail, 1))
        else:  # at 8192 (16 warps a row) two sums measured 0.76, one reduction 0.73
            sum_gx = tl.sum(g * x_hat, axis=1)
            sum_g = tl.sum(g, axis=1)
            if TAIL > 0:
                sum_gx += tl.sum(g_tail * x_hat_tail, axis=1)
                sum_g += tl.sum(g_tail, axis=1)
        mean_gx = (sum_gx * inv_n)[:, None]
        mean_g = (sum_g * inv_n)[:, None]
        _write_dx(dx_ptr, dh_ptr, rows, cols, mask, g, x_hat, rstd, mean_gx, mean_g, dx_row_stride, dh_row_stride,
                  RMS, HAS_DH)
        dw += dy * x_hat
        db += dy
        if TAIL > 0:
            _write_dx(dx_ptr, dh_ptr, rows, tail_cols, tail_mask, g_tail, x_hat_tail, rstd, mean_gx, mean_g,
                      dx_row_stride, dh_row_stride, RMS, HAS_DH)
            dw_tail += dy_tail * x_hat_tail
            db_tail += dy_tail
    part = tl.program_id(0).to(tl.int64) * N
    _store_partial_rows(dw_ptr, db_ptr, part, cols, dw, db, N, HAS_WEIGHT, HAS_BIAS, HEAD_IN_ROW)
    if TAIL > 0:
        _store_partial_rows(dw_ptr, db_ptr, part, tail_cols, dw_tail, db_tail, N, HAS_WEIGHT, HAS_BIAS, EVEN)


@triton.jit
def _weight_piece(w_ptr, cols, N, weight_offset, HAS_WEIGHT: tl.constexpr, EVEN: tl.constexpr):
    """weight + weight_offset at `cols`, in float32, as a row of a tile (0 without a weight)."""
    if HAS_WEIGHT:
        return tl.load(w_ptr + cols, mask=in_row(cols, N, EVEN), other=0.0).to(tl.float32)[None, :] + weight_offset
    else:
        return tl.zeros([1, cols.shape[0]], dtype=tl.float32)


@triton.jit
def _rows_x_dy(x_ptr, dy_ptr, rows, cols, M, N, x_row_stride, dy_row_stride, EVEN: tl.constexpr):
    """The rows' x and dy at `cols`, as stored (0 past the tensor)."""
    mask = (rows < M)[:, None] & in_row(cols, N, EVEN)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _gradient_terms(x, dy, w_eff, mean, rstd, mask, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(x^, g = dy * w_eff) of float32 x and dy; 0 outside mask."""
    if RMS:
        x_hat = x * rstd
    else:
        x_hat = tl.where(mask, x - mean, 0.0) * rstd
    g = dy * w_eff if HAS_WEIGHT else dy
    return x_hat, g


@triton.jit
def _write_dx(dx_ptr, dh_ptr, rows, cols, mask, g, x_hat, rstd, mean_gx, mean_g, dx_row_stride, dh_row_stride,
              RMS: tl.constexpr, HAS_DH: tl.constexpr):
    """dx = rstd * (g - x^ mean(g x^) [- mean(g)]) (+ dh) at the rows' columns `cols`."""
    dx = g - x_hat * mean_gx
    if not RMS:
        dx -= mean_g
    dx *= rstd
    if HAS_DH:
        dx += tl.load(dh_ptr + rows[:, None] * dh_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_partial_rows(dw_ptr, db_ptr, part, cols, dw, db, N, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        EVEN: tl.constexpr):
    """This program's partial rows of dweight and dbias at `cols`: its rows' sums."""
    col_mask = in_row(cols, N, EVEN)
    if HAS_WEIGHT:
        tl.store(dw_ptr + part + cols, tl.sum(dw, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + part + cols, tl.sum(db, axis=0), mask=col_mask)


@triton.jit
def _row_sums_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, sums_ptr, N, inv_n, x_row_stride, dy_row_stride,
                     weight_offset, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                     EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # Rows longer than one chunk: mean(g x^) and mean(g) of each row, before the main kernel.
    if ALIGN > 1:  # as in the forward
        N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
    row = tl.program_id(0).to(tl.int64)
    mean = 0.0 if RMS else tl.load(mean_ptr + row)
    rstd = tl.load(rstd_ptr + row)
    sum_gx = 0.0
    sum_g = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, N, EVEN)
        g = _g_chunk(w_ptr, dy_ptr, row, cols, mask, dy_row_stride, weight_offset, HAS_WEIGHT)
        x_hat = (tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        sum_gx += tl.sum(g * x_hat, axis=0)
        sum_g += tl.sum(g, axis=0)
    tl.store(sums_ptr + 2 * row, sum_gx * inv_n)
    tl.store(sums_ptr + 2 * row + 1, sum_g * inv_n)


@triton.jit
def _g_chunk(w_ptr, dy_ptr, row, cols, mask, dy_row_stride, weight_offset, HAS_WEIGHT: tl.constexpr):
    g = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        g *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    return g


@triton.jit
def _backward_chunks_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, sums_ptr, dx_ptr, dw_ptr, db_ptr,
                            M, N, inv_n, rows_per_program, x_row_stride, dy_row_stride, dh_row_stride, dx_row_stride,
                            weight_offset, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            HAS_DH: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                            EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # Program (row block, column chunk): dx of the chunk for each row of the block, and the
    # chunk's dweight / dbias summed over the block.
    if ALIGN > 1:  # as in the forward: vector loads and stores for rows of 8- or 4-divisible length
        N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
        dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = in_row(cols, N, EVEN)
    if HAS_WEIGHT:
        w_eff = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    first = block * rows_per_program
    for i in range(0, rows_per_program):
        row = (first + i).to(tl.int64)
        if row < M:
            mean = 0.0 if RMS else tl.load(mean_ptr + row)
            rstd = tl.load(rstd_ptr + row)
            x_hat = (tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            g = dy * w_eff if HAS_WEIGHT else dy
            if ONE_CHUNK:
                mean_gx = tl.sum(g * x_hat, axis=0) * inv_n
                mean_g = tl.sum(g, axis=0) * inv_n
            else:
                mean_gx = tl.load(sums_ptr + 2 * row)
                mean_g = tl.load(sums_ptr + 2 * row + 1)
            if RMS:
                dx = rstd * (g - x_hat * mean_gx)
            else:
                dx = rstd * (g - mean_g - x_hat * mean_gx)
            if HAS_DH:
                dx += tl.load(dh_ptr + row * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            db += dy
    if HAS_WEIGHT:
        tl.store(dw_ptr + block.to(tl.int64) * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_ptr + block.to(tl.int64) * N + cols, db, mask=mask)


@triton.jit(do_not_specialize=["SLICES"])  # SLICES specialised to 1 (the interpreter's) fails to compile
def _backward_blocks_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, rstd_ptr, slots_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                            SLICES, x_row_stride, dy_row_stride, dh_row_stride, dx_row_stride, weight_offset,
                            HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DH: tl.constexpr,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr,
                            EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # RMSNorm, rows too long for one program: x and dy read from HBM once (the long plan
    # reads them twice). Ticket t (an atomic counter, as in pintail/_split.py) is slice
    # t % SLICES of the block of ROWS rows t // SLICES. The SLICES programs holding a block
    # meet at each of its rows: each publishes its slice's sum of g x^ (the next row's before
    # it waits for this one's), waits for the other slices' and writes its slice of dx from
    # registers. dweight / dbias of the slice add up over the block's rows in registers: one
    # float32 partial row per block (4 / ROWS bytes per element written and read again).
    # A program takes a new ticket only when its block is done, so a wait can stall only on
    # the newest block, whose missing tickets go to the next programs to finish: no deadlock
    # while SLICES programs can run at once (the host keeps SLICES <= the SMs).
    if ALIGN > 1:  # as in the forward: vector loads and stores for rows of 8- or 4-divisible length
        N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
        dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = tl.cdiv(M, ROWS) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        block = ticket // SLICES
        slice_index = ticket % SLICES
        cols = slice_index * BLOCK + tl.arange(0, BLOCK)
        mask = in_row(cols, N, EVEN)
        if HAS_WEIGHT:
            w_eff = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
        else:
            w_eff = tl.full([BLOCK], 1.0, tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        row = block * ROWS
        last = tl.minimum(row + ROWS, M)
        x_raw = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
        _publish_sum_gx(slots_ptr, x_raw, dy_raw, w_eff, rstd_ptr, row, SLICES, slice_index)
        while row < last:
            next_row = row + 1
            more = next_row < last
            x_next = tl.load(x_ptr + next_row * x_row_stride + cols, mask=mask & more, other=0.0)
            dy_next = tl.load(dy_ptr + next_row * dy_row_stride + cols, mask=mask & more, other=0.0)
            if more:
                _publish_sum_gx(slots_ptr, x_next, dy_next, w_eff, rstd_ptr, next_row, SLICES, slice_index)
            if HAS_DH:  # issued before the wait, which hides its latency
                dh = tl.load(dh_ptr + row * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            _, sums_gx, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x_raw.to(tl.float32) * rstd
            dy = dy_raw.to(tl.float32)
            dx = rstd * (dy * w_eff - x_hat * (tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n))
            if HAS_DH:
                dx += dh
            tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            db += dy
            row, x_raw, dy_raw = next_row, x_next, dy_next
        if HAS_WEIGHT:
            tl.store(dw_ptr + block * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(db_ptr + block * N + cols, db, mask=mask)
        ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _backward_cluster_kernel(x_ptr, w_ptr, dy_ptr, dh_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                             x_row_stride, dy_row_stride, dh_row_stride, dx_row_stride, weight_offset, WORDS, ROUNDS,
                             RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_DH: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                             CLUSTER_POW2: tl.constexpr, AHEAD: tl.constexpr, ALIGN: tl.constexpr):
    # Rows across the CLUSTER CTAs of a cluster (softmax's cluster plan): CTA `rank` holds
    # slice `rank` of the row's x and dy, trades the slice's sums of g and g x^ with its
    # peers, writes its slice of dx, and adds dy x^ (and dy) of its columns over the rows its
    # cluster takes: one float32 partial row a cluster for _sum_partials_kernel. AHEAD: the
    # next row's x and dy are loaded before this row's exchange.
    if ALIGN > 1:  # as in the rows kernel
        N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
        dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    if AHEAD:
        mask = col_mask & (first_row < M)
        x_next = tl.load(x_ptr + first_row.to(tl.int64) * x_row_stride + cols, mask=mask, other=0.0)
        dy_next = tl.load(dy_ptr + first_row.to(tl.int64) * dy_row_stride + cols, mask=mask, other=0.0)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters  # every CTA runs every round: rows past M join with zeros
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        if AHEAD:
            x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
            ahead_mask = col_mask & (row64 + clusters < M)
            x_next = tl.load(x_ptr + (row64 + clusters) * x_row_stride + cols, mask=ahead_mask, other=0.0)
            dy_next = tl.load(dy_ptr + (row64 + clusters) * dy_row_stride + cols, mask=ahead_mask, other=0.0)
        else:
            x = tl.load(x_ptr + row64 * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row64 * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
        if RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(mask, x - tl.load(mean_ptr + row, mask=in_rows, other=0.0), 0.0) * rstd
        if HAS_WEIGHT:  # re-read each row (from L1 / L2): its registers are not held across rows
            g = dy * (tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset)
        else:
            g = dy
        sum_g, sum_gx, token = cluster.exchange_sums(WORDS, i, tl.sum(g, axis=0), tl.sum(g * x_hat, axis=0), token,
                                                     CLUSTER, CLUSTER_POW2)
        mean_gx = sum_gx * inv_n
        if RMS:
            dx = rstd * (g - x_hat * mean_gx)
        else:
            dx = rstd * (g - sum_g * inv_n - x_hat * mean_gx)
        if HAS_DH:
            dx += tl.load(dh_ptr + row64 * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    part = first_row.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(dw_ptr + part, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + part, db, mask=col_mask)


@triton.jit
def _publish_sum_gx(slots_ptr, x_raw, dy_raw, w_eff, rstd_ptr, row, SLICES, slice_index):
    """(1.0, sum of g x^ over the slice) for the slice's word of `row` (1.0: never 0)."""
    g = dy_raw.to(tl.float32) * w_eff
    sum_gx = tl.sum(g * x_raw.to(tl.float32), axis=0) * tl.load(rstd_ptr + row)
    split.publish(slots_ptr, row * SLICES + slice_index, tl.full((), 1.0, tl.float32), sum_gx)


@triton.jit
def _sum_partials_kernel(dw_parts_ptr, db_parts_ptr, dw_ptr, db_ptr, parts, N, HAS_WEIGHT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PARTS_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    # dweight / dbias: the backward's float32 partial rows summed in a fixed order (the same
    # result on every run) and written in the parameters' dtypes. One launch instead of a
    # sum and a cast per gradient, which cost ~25 us of host time each on the autograd
    # engine's thread.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, parts, PARTS_BLOCK):
        rows = start + tl.arange(0, PARTS_BLOCK)
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        mask = (rows < parts)[:, None] & in_cols[None, :]
        if HAS_WEIGHT:
            dw += tl.sum(tl.load(dw_parts_ptr + offsets, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            db += tl.sum(tl.load(db_parts_ptr + offsets, mask=mask, other=0.0), axis=0)
    if HAS_WEIGHT:
        tl.store(dw_ptr + cols, dw.to(dw_ptr.dtype.element_ty), mask=in_cols)
    if HAS_BIAS:
        tl.store(db_ptr + cols, db.to(db_ptr.dtype.element_ty), mask=in_cols)


# ------------------------------------------------------------------ launch heuristics
# The forward's plans per kind, by row length: (row length up to, plan, size, warps), where
# size is the rows plan's elements a tile at least (whole rows, BLOCK_M of them) and the
# long plan's chunk. Past the last entry: the split plan. Measured on the H200 (kernel
# alone, bf16; tools/tune_norm.py.
# - RMSNorm from 513 to 16384: the long plan with the row as one chunk (pass 1 marks its
#   loads evict_last, pass 2 re-reads the row from L1 / L2), as torch.compile's kernel at
#   8192: 0.97 / 0.97 / 0.96 at 1024 / 4096 / 8192 against the rows plan's 0.95 / 0.95 /
#   0.93-0.94 (it holds the tile in registers: fewer warps in flight). Compiled as one known
#   trip (ONE_CHUNK, no loop branches): 0.953 at 8192 (0.927-0.930 as a loop), 0.963 at
#   16384 (the rows plan 0.927-0.931). At 8192 16 warps, as compile's kernel: 0.973-0.977
#   against 8 warps' 0.952 (two runs; the earlier sweeps had 8 ahead). One
#   chunk of 32768 at 32 warps (compile's kernel at 32768) gave ours 0.83-0.88 until held to
#   32 registers: RMS_ONE_CHUNK below. LayerNorm's rows of a power of two: LAYER_ONE_CHUNK.
# - Past 16384 rows do not fit in registers with enough programs per SM: the long plan, with
#   eviction hints: RMSNorm 0.86 / 0.90 / 0.90 at 20000 / 24576 / 32768 (0.83 / 0.86 without
#   hints at 24576 / 32768); LayerNorm 0.79 / 0.79 at 24576 / 32768 (0.70 / 0.67 with every
#   row flagged for the exact statistics), where its rows plan (a 32768-wide tile) gave
#   0.67 / 0.78 (0.65 at 32768 flagged). 16384-element chunks lose where the second is
#   mostly masked (RMSNorm 0.68 / 0.77 at 20000 / 24576). Past 32768 the second read misses
#   L2 and the split plan wins. 16384-element chunks at 8 warps, not 16, since the chunks
#   of whole rows are unmasked (EVEN): RMSNorm 0.87 / 0.87 / 0.85 / 0.90-0.92 at 26000 /
#   28672 / 30000 / 32768 against 0.82 / 0.82 / 0.88 / 0.90; LayerNorm gains at 32768 only
#   (0.83 against 0.81) and loses 0.11-0.17 at 26000-30000, so it keeps 16 warps.
# - RMSNorm with a residual keeps rows in registers to 32768: its long plan reads h back
#   (0.90 / 0.92 of copy at 24576 / 32768, the rows plan 0.96).
FORWARD_PLANS = {
    "rms": [(512, "rows", 2048, 4), (1024, "long", 1024, 2), (4096, "long", 4096, 8), (8192, "long", 8192, 16),
            (16384, "long", 16384, 8), (24576, "long", 8192, 16), (32768, "long", 16384, 8)],
    "rms+residual": [(1024, "rows", 2048, 4), (16384, "rows", 16384, 8), (32768, "rows", 32768, 32)],
    "layer": [(1024, "rows", 2048, 2), (8192, "rows", 8192, 4), (16384, "rows", 16384, 8), (24576, "long", 8192, 8),
              (32768, "long", 16384, 16)]}
# LayerNorm's rows of exactly 1024 / 2048 / 4096 / 8192: one whole chunk of the long plan
# (unmasked), at these warps. Kernel alone, H200, bf16, weight and bias, two runs a size,
# the rows plan above -> one chunk: storing mean / rstd (a training forward) 0.936 /
# 0.923-0.927 / 0.922-0.924 / 0.922-0.925 -> 0.959 / 0.955-0.965 / 0.950-0.954 / 0.951-0.957;
# without them (as the bench times it) 0.949-0.954 / 0.925-0.928 / 0.927 / 0.921 ->
# 0.973-0.975 / 0.973-0.974 / 0.954-0.958 / 0.962-0.968. A part-filled chunk
# (masked) lost to the rows plan at every length measured between (storing
# them): 896 / 1000 / 2000 / 3584 / 4000 / 7168 / 8000 0.92 / 0.93 / 0.94 / 0.92 / 0.94 /
# 0.90 / 0.93 against 0.80-0.92 (its warps halved, or not). Every row flagged (x[0] = 1000)
# costs the one chunk more than the rows plan, a third read from L2 against its registers:
# 0.79-0.80 / 0.79 / 0.90-0.91 / 0.85 against 0.93 / 0.93 / 0.91 / 0.90. 16384 since the
# long kernel stores mean / rstd after pass 2 (74 registers against 100, three programs an
# SM, storing them): 0.934-0.939 against the rows plan's 0.909-0.913 (the one
# chunk stored them first: 0.892-0.894). Every row flagged: not measured at 16384.
LAYER_ONE_CHUNK = {1024: 2, 2048: 4, 4096: 4, 8192: 8, 16384: 8}
# RMSNorm of 1025-8192: the row as one chunk of next_power_of_2(N) (not the table's BLOCK),
# its warps the table's scaled to that chunk, and halved where the row fills at most 3/4 of
# it (hidden sizes no power of two). Kernel alone, H200, bf16, the table's chunk
# and warps -> this: 1536 0.78 (2048 / 8) -> 0.96 (2048 / 2; 4 warps 0.97), 2560 0.87 ->
# 0.95, 3072 0.96 -> 0.96, 5120 0.83 -> 0.96, 6144 0.91 -> 0.96; 7168 keeps 16 warps (0.97,
# 8 warps 0.96); 2048 takes 4 warps (0.97), 4096 and 8192 keep theirs (0.97).
RMS_ONE_CHUNK_FILLED = (1024, 8192)
# LayerNorm of 1025-16384 where rows_tail cuts the row into two tiles (hidden sizes 1536,
# 2560, 3072, 5120, 6144, 10240, 12288): one row a program, BLOCK_N // 1024 warps (at least 2:
# 24-48 values a thread). Its loop computed on every lane of the next_power_of_2(N) tile
# (22 instructions a lane, ~36 a value at 5120: past the issue slots of a copy's pace).
# Kernel alone, H200, bf16, weight and bias, the table's tile -> this: 1536 /
# 2560 / 3072 / 5120 / 6144 / 10240 / 12288: 0.85 / 0.78 / 0.87 / 0.78 / 0.83 / 0.72 / 0.79
# -> 0.94 / 0.93 / 0.94 / 0.93 / 0.93 / 0.92 / 0.93 (best warps: these, or 3072 at 4 +0.007);
# two rows a program lost 0.03-0.4. RMSNorm (no residual) of 8193-10240 likewise (8192 +
# 2048 at 8 warps). Two runs: 10240 0.919 / 0.919 (the long plan's 16384 / 8) ->
# 0.936 / 0.948 (16 warps 0.90, two rows 0.77). The tail takes at least 16 bytes a thread
# (widened, masked: _launch.widened_tail) and the head no column mask: kernel alone, the plan
# before -> this: LayerNorm 4352 / 4608 / 8704 / 9216 0.67 / 0.60 / 0.62 / 0.50 -> 0.91 / 0.93
# / 0.85 / 0.875 (9728 0.90 either way); RMSNorm 8704 / 9216 0.853 / 0.880 (long plan) ->
# 0.937 / 0.936 (an earlier 9216 loss was the 1024 tail at 8 warps: 8-byte loads).
ROWS_TAIL = {"layer": (1024, 16384), "rms": (8192, 10240)}
# RMSNorm from 24577 to 32768 with narrow rows (forward_config): the row as one chunk at 32
# warps, ptxas held to 32 registers so that two programs (2 x 1024 threads) fit an SM, as
# torch.compile's kernel at 32768 compiles (its N a constant, 32 registers; ours took 35,
# one program an SM: 0.86). Kernel alone, H200, bf16, against the 16384 / 8 chunks above:
# 0.94 / 0.86-0.94 / 0.956 at 28672 / 30000 /
# 32768 against 0.87 / 0.84 / 0.92; with a bias 0.91 / 0.86-0.88 but 0.64 at 32768 (against
# 0.79 / 0.74 / 0.87: it spills there), float32 0.50-0.53 (against 0.84), and rows of odd
# length (2-byte loads) 0.09 at 24577 (against 0.30): those keep the chunks.
RMS_ONE_CHUNK = (24576, 32768, {"plan": "long", "BLOCK": 32768, "num_warps": 32, "maxnreg": 32})
# LayerNorm of 16-bit rows of even length from 28672 to 32768: the row held as packed words
# (_forward_packed_kernel), 16 warps, the output in 4 parts. Kernel alone, H200, bf16:
# 0.845 at 32768 against the long plan's 0.796.
LAYER_PACKED = (28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16, "PARTS": 4})
# Rows past 32768, where the GPU has thread-block clusters: persistent
# clusters (_forward_cluster_kernel), by kind (row length up to, launch config). Kernel alone,
# H200, bf16, a weight (tune_norm.py): RMSNorm 0.89 / 0.88 / 0.83 at 65536 /
# 131072 / 262144 (4096 / 4, 8192 / 4, 16384 / 8 warps) against the split plan's 0.81 / 0.80
# / 0.79; 16 warps a CTA 0.50-0.60. In an experiment
# loading the next row ahead lost (0.84 / 0.80 at 131072 / 262144), and so did one row a
# cluster (0.77 / 0.70). LayerNorm (weight and bias): one exchange of the shifted
# sums a row, capped at 128 registers (159 uncapped: 3 CTAs an SM, 0.66) for 4 CTAs an SM,
# 0.74 / 0.73 at 65536 / 131072 against the split plan's 0.71 / 0.69; at 262144 (16384 / 8
# warps, capped) 0.68, a tie, so the split plan stays there. Each slice's mean and squared
# deviations combined by Chan's formula (two reductions before the exchange) read 0.60-0.68.
# bf16 rows take FORWARD_CLUSTER_BF16 (below) instead, clusters at 262144 too.
# RMSNorm's 16384 / 8 warps is capped at 128 registers: with 10-14 CTAs a
# cluster (rows of 131073-229376) it compiles to 137-142, one CTA an SM, and such clusters
# fit only one a GPC (7 clusters on 53-74 % of the SMs): 0.38-0.48
# kernel alone at 150000-229376, held + ahead 0.60-0.77, against the split plan's 0.79.
# Capped: 121-122 registers, no stack; held + ahead 0.83 / 0.79 / 0.88 there (bf16).
FORWARD_CLUSTER = {"rms": [(65536, {"BLOCK": 4096, "num_warps": 4}), (131072, {"BLOCK": 8192, "num_warps": 4}),
                           (262144, {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128})],
                   "layer": [(131072, {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128})],
                   # RMSNorm with a residual: h = x + residual stored before the
                   # exchange (held in bf16), the next row's x and residual loaded ahead.
                   # Kernel alone, bf16 / fp16 / fp32 against the split plan: 0.870 / - / -
                   # (0.81) at 40008, 0.904 / 0.891 / 0.871 (0.85 / 0.85 / 0.69) at 65536,
                   # 0.922 / 0.909 / - (0.83 / 0.83) at 131072, 0.914 / 0.905 / 0.904 (0.82 /
                   # 0.82 / 0.67) at 262144. Capped at 128 registers it spills (0.40-0.57).
                   "rms+residual": [(65536, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
                                    (262144, {"BLOCK": 16384, "num_warps": 8, "AHEAD": True, "HELD": True})]}
# bf16 rows: x held in its 16 bits across the exchange (HELD) leaves the registers to load
# the next row's x before this row's exchange (AHEAD), so its HBM latency hides under the
# exchange and the stores, where the stall samples put the waits. Kernel alone,
# H200, weight (LayerNorm: and bias), two runs a side, before -> this:
# LayerNorm 0.757 / 0.752 -> 0.780 / 0.787 at 65536 / 131072, 0.693 (split plan) -> 0.760 at
# 262144; RMSNorm 0.830 -> 0.886 at 262144 (at 65536 / 131072 ahead ties). LayerNorm's rows of
# 32769-49152: ahead tied at 40008 (0.746 / 0.744), then won by 0.006-0.063 at
# 34816-47104 (0.702 / 0.733 / 0.774 / 0.754 / 0.764 -> 0.765 / 0.777 / 0.780 /
# 0.773 / 0.771 at 34816 / 36864 / 40960 / 45056 / 47104).
# A sweep of the lengths between these powers of two
# 43": one run a size). LayerNorm takes slices of 32768 / 16 warps at 49153-65536, where
# 16384 / 8 left the last of 4 slices nearly empty (0.61-0.79 -> 0.73-0.82), and at
# 131073-245760, where capped 16384 / 8 makes clusters of 10-15 CTAs that fit few to a GPC
# (0.56-0.72 -> 0.62-0.76); 262144's 16 CTAs of 16384 fit well and keep it. RMSNorm's
# 65537-131072 load the next row ahead without holding x (168 registers, 3 CTAs an SM
# against 4): ahead ties at the powers of two but wins between them (0.81-0.85 -> 0.85-0.89).
# RMSNorm's 131073-245760 take slices of 32768 / 16 warps, x held and the row ahead, as
# LayerNorm's (one run a length: 0.829 / 0.845 / 0.811 / 0.875 -> 0.887 / 0.874
# / 0.819 / 0.877 at 139264 / 163840 / 196608 / 229376: 0.831 / 0.793 / 0.878 ->
# 0.842 / 0.824 / 0.880 at 150000 / 196608 / 229376); at 262144 they tie (0.884 / 0.887).
_LAYER_SLICES_8192_AHEAD = {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128, "AHEAD": True}
_SLICES_32768_AHEAD = {"BLOCK": 32768, "num_warps": 16, "AHEAD": True}
_SLICES_16384_CAPPED_AHEAD = {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128, "AHEAD": True}
FORWARD_CLUSTER_BF16 = {
    "rms": [FORWARD_CLUSTER["rms"][0], (131072, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
            (245760, {**_SLICES_32768_AHEAD, "HELD": True}), (262144, {**_SLICES_16384_CAPPED_AHEAD, "HELD": True})],
    "layer": [(49152, _LAYER_SLICES_8192_AHEAD), (65536, _SLICES_32768_AHEAD), (131072, _LAYER_SLICES_8192_AHEAD),
              (245760, _SLICES_32768_AHEAD), (262144, _SLICES_16384_CAPPED_AHEAD)],
    "rms+residual": FORWARD_CLUSTER["rms+residual"]}
# The backward's rows plans: (row length up to, elements a tile at least, warps, programs
# per SM); past the last entry the long or blocks plan (below).
BACKWARD_ROWS = {"rms": [(1024, 2048, 4, 4), (4096, 4096, 8, 2), (8192, 8192, 32, 1)],
                 "layer": [(1024, 2048, 4, 4), (4096, 4096, 8, 2), (8192, 8192, 16, 1)]}
# The backward as two tiles, one row a tile, where rows_tail cuts the row so, without a
# residual's gradient, by kind: (values a thread the tail holds at least: widened, masked,
# by _launch.widened_tail, [(row length from, up to, warps, programs per SM)]). RMSNorm at
# 4097-6144 (4096 + a tail) and 8193-12288 (8192 + a tail). Kernel alone, H200,
# bf16, weight (tune_norm.py --tails), the default -> this: 5120 / 6144 0.70 / 0.78 (8192 /
# 32 warps) -> 0.87 / 0.87 (4 warps, 2 an SM; 8-32 warps 0.69-0.75); 10240 / 12288 0.82 /
# 0.81 (across a cluster) -> 0.835 / 0.86 (8 warps, 1 an SM). Lost at 1536 / 2560 / 3072.
# LayerNorm's tiles lost while the head kept its column mask (9728 0.673 ->
# 0.565); since the kernel's head has none, same table, kernel alone, bf16:
# LayerNorm (weight and bias) the cluster / rows plan -> two tiles 2560 0.675 -> 0.690,
# 3000 0.727 -> 0.740, 8704 0.625 -> 0.710, 9216 0.654 -> 0.731, 9728 0.675 -> 0.745; tails
# of 8 values a thread beat 4 (9000: 0.695 against 0.568). RMSNorm's tail of 4 values a
# thread beats 8 (4608 0.874 against 0.857, 9216 0.841 against 0.805) and the tail as cut
# (8704 0.831 against 0.756); the head unmasked alone took RMSNorm's 9000 from 0.670 to 0.845.
BACKWARD_TAIL = {"rms": (4, [(4096, 6144, 4, 2), (8192, 12288, 8, 1)]),
                 "layer": (8, [(2048, 3072, 4, 2), (8192, 10240, 8, 1)])}
# The split forward per kind; with a residual (twice the bytes per slice, 196 registers at
# 4 warps) RMSNorm takes 8 warps, 2 programs per SM. A lag under one round of the grid
# waits: 0.65 against 0.82 at N = 262144; LayerNorm's half-round lag measured 0.51 there
# once, a full round 0.67. LayerNorm at 4 warps takes 128 registers (4 per SM)
# now that slices stay in bf16 until used: 0.73-0.75 of copy alone, against 0.68-0.70 at its
# former 8 warps (80 registers: 3 per SM where 4 were counted).
FORWARD_SPLIT = {"rms": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1},
                 "rms+residual": {"plan": "split", "BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2,
                                  "LAG_ROUNDS": 1},
                 "layer": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}}
BACKWARD_LONG = {"plan": "long", "BLOCK": 4096, "num_warps": 16, "PROGRAMS_PER_SM": 2}
# RMSNorm past its rows plan: x and dy read once (0.60-0.64 of copy against the long plan's
# 0.56 at N = 32768-262144). LayerNorm keeps the long
# plan: its blocks kernel (two sums a row, the mean) measured 0.42-0.49 at 168-176 registers,
# and 0.40-0.52 with the two sums as one reduction at 96-162 (branch next/layer-blocks).
BACKWARD_BLOCKS = {"rms": {"plan": "blocks", "ROWS": 32, "BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 4}}
# With the residual's gradient dh (a third read; 166 registers at 2048 / 4 warps, so 3
# programs per SM where 4 are counted), longer slices on fewer programs past 65536 (kernel
# alone, H200, bf16): 0.70 at 131072 (4096 / 8 warps, 2 per SM; 0.39 at 262144) and 0.66 at
# 262144 (8192 / 16 warps, 1 per SM), against 0.53 for the config above; at 65536 that one
# stays best (0.73 against 0.71 / 0.66). (row length up to, slice, warps, programs per SM).
BACKWARD_BLOCKS_WITH_DH = [(65536, 2048, 4, 4), (131072, 4096, 8, 2), (math.inf, 8192, 16, 1)]
# Rows without a residual's gradient past a length by kind (RMSNorm 8192, LayerNorm 4096) go
# across a thread-block cluster where the GPU has clusters (_backward_cluster_kernel):
# (first length past which, [(row length up to, slice, warps, AHEAD)]). Kernel alone, H200,
# bf16 (tune_norm.py, the next row loaded ahead in every entry): RMSNorm 0.81 /
# 0.82 / 0.78 / 0.81 at 12288 / 16384 / 24576 / 32768 against the blocks plan's 0.63 at 16384
# (without loading ahead at most 0.77 / 0.70); LayerNorm 0.74 / 0.77 / 0.74 / 0.74 against
# the long plan's 0.56. Past 32768 (clusters of up to 16): RMSNorm 0.80 / 0.76 at
# 65536 / 131072 with 8192 / 16 warps against the blocks plan's 0.66 / 0.61; LayerNorm 0.72
# at 65536 (4096 / 8 warps) and 0.67 at 131072 (8192 / 16) against the long plan's 0.54. At
# 262144 (slices of 16384) both lose (0.55 against 0.60, 0.27 against 0.53), so the blocks
# and long plans stay there. LayerNorm at 4097-8192 (its rows plan holds such a
# row in one tile of 8192 / 16 warps, 5120 filling 62 % of it): slices of 1024 / 4 warps
# 0.751 / 0.749 / 0.761 at 5120 / 6144 / 8192 against 0.614 / 0.661 / 0.740 (A/B,
# two runs a side: 0.59 / 0.62 / 0.66 / 0.70 / 0.74 -> 0.70 / 0.75 / 0.75 / 0.76 / 0.76 at
# 4608 / 5120 / 6144 / 7168 / 8192); at 2560 / 3072
# / 4096 the rows plan stays (0.673 / 0.734 / 0.861 against 0.663 / 0.766 / 0.779), and so
# does RMSNorm's (its two tiles at 5120 / 6144 0.87 against 0.85). The residual's gradient is
# not measured. LayerNorm's clusters of 9-12 slices of 8192 (65537-98304, one
# run a length) read 0.44-0.53 against the long plan's 0.54-0.55, and 0.60 against 0.53 at
# 114688 (14): a slice of None means no cluster there. RMSNorm's blocks plan ties its
# cluster over 65537-98304 (0.58 on average, each point within 0.07 either way).
BACKWARD_CLUSTER = {"rms": (8192, [(16384, 2048, 4, True), (131072, 8192, 16, True)]),
                    "layer": (4096, [(8192, 1024, 4, True), (12288, 4096, 8, True), (16384, 8192, 16, True),
                                     (65536, 4096, 8, True), (98304, None, None, None), (131072, 8192, 16, True)])}
# dweight / dbias partial rows summed by columns (_sum_partials_config). Past 32 partials
# (short rows: a partial row a persistent program, up to 8 an SM) every partial in one step
# (PARTS_BLOCK, up to 1024), 16 columns a program, 8 warps past 128 partials (at most 64
# values a thread a gradient). Each step of the loop is a round trip to L2, and the step of
# 32 partials made LayerNorm's 528 at 1024 a chain of 17: 17 us of its 219 us backward
# (RMSNorm 8 of 204). H200, the sum alone (profiler), steps of 32 -> one step,
# 16 columns a program both: LayerNorm 528 x 1024 12.4 -> 3.0 us, 264 x 4096 7.8 -> 3.4,
# 107 x 8192 5.1 -> 2.8; RMSNorm 528 x 1024 6.9 -> 2.2, 132 x 8192 3.6 -> 2.8; the backward
# alone: LayerNorm 0.84 -> 0.895 at 1024. Up to 32 partials (long rows: a partial row a
# cluster) one step of next_power_of_2(parts) too, and TILE / step columns a program, about
# PROGRAMS of them or more: LayerNorm's 4 partials at 262144 go as 4 x 1024, where a step of
# 32 x 128 was 7 / 8 masked (13.4 us of its 350 us backward). The backward alone,
# two runs a side: LayerNorm 0.535 -> 0.547 / 0.666 -> 0.674 at 262144 / 131072, RMSNorm
# 0.598 -> 0.608 / 0.761 -> 0.770.
SUM_PARTIALS = {"PARTS_BLOCK": 32, "MIN_BLOCK_N": 16, "TILE": 4096, "PROGRAMS": 128, "MAX_PARTS_BLOCK": 1024}


def _kind(rms):
    return "rms" if rms else "layer"


def forward_config(N, rms, residual=False, narrow=True, packable=False, clusters=False, bf16=False):
    """The forward's plan for rows of N. narrow: 2-byte x, weight and y, no bias, rows and
    strides multiples of 8 elements (16-byte loads), where RMSNorm's one-chunk plan fits its
    register cap. packable: x, y, weight and bias of one 16-bit dtype, rows of even length
    starting 4-byte aligned (LayerNorm's packed plan). clusters: the GPU runs thread-block
    clusters (_cluster.available). bf16: the row normalised (x, or h = x + residual) is
    bfloat16 (FORWARD_CLUSTER_BF16)."""
    kind = _kind(rms) + ("+residual" if residual else "")
    low, high, one_chunk = RMS_ONE_CHUNK
    if kind == "rms" and narrow and low < N <= high:
        return one_chunk
    low, high, packed = LAYER_PACKED
    if kind == "layer" and packable and low < N <= high:
        return packed
    if kind == "layer" and N in LAYER_ONE_CHUNK:
        return {"plan": "long", "BLOCK": N, "num_warps": LAYER_ONE_CHUNK[N]}
    low, high = ROWS_TAIL.get(kind, (0, 0))
    if low < N <= high:  # the row as two tiles where rows_tail cuts it so
        head, tail = rows_tail(N)
        if tail:
            warps = max(2, head // 1024)
            return {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": widened_tail(tail, warps),
                    "num_warps": warps}
    for limit, plan, size, warps in FORWARD_PLANS[kind]:
        if N > limit:
            continue
        if plan == "long":
            low, high = RMS_ONE_CHUNK_FILLED
            if kind == "rms" and low < N <= min(high, size):  # the row one chunk: warps by the elements in it
                block = next_power_of_2(N)
                size, warps = block, max(1, warps * block // size // (2 if 4 * N <= 3 * block else 1))
            return {"plan": "long", "BLOCK": size, "num_warps": warps}
        block_n = next_power_of_2(N)
        return {"plan": "rows", "BLOCK_M": max(1, size // block_n), "BLOCK_N": block_n, "num_warps": warps}
    for limit, cfg in (FORWARD_CLUSTER_BF16 if bf16 else FORWARD_CLUSTER).get(kind, ()) if clusters else ():
        if N <= limit:
            return {"plan": "cluster", **cfg}
    return FORWARD_SPLIT[kind]


def backward_config(N, rms, dh=False, clusters=False):
    """The backward's plan for rows of N; dh: with a residual's gradient; clusters: the GPU
    runs thread-block clusters (_cluster.available)."""
    values, ranges = BACKWARD_TAIL[_kind(rms)]
    head, tail = rows_tail(N)
    for low, high, warps, per_sm in ranges if tail and not dh else ():
        if low < N <= high:
            return {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": widened_tail(tail, warps, values),
                    "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    past, across = BACKWARD_CLUSTER[_kind(rms)]
    for limit, block, warps, ahead in across if clusters and not dh and N > past else ():
        if N <= limit:
            if block is None:
                break
            return {"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": ahead}
    for limit, tile, warps, per_sm in BACKWARD_ROWS[_kind(rms)]:
        if N <= limit:
            block_n = next_power_of_2(N)
            return {"plan": "rows", "BLOCK_M": max(1, tile // block_n), "BLOCK_N": block_n, "num_warps": warps,
                    "PROGRAMS_PER_SM": per_sm}
    cfg = BACKWARD_BLOCKS.get(_kind(rms), BACKWARD_LONG)
    if cfg["plan"] == "blocks" and dh:
        block, warps, per_sm = next(entry[1:] for entry in BACKWARD_BLOCKS_WITH_DH if N <= entry[0])
        cfg = {**cfg, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    return cfg


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
    held = h if residual is not None else x  # the row normalised: bf16 rows take FORWARD_CLUSTER_BF16
    cfg = config or forward_config(N, rms, residual is not None, narrow, packable, cluster.available(x.device),
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
    cfg = config or backward_config(N, rms, dh is not None, cluster.available(x.device))
    if cfg["plan"] == "blocks":
        # The interpreter runs one program at a time, which cannot meet another: a slice per row.
        block = cfg["BLOCK"] if not INTERPRET else next_power_of_2(N)
        slices = cdiv(N, block)
        programs = program_slots(x.device, cfg["PROGRAMS_PER_SM"])
        # A row's slices wait for each other, so they must all run at once. A GPU holds at
        # least one program per SM whatever the kernel's registers (with a residual's
        # gradient and a bias it takes 166: 3 per SM, not the 4 the grid counts on).
        if slices > program_slots(x.device, 1):
            cfg = BACKWARD_LONG
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
    """_sum_partials_kernel's launch for `parts` partial rows of N (SUM_PARTIALS)."""
    if parts > SUM_PARTIALS["PARTS_BLOCK"]:  # every partial in one step (up to MAX_PARTS_BLOCK)
        step = min(SUM_PARTIALS["MAX_PARTS_BLOCK"], next_power_of_2(parts))
        return {"PARTS_BLOCK": step, "BLOCK_N": SUM_PARTIALS["MIN_BLOCK_N"], "num_warps": 4 if step <= 128 else 8}
    # few partials (long rows): one step of them all, and as many columns as leave a tile of
    # ~TILE values, at least PROGRAMS programs
    step = next_power_of_2(parts)
    block_n = min(SUM_PARTIALS["TILE"] // step, next_power_of_2(cdiv(N, SUM_PARTIALS["PROGRAMS"])))
    return {"PARTS_BLOCK": step, "BLOCK_N": max(SUM_PARTIALS["MIN_BLOCK_N"], block_n), "num_warps": 4}


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
