"""The norm forward's Triton kernels, one a plan."""


import triton
import triton.language as tl

from .._core import cluster, split
from .._core.launch import INTERPRET, aligned, in_row, pack_pairs, unpack_pairs

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
    # (N == BLOCK_N + TAIL, M a multiple of BLOCK_M): no masks (launch.in_row). STATS: store
    # mean / rstd for the backward (4-byte stores a row cost LayerNorm 0.025 of copy at 1024).
    # TAIL > 0: the row is two tiles, BLOCK_N columns and TAIL more, so that a row of
    # 5120 = 4096 + 1024 computes on 5120 lanes, not on a tile of 8192 (rows_tail).
    # row length and strides multiples of ALIGN (launch.row_alignment): vector loads
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
    mean_error = mean
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
        mean, mean_error = _two_sum(pilot, shifted_mean)
        if tl.max(flagged.to(tl.int32), axis=0) > 0:  # rare: the deviations, from the registers
            deviations, drift = _deviation_sums(x, mean[:, None], mask, 1)
            if TAIL > 0:
                deviations, drift = _add_pairs(deviations, drift,
                                               *_deviation_sums(x_tail, mean[:, None], tail_mask, 1))
            exact_mean, exact_error, exact_var = _corrected(mean, deviations, drift, inv_n)
            mean = tl.where(flagged, exact_mean, mean)
            mean_error = tl.where(flagged, exact_error, mean_error)
            var = tl.where(flagged, exact_var, var)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(var + eps)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    _write_rows_piece(y_ptr, w_ptr, b_ptr, x, mean, mean_error, rstd, rows, cols, mask, N, y_row_stride,
                      weight_offset, RMS, HAS_WEIGHT, HAS_BIAS, HEAD_IN_ROW)
    if TAIL > 0:
        _write_rows_piece(y_ptr, w_ptr, b_ptr, x_tail, mean, mean_error, rstd, rows, tail_cols, tail_mask, N,
                          y_row_stride, weight_offset, RMS, HAS_WEIGHT, HAS_BIAS, EVEN)


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
def _write_rows_piece(y_ptr, w_ptr, b_ptr, x, mean, mean_error, rstd, rows, cols, mask, N, y_row_stride,
                      weight_offset, RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      WHOLE: tl.constexpr):
    """y = (x - mean) * rstd * (weight + weight_offset) + bias at the rows' columns `cols`
    (RMS: mean 0; the mean as the pair of _two_sum; WHOLE: cols all in the row)."""
    col_mask = in_row(cols, N, WHOLE)
    y = x * rstd[:, None] if RMS else (x - mean[:, None] - mean_error[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + weight_offset
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _affine(y, w_ptr, b_ptr, cols, mask, weight_offset, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y * (weight + weight_offset) + bias at the columns `cols` (either left out where absent)."""
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + weight_offset
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return y


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
    # (launch.in_row).
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
    mean, mean_error = _two_sum(pilot, shifted_mean)
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
        mean, mean_error, var = _corrected(mean, deviations, drift, inv_n)
    rstd = 1.0 / tl.sqrt(var + eps)
    # pass 2: the output
    for start in range(0, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = in_row(cols, N, EVEN)
        if HAS_RESIDUAL:  # h as stored, so that forward and backward see the same rounding
            x = tl.load(h_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=drop).to(tl.float32)
        y = _affine((x - mean - mean_error) * rstd if not RMS else x * rstd, w_ptr, b_ptr, cols, mask, weight_offset,
                    HAS_WEIGHT, HAS_BIAS)
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
    """(mean as _two_sum's pair, variance) from the deviations' sums: sum d also mends the
    first mean, whose float32 sum of large s was off by ~1e-6 of it. Where sum d^2 overflowed
    (values past ~1e19) the variance is inf, as torch's float32 one: rstd 0, not the NaN of
    inf minus a correction^2 that overflowed with it."""
    correction = sums * inv_count
    var = tl.maximum(squares * inv_count - correction * correction, 0.0)
    mean, mean_error = _two_sum(mean, correction)
    return mean, mean_error, tl.where(squares == float("inf"), float("inf"), var)


@triton.jit
def _two_sum(a, b):
    """a + b rounded to float32, and its rounding error, exactly (Knuth's TwoSum): x - (a + b)
    is then (x - sum) - error, where x - sum is exact for x near the sum. A mean of 1000 rounds
    by up to 3e-5, which a spread of 0.1 turns into 3e-4 of x^; torch's float32 mean has it."""
    total = a + b
    b_part = total - a
    return total, (a - (total - b_part)) + (b - b_part)


@triton.jit
def _forward_split_kernel(x_ptr, residual_ptr, h_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slots_ptr, M, N,
                          inv_n, x_row_stride, residual_row_stride, h_row_stride, y_row_stride, eps, weight_offset,
                          SLICES, LAG, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr,
                          ALIGN: tl.constexpr):
    # Ticket-ordered slices (pintail/_core/split.py). Each slice publishes, RMS: (sum x^2, 1.0);
    # LayerNorm: (sum of squared deviations from the slice's own mean, sum x), from float64
    # sums of s = x - first (the row's first value); the first word with its lowest mantissa
    # bit set so that it is never 0 (it adds one ulp, or 1.4e-45 to a zero). The waiter
    # merges them (Chan et al.): a sum of squares that cannot cancel, and a mean of x itself,
    # not first + mean(s), which would round at the scale of x - first. The lagged write
    # recomputes h = x + residual from its inputs (from L2) rather than re-reading the h just
    # stored by another program, which would need a release / acquire pair to be visible.
    N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = split.take_ticket(slots_ptr)
    while ticket < end:
        row, done, cols, new, old = split.ticket_work(ticket, M, N, SLICES, LAG, BLOCK)
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
        next_ticket = split.take_ticket(slots_ptr)
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
            y = _affine(centred * rstd, w_ptr, b_ptr, cols, cols < N, weight_offset, HAS_WEIGHT, HAS_BIAS)
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
    N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    residual_row_stride, h_row_stride = aligned(residual_row_stride, ALIGN), aligned(h_row_stride, ALIGN)
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols, col_mask = cluster.slice_columns(rank, N, BLOCK)
    exchanges = 0  # the exchanges so far (they take the buffers in turn): LayerNorm's flagged rows take two
    if AHEAD:
        x_next, residual_next, pilot_next = _cluster_row(x_ptr, residual_ptr, first_row, M, cols, col_mask,
                                                         x_row_stride, residual_row_stride, RMS, HAS_RESIDUAL)
    for i in range(0, ROUNDS):
        row, in_rows, mask, row64 = cluster.round_row(first_row, i, clusters, M, col_mask)
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
            mean_error = 0.0
            rstd = 1.0 / tl.sqrt(squares * inv_n + eps)
        else:  # one exchange of the shifted sums about the row's first value, as the rows kernel
            squares, sums = _shifted_sums(x, pilot, mask, 0)
            squares, sums, token = cluster.exchange_sums(WORDS, exchanges, squares, sums, token, CLUSTER,
                                                         CLUSTER_POW2)
            exchanges += 1
            shifted_mean, var, flagged = _moments(squares, sums, inv_n)
            mean, mean_error = _two_sum(pilot, shifted_mean)
            if flagged:  # rare; every CTA has the same sums, so the whole cluster trades again
                if BF16_HELD:
                    x = _widened_bf16(x_held)
                deviations, drift = _deviation_sums(x, mean, mask, 0)
                deviations, drift, token = cluster.exchange_sums(WORDS, exchanges, deviations, drift, token,
                                                                 CLUSTER, CLUSTER_POW2)
                exchanges += 1
                mean, mean_error, var = _corrected(mean, deviations, drift, inv_n)
            rstd = 1.0 / tl.sqrt(var + eps)
        if BF16_HELD:
            x = _widened_bf16(x_held)
        y = _affine((x - mean - mean_error) * rstd, w_ptr, b_ptr, cols, col_mask, weight_offset, HAS_WEIGHT, HAS_BIAS)
        tl.store(y_ptr + row64 * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        if STATS:
            tl.store(rstd_ptr + row, rstd, mask=in_rows & (rank == 0))
            if not RMS:
                tl.store(mean_ptr + row, mean, mask=in_rows & (rank == 0))
