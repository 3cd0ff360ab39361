"""The softmax Triton kernels: what each reads and writes is in its comments."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .._core import cluster, split
from .._core.launch import INTERPRET, NEG_INF_BF16_PAIR, NEG_INF_FP16_PAIR, aligned, in_row, pack_pairs, unpack_pairs

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)    # log(x) = log2(x) * LN2
_INTERPRETED = tl.constexpr(INTERPRET)
LOG2E_FLOAT32: tl.constexpr = tl.constexpr(1.44269502162933349609375)  # LOG2E as float32 rounds it (0x3FB8AA3B)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _forward_rows_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, TAIL: tl.constexpr, EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # One tile of BLOCK_M whole rows: read once, reduce in registers, write once. EVEN
    # (N == BLOCK_N + TAIL, M a multiple of BLOCK_M): no masks (launch.in_row). TAIL > 0:
    # the row as two tiles, BLOCK_N columns and TAIL more (launch.rows_tail), so that a row of
    # 10240 = 8192 + 2048 computes on 10240 lanes, not on a tile of 16384.
    # vector loads for rows of 8- or 4-divisible length (launch.row_alignment)
    N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = in_row(rows, M, EVEN)
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    x, mask = _load_rows_piece(x_ptr, rows, row_mask, cols, N, x_row_stride, EVEN or TAIL > 0)
    row_max = tl.max(x, axis=1)
    if TAIL > 0:
        tail_cols = BLOCK_N + tl.arange(0, TAIL)
        x_tail, tail_mask = _load_rows_piece(x_ptr, rows, row_mask, tail_cols, N, x_row_stride, EVEN)
        row_max = tl.maximum(row_max, tl.max(x_tail, axis=1))
    e = tl.exp2((x - row_max[:, None]) * LOG2E)
    total = tl.sum(e, axis=1)
    if TAIL > 0:
        e_tail = tl.exp2((x_tail - row_max[:, None]) * LOG2E)
        total += tl.sum(e_tail, axis=1)
    _store_rows_piece(y_ptr, x, e, row_max, total, rows, cols, mask, y_row_stride, LOG)
    if TAIL > 0:
        _store_rows_piece(y_ptr, x_tail, e_tail, row_max, total, rows, tail_cols, tail_mask, y_row_stride, LOG)


@triton.jit
def _load_rows_piece(x_ptr, rows, row_mask, cols, N, x_row_stride, WHOLE: tl.constexpr):
    """x[rows, cols] in float32 (-inf past the row) and its mask; WHOLE: cols all in the row."""
    mask = row_mask[:, None] & in_row(cols, N, WHOLE)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=-float("inf"))
    return x.to(tl.float32), mask


@triton.jit
def _store_rows_piece(y_ptr, x, e, row_max, total, rows, cols, mask, y_row_stride, LOG: tl.constexpr):
    if LOG:
        y = (x - row_max[:, None]) - tl.log(total)[:, None]  # x - max first: exact, no cancellation
    else:
        y = e * (1.0 / total)[:, None]
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _forward_row_shift_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, LOG: tl.constexpr,
                              BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # One row a program, for rows whose starts no vector width divides: the row's whole
    # 16-byte pieces from its first 16-byte boundary as one 1-D slice (a cluster of one:
    # cluster.window), its at most 2 x (SHIFT - 1) other elements as a 1-D tensor of their own,
    # one load a thread (as a [rows, 2 x SHIFT] tile they were replicated in every thread).
    row = tl.program_id(0).to(tl.int64)
    x, x_ends = _load_slice(x_ptr, row, M, N, x_row_stride, 0, BLOCK, SHIFT, 1)
    y, y_ends, _ = _softmax_across_cluster(x.to(tl.float32), x_ends.to(tl.float32), 0, 0, 0, LOG, 1, 1, False,
                                           SHIFT > 0)
    _store_slice(y_ptr, y, y_ends, row, M, N, x_row_stride, y_row_stride, 0, BLOCK, SHIFT, 1)


@triton.jit
def _forward_split_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG,
                          LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr, ALIGN: tl.constexpr):
    # slots[0]: the next ticket; slots[1 + t]: (max, sum) of ticket t's slice, 0 until published.
    N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = split.take_ticket(slots_ptr)
    while ticket < end:
        row, done, cols, new, old = split.ticket_work(ticket, M, N, SLICES, LAG, BLOCK)
        # Both loads go out at once: the new slice from HBM, the lagged one from L2.
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=new, other=-float("inf")).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        next_ticket = split.take_ticket(slots_ptr)

        if row < M:
            # Read: this slice's max and sum of exp(x - max). The word is never 0: a slice
            # holds at least one element, so sum >= 1, or max = -inf when all are -inf.
            slice_max = tl.max(x_new, axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)  # all -inf: sum 0, not NaN
            split.publish(slots_ptr, ticket, slice_max, tl.sum(tl.exp2((x_new - shift) * LOG2E), axis=0))

        if done >= 0:
            # Write: row `done`, once all of its slices are published (tickets below ours).
            maxes, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * LOG2E), 0.0), axis=0))
            # y = (x - max) - log(total), or its exp; x - max first, as it is exact
            if LOG:
                y = (x_old - row_max) - log2_total * LN2
            else:
                y = tl.exp2((x_old - row_max) * LOG2E - log2_total)
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG: tl.constexpr,
                            BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                            PERSISTENT: tl.constexpr, LATE_WAIT: tl.constexpr = False, SHIFT: tl.constexpr = 0):
    # A row across the CLUSTER CTAs of a cluster (pintail/_core/cluster.py): CTA `rank` holds
    # slice `rank` in registers (its exps, for softmax), trades (max, sum of exp(x - max))
    # with its peers through distributed shared memory, and writes its slice of y from the
    # registers: one read, one write, one exp an element. PERSISTENT: a cluster takes row
    # after row and loads the next row's slice before this row's exchange, so its bytes are
    # in flight while the CTA waits on its peers and writes y (16 more bits of registers an
    # element). Otherwise one row a cluster: the GPU starts a new cluster where one ended,
    # and the other clusters on the SM hide the wait. LATE_WAIT (one row a cluster only): the
    # CTA waits for its peers to start only once its slice is loaded and summed. SHIFT:
    # slices from the first 16-byte boundary in the row, the row's ends apart (cluster.window).
    if PERSISTENT:  # the side rows may start now (launch_forward's programmatic dependent launch)
        gdc_launch_dependents()
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER, WAIT=PERSISTENT or not LATE_WAIT)
    if PERSISTENT:
        x_next, ends_next = _load_slice(x_ptr, first_row, M, N, x_row_stride, rank, BLOCK, SHIFT, CLUSTER)
        for i in range(0, ROUNDS):
            row = first_row + i * clusters  # every CTA runs every round: rows past M join the exchange
            x, x_ends = _widened(x_next), ends_next.to(tl.float32)
            next_row = row + clusters
            x_next, ends_next = _load_slice(x_ptr, next_row, M, N, x_row_stride, rank, BLOCK, SHIFT, CLUSTER)
            y, y_ends, token = _softmax_across_cluster(x, x_ends, WORDS, i, token, LOG, CLUSTER, CLUSTER_POW2, False,
                                                       SHIFT > 0)
            _store_slice(y_ptr, y, y_ends, row, M, N, x_row_stride, y_row_stride, rank, BLOCK, SHIFT, CLUSTER)
    else:
        x, x_ends = _load_slice(x_ptr, first_row, M, N, x_row_stride, rank, BLOCK, SHIFT, CLUSTER)
        y, y_ends, token = _softmax_across_cluster(_widened(x), x_ends.to(tl.float32), WORDS, 0, token, LOG,
                                                   CLUSTER, CLUSTER_POW2, LATE_WAIT, SHIFT > 0)
        _store_slice(y_ptr, y, y_ends, first_row, M, N, x_row_stride, y_row_stride, rank, BLOCK, SHIFT, CLUSTER)


@triton.jit
def _widened(x):
    """x in float32. A bf16 pair arrives as one 32-bit word, and each half becomes a float32
    by one shift or one mask (the plain convert takes a PRMT and a shift for the high half:
    1.5 instructions an element against 1). Inline PTX: GPU kernels only."""
    if x.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("{\nshl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xffff0000;\n}", "=f,=f,r", [x],
                                         dtype=tl.float32, is_pure=True, pack=2)
    return x.to(tl.float32)


@triton.jit
def _load_slice(ptr, row, M, N, row_stride, rank, BLOCK: tl.constexpr, SHIFT: tl.constexpr, CLUSTER: tl.constexpr,
                other=-float("inf")):
    """CTA `rank`'s slice of `row` (`other` past the row or past M) and, where SHIFT, the
    row's ends that fall in it (cluster.row_ends; else a placeholder)."""
    start = cluster.slice_start(row, row_stride, SHIFT)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(ptr + start + cols, mask=cluster.slice_mask(row, row_stride, N, rank, BLOCK, SHIFT) & (row < M),
                other=other)
    if SHIFT:
        at, in_row = cluster.row_ends(row, row_stride, N, rank, BLOCK, SHIFT, CLUSTER)
        ends = tl.load(ptr + start + at, mask=in_row & (row < M), other=other)
    else:
        ends = tl.full((1,), other, ptr.dtype.element_ty)
    return x, ends


@triton.jit
def _store_slice(ptr, y, y_ends, row, M, N, x_row_stride, row_stride, rank, BLOCK: tl.constexpr,
                 SHIFT: tl.constexpr, CLUSTER: tl.constexpr):
    """Store the slice of `_load_slice` and its ends (masks from x's row stride: cluster.window
    takes SHIFT only where the strides agree modulo SHIFT)."""
    start = cluster.slice_start(row, row_stride, SHIFT)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + start + cols, y.to(ptr.dtype.element_ty),
             mask=cluster.slice_mask(row, x_row_stride, N, rank, BLOCK, SHIFT) & (row < M))
    if SHIFT:
        at, in_row = cluster.row_ends(row, x_row_stride, N, rank, BLOCK, SHIFT, CLUSTER)
        tl.store(ptr + start + at, y_ends.to(ptr.dtype.element_ty), mask=in_row & (row < M))


@triton.jit
def _log2_units(v):
    """v * LOG2E, rounded once and never fused into an FMA: a slice's exps are taken from the
    shift so rounded, and the combine must see the very same shifts for them to cancel (an
    FMA's unrounded product would leave up to 7e-4 of error at a max of 1e4). The
    interpreter (numpy) fuses nothing."""
    if _INTERPRETED:
        return v * LOG2E
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, 0f3FB8AA3B;", "=f,f", [v], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _exp2_shifted(x, shift2):
    """exp2(x * LOG2E - shift2) with the product unrounded (an FMA): as exact as exp((x -
    shift) ...) near the max, where x * LOG2E rounded first errs by up to 3e-4 at |x| = 1e4.
    The interpreter has no FMA: there float64 holds the product exactly."""
    if _INTERPRETED:
        return tl.exp2((x.to(tl.float64) * LOG2E_FLOAT32 - shift2).to(tl.float32))
    return tl.exp2(tl.fma(x, LOG2E, -shift2))


@triton.jit
def _log2_units_rounding(v, v2):
    """v * LOG2E - v2 exactly, for v2 = _log2_units(v): what the rounding left out (an FMA's
    result, exact; in the interpreter, float64 products of float32 values, exact too)."""
    if _INTERPRETED:
        return (v.to(tl.float64) * LOG2E_FLOAT32 - v2.to(tl.float64)).to(tl.float32)
    return tl.inline_asm_elementwise("fma.rn.f32 $0, $1, 0f3FB8AA3B, $2;", "=f,f,f", [v, -v2], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _softmax_across_cluster(x, x_ends, WORDS, i, token, LOG: tl.constexpr, CLUSTER: tl.constexpr,
                            CLUSTER_POW2: tl.constexpr, WAIT: tl.constexpr, ENDS: tl.constexpr):
    """This CTA's slice of (log_)softmax of row i of the cluster, from its slice x (float32),
    and of the row's ends x_ends where ENDS. WAIT: first finish `cluster.start`'s barrier
    (started with WAIT False). CLUSTER 1: the whole row in one program, nothing to trade."""
    slice_max = tl.max(x, axis=0)
    if ENDS:
        slice_max = tl.maximum(slice_max, tl.max(x_ends, axis=0))
    # the shift in log2 units: each exp is one FFMA and a MUFU (not x - shift, then * LOG2E)
    shift2 = tl.where(slice_max == -float("inf"), 0.0, _log2_units(slice_max))  # all -inf: sum 0, not NaN
    e = _exp2_shifted(x, shift2)
    part = tl.sum(e, axis=0)
    e_ends = x_ends
    if ENDS:
        e_ends = _exp2_shifted(x_ends, shift2)
        part += tl.sum(e_ends, axis=0)
    if WAIT:  # a data dependence on the slice's sum keeps the wait behind its loads
        token = cluster.wait(token + (part != part).to(tl.int32))
    if CLUSTER > 1:
        maxes, sums, token = cluster.exchange(WORDS, i, slice_max, part, token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)  # -inf only where the whole row is: then NaN, as torch
        row_max2 = _log2_units(row_max)  # every shift rounded as its CTA rounded it: they cancel exactly
        log2_total = tl.log2(tl.sum(sums * tl.exp2(_log2_units(maxes) - row_max2), axis=0))
    else:
        row_max, row_max2, log2_total = slice_max, shift2, tl.log2(part)
    if LOG:  # the total counts from the rounded row_max2: move it to row_max itself
        log2_total -= _log2_units_rounding(row_max, row_max2)
        return (x - row_max) - log2_total * LN2, (x_ends - row_max) - log2_total * LN2, token
    # a slice of -inf in a row that is not has exps 0 and scale 0 (not 0 x inf where the
    # row's max is below -88); a row of -inf keeps its NaN, as torch's
    empty = (slice_max == -float("inf")) & (row_max != -float("inf"))
    scale = tl.where(empty, 0.0, tl.exp2(shift2 - row_max2 - log2_total))
    return e * scale, e_ends * scale, token


@triton.jit
def _forward_two_pass_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, first_row, LOG: tl.constexpr,
                             BLOCK: tl.constexpr, ALIGN: tl.constexpr, AFTER_CLUSTERS: tl.constexpr = False):
    N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    # One program a row, two passes: (max, sum of exp(x - max)) chunk by chunk, then y. The
    # first pass's loads ask L2 to keep the row (evict_last) and the second's to drop it
    # (evict_first), so the second read comes from L2 while the rows in flight fit there.
    row = first_row + tl.program_id(0).to(tl.int64)  # first_row: past the clusters' rows (SIDE_ROWS)
    row_max = -float("inf")
    total = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, axis=0))
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # all -inf so far: sum 0, not NaN
        total = total * tl.exp2((row_max - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), axis=0)
        row_max = new_max
    log2_total = tl.log2(total)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if LOG:
            y = (x - row_max) - log2_total * LN2
        else:
            y = tl.exp2((x - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
    if AFTER_CLUSTERS:  # side rows beside persistent clusters (launch_forward): end only after
        gdc_wait()      # the clusters have, so that the stream's next work sees every row


@triton.jit
def packed_output(low, high, row_max, log2_total, LOG: tl.constexpr, BF16: tl.constexpr):
    """(log_)softmax of a row's values held as words (low and high halves, unpacked), packed
    back into words; row_max and log2_total: the row's max and log2 of sum(exp(x - max))."""
    if LOG:
        return pack_pairs(low - row_max - log2_total * LN2, high - row_max - log2_total * LN2, BF16)
    return pack_pairs(tl.exp2((low - row_max) * LOG2E - log2_total), tl.exp2((high - row_max) * LOG2E - log2_total),
                      BF16)


@triton.jit
def _forward_packed_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, zero, LOG: tl.constexpr,
                           BF16: tl.constexpr, BLOCK: tl.constexpr):
    # One program a row of N (even, N <= BLOCK) 16-bit values, held as BLOCK / 2 words:
    # 32 registers a thread at 32768 / 16 warps (58 in all: two programs an SM). Unpacked
    # float32 values would take 64 more; so each pass unpacks the words again, through
    # `words ^ (zero & bits of the last reduction)`: `zero` is a runtime 0 that the compiler
    # cannot fold, which keeps it from holding one pass's float32 values for the next.
    row = tl.program_id(0).to(tl.int64)
    words = tl.arange(0, BLOCK // 2)
    mask = words < N // 2
    packed = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (x_row_stride // 2) + words, mask=mask,
                     other=NEG_INF_BF16_PAIR if BF16 else NEG_INF_FP16_PAIR)
    low, high = unpack_pairs(packed, BF16)
    row_max = tl.max(tl.maximum(low, high), axis=0)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)  # a row of -inf: NaN, as torch
    low, high = unpack_pairs(packed ^ (zero & row_max.to(tl.int32, bitcast=True)), BF16)
    total = tl.sum(tl.exp2((low - shift) * LOG2E) + tl.exp2((high - shift) * LOG2E), axis=0)
    log2_total = tl.log2(total)
    low, high = unpack_pairs(packed ^ (zero & total.to(tl.int32, bitcast=True)), BF16)
    y = packed_output(low, high, row_max, log2_total, LOG, BF16)
    tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + row * (y_row_stride // 2) + words, y, mask=mask)


# ---------------------------------------------------------------------------- backward
# softmax:     dx = y * (dy - sum(y * dy))
# log_softmax: dx = dy - exp(y) * sum(dy)


@triton.jit
def _backward_rows_kernel(y_ptr, dy_ptr, dx_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                          LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr):
    N, y_row_stride = aligned(N, ALIGN), aligned(y_row_stride, ALIGN)
    dy_row_stride, dx_row_stride = aligned(dy_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    y = tl.load(y_ptr + rows[:, None] * y_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if LOG:
        dx = dy - tl.exp2(y * LOG2E) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
    tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_row_shift_kernel(y_ptr, dy_ptr, dx_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                               LOG: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # as in the forward
    row = tl.program_id(0).to(tl.int64)
    y, y_ends = _load_slice(y_ptr, row, M, N, y_row_stride, 0, BLOCK, SHIFT, 1, other=0.0)
    dy, dy_ends = _load_slice(dy_ptr, row, M, N, dy_row_stride, 0, BLOCK, SHIFT, 1, other=0.0)
    total, _ = _backward_total(y, dy, y_ends, dy_ends, 0, 0, 0, LOG, 1, 1, SHIFT > 0)
    _store_slice(dx_ptr, _dx(y, dy, total, LOG), _dx(y_ends, dy_ends, total, LOG), row, M, N,
                 y_row_stride, dx_row_stride, 0, BLOCK, SHIFT, 1)


@triton.jit
def _backward_split_kernel(y_ptr, dy_ptr, dx_ptr, slots_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                           SLICES, LAG, LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr,
                           ALIGN: tl.constexpr):
    # The forward split plan, with one partial sum per slice: sum(dy) or sum(y * dy).
    N, y_row_stride = aligned(N, ALIGN), aligned(y_row_stride, ALIGN)
    dy_row_stride, dx_row_stride = aligned(dy_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = split.take_ticket(slots_ptr)
    while ticket < end:
        row, done, cols, new, old = split.ticket_work(ticket, M, N, SLICES, LAG, BLOCK)
        dy_new = tl.load(dy_ptr + row * dy_row_stride + cols, mask=new, other=0.0).to(tl.float32)
        y_old = tl.load(y_ptr + done * y_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        dy_old = tl.load(dy_ptr + done * dy_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        if LOG:
            part = tl.sum(dy_new, axis=0)
        else:
            y_new = tl.load(y_ptr + row * y_row_stride + cols, mask=new, other=0.0).to(tl.float32)
            part = tl.sum(y_new * dy_new, axis=0)
        next_ticket = split.take_ticket(slots_ptr)

        if row < M:
            split.publish(slots_ptr, ticket, tl.full((), 1.0, tl.float32), part)  # 1.0: the word is never 0

        if done >= 0:
            _, parts, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            total = tl.sum(tl.where(valid, parts, 0.0), axis=0)
            if LOG:
                dx = dy_old - tl.exp2(y_old * LOG2E) * total
            else:
                dx = y_old * (dy_old - total)
            tl.store(dx_ptr + done * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


@triton.jit(do_not_specialize=["SLICES"])  # SLICES specialised to 1 fails Triton 3.6's compile
def _backward_own_row_kernel(y_ptr, dy_ptr, dx_ptr, slots_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride,
                             SLICES, LOG: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr,
                             ALIGN: tl.constexpr):
    # Per ticket (row, slice): the slice's sum(dy) (log_softmax) or sum(y * dy), published
    # as soon as the slice is loaded; the slice's dx once its row is complete. Each program
    # holds two tickets: the one it waits on and the next, whose partial it has published
    # before it waits (_split.py: why that cannot deadlock).
    N, y_row_stride = aligned(N, ALIGN), aligned(y_row_stride, ALIGN)
    dy_row_stride, dx_row_stride = aligned(dy_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = M * SLICES
    ticket = split.take_ticket(slots_ptr)
    row, cols, mask = split.ticket_slice(ticket, M, N, SLICES, BLOCK)
    y_raw = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0)
    dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0)
    split.publish_own(slots_ptr, ticket, end, _partial(y_raw, dy_raw, LOG))
    while ticket < end:
        next_ticket = split.take_ticket(slots_ptr)
        next_row, next_cols, next_mask = split.ticket_slice(next_ticket, M, N, SLICES, BLOCK)
        y_next = tl.load(y_ptr + next_row * y_row_stride + next_cols, mask=next_mask, other=0.0)
        dy_next = tl.load(dy_ptr + next_row * dy_row_stride + next_cols, mask=next_mask, other=0.0)
        split.publish_own(slots_ptr, next_ticket, end, _partial(y_next, dy_next, LOG))
        _, parts, valid = split.wait_for_row(slots_ptr, row, SLICES, SLICES_POW2)
        total = tl.sum(tl.where(valid, parts, 0.0), axis=0)
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)  # recomputed: not carried in registers
        y, dy = y_raw.to(tl.float32), dy_raw.to(tl.float32)
        if LOG:
            dx = dy - tl.exp2(y * LOG2E) * total
        else:
            dx = y * (dy - total)
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N)
        ticket, row, y_raw, dy_raw = next_ticket, next_row, y_next, dy_next


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _backward_cluster_kernel(y_ptr, dy_ptr, dx_ptr, M, N, y_row_stride, dy_row_stride, dx_row_stride, WORDS, ROUNDS,
                             LOG: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                             CLUSTER_POW2: tl.constexpr, PERSISTENT: tl.constexpr, SHIFT: tl.constexpr = 0):
    # The forward's cluster plan for the backward: CTA `rank` holds slice `rank` of y and dy
    # (as loaded, 16-bit where they are), trades the slice's sum(dy) or sum(y * dy) with its
    # peers and writes its slice of dx. PERSISTENT: rows in turn, the next row's slices
    # loaded before this row's exchange, as in the forward; otherwise one row a cluster.
    # SHIFT: as in the forward.
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    if PERSISTENT:
        y_next, y_ends_next = _load_slice(y_ptr, first_row, M, N, y_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
        dy_next, dy_ends_next = _load_slice(dy_ptr, first_row, M, N, dy_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
        for i in range(0, ROUNDS):
            row = first_row + i * clusters
            y_raw, y_ends, dy_raw, dy_ends = y_next, y_ends_next, dy_next, dy_ends_next
            next_row = row + clusters
            y_next, y_ends_next = _load_slice(y_ptr, next_row, M, N, y_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
            dy_next, dy_ends_next = _load_slice(dy_ptr, next_row, M, N, dy_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
            total, token = _backward_total(y_raw, dy_raw, y_ends, dy_ends, WORDS, i, token, LOG, CLUSTER,
                                           CLUSTER_POW2, SHIFT > 0)
            _store_slice(dx_ptr, _dx(y_raw, dy_raw, total, LOG), _dx(y_ends, dy_ends, total, LOG), row, M, N,
                         y_row_stride, dx_row_stride, rank, BLOCK, SHIFT, CLUSTER)
    else:
        y_raw, y_ends = _load_slice(y_ptr, first_row, M, N, y_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
        dy_raw, dy_ends = _load_slice(dy_ptr, first_row, M, N, dy_row_stride, rank, BLOCK, SHIFT, CLUSTER, 0.0)
        total, token = _backward_total(y_raw, dy_raw, y_ends, dy_ends, WORDS, 0, token, LOG, CLUSTER, CLUSTER_POW2,
                                       SHIFT > 0)
        _store_slice(dx_ptr, _dx(y_raw, dy_raw, total, LOG), _dx(y_ends, dy_ends, total, LOG), first_row, M, N,
                     y_row_stride, dx_row_stride, rank, BLOCK, SHIFT, CLUSTER)


@triton.jit
def _backward_total(y_raw, dy_raw, y_ends, dy_ends, WORDS, i, token, LOG: tl.constexpr, CLUSTER: tl.constexpr,
                    CLUSTER_POW2: tl.constexpr, ENDS: tl.constexpr):
    """Row i's sum(dy) (log_softmax) or sum(y * dy) (softmax), from this CTA's slices of y and
    dy (and of the row's ends where ENDS) and its peers'."""
    part = _partial(y_raw, dy_raw, LOG)
    if ENDS:
        part += _partial(y_ends, dy_ends, LOG)
    if CLUSTER == 1:  # the whole row in one program
        return part, token
    _, total, token = cluster.exchange_sums(WORDS, i, tl.full((), 0.0, tl.float32), part, token, CLUSTER,
                                            CLUSTER_POW2)
    return total, token


@triton.jit
def _dx(y_raw, dy_raw, total, LOG: tl.constexpr):
    """dx from y, dy and the row's `_partial` sums (broadcast against them)."""
    y, dy = y_raw.to(tl.float32), dy_raw.to(tl.float32)
    if LOG:
        return dy - tl.exp2(y * LOG2E) * total
    return y * (dy - total)


@triton.jit
def _partial(y_raw, dy_raw, LOG: tl.constexpr):
    """The row sum dx needs: sum(dy) (log_softmax) or sum(y * dy) (softmax)."""
    if LOG:
        return tl.sum(dy_raw.to(tl.float32), axis=0)
    return tl.sum(y_raw.to(tl.float32) * dy_raw.to(tl.float32), axis=0)
