"""softmax and log_softmax along any dim: Triton kernels, launch heuristics, autograd,
and torch.library registration.

Bytes per element (the floor): forward reads x and writes y; backward reads y and dy and
writes dx. Every kernel here moves each of those once through HBM.

Plans, picked by row length N:
- rows: N fits on chip. A program loads a tile of whole rows into registers, reduces,
  and writes; one read, one write, one exp per element.
- cluster (GPUs with thread-block clusters, rows of 16385 to 262144): a row across the
  CTAs of a cluster, each slice in registers, the slices' (max, sum) or partial sums traded
  through distributed shared memory (pintail/_cluster.py); one read, one write, one exp per
  element. Shorter rows (forward up to 131072, backward up to 65536) go one cluster a row;
  longer ones on persistent clusters that load their next row's slice while they work. The
  persistent forward leaves its last rows to the two-pass plan on the SMs its clusters leave
  idle, launched behind them in the same stream (programmatic dependent launch, SIDE_ROWS).
  Elsewhere (GPUs without clusters) the plans below take these rows:
- packed (forward, bf16 / fp16 rows of even length from 28672 to 32768): a program a row
  holds the row in registers as 32-bit words of two values and unpacks them for each pass
  over the row; one read, one write, two exps per element.
- two pass (forward, rows of up to 64 KB: N up to 32768 in bf16 / fp16): a program a row
  reads it twice, the second time from L2 (the first read asks L2 to keep it); y written
  once, two exps per element.
- split: N is too long for one program (pintail/_split.py: ticket-ordered slices, the
  output written `lag` rows behind the reads). Each slice publishes its (max, sum of
  exp(x - max)); the lagged write combines them into the log-sum-exp. HBM traffic: x read
  once, y written once.
- own row (softmax backward, rows of 32769 to 524288 elsewhere): ticket-ordered slices too, but a
  program keeps its slice of y and dy in registers, publishes the slice's partial sum, and
  writes dx of that same slice once the row's other slices have published
  (pintail/_split.py). No L2 re-read: 0.82-0.84 of copy against the lagged plan's 0.80-0.81.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import _cluster as cluster, _split as split, reference
from ._launch import (INTERPRET, KERNEL_DTYPES, NEG_INF_BF16_PAIR, NEG_INF_FP16_PAIR, aligned, as_rows,
                      canonical_dim, cdiv, empty_like_rows, in_row, launch, multiprocessors, next_power_of_2,
                      no_second_derivative, pack_pairs, packs_into_words, row_alignment, rows_tail, runs_kernels,
                      unpack_pairs, whole_tiles, widened_tail)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)    # log(x) = log2(x) * LN2
_INTERPRETED = tl.constexpr(INTERPRET)
LOG2E_FLOAT32: tl.constexpr = tl.constexpr(1.44269502162933349609375)  # LOG2E as float32 rounds it (0x3FB8AA3B)


# ----------------------------------------------------------------------------- forward


@triton.jit
def _forward_rows_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, TAIL: tl.constexpr, EVEN: tl.constexpr, ALIGN: tl.constexpr):
    # One tile of BLOCK_M whole rows: read once, reduce in registers, write once. EVEN
    # (N == BLOCK_N + TAIL, M a multiple of BLOCK_M): no masks (_launch.in_row). TAIL > 0:
    # the row as two tiles, BLOCK_N columns and TAIL more (_launch.rows_tail), so that a row of
    # 10240 = 8192 + 2048 computes on 10240 lanes, not on a tile of 16384.
    if ALIGN > 1:  # vector loads for rows of 8- or 4-divisible length (_launch.row_alignment)
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
    if ALIGN > 1:  # as in the rows kernel
        N, x_row_stride, y_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(y_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        # Both loads go out at once: the new slice from HBM, the lagged one from L2.
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M),
                        other=-float("inf")).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0),
                        other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")

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
    # A row across the CLUSTER CTAs of a cluster (pintail/_cluster.py): CTA `rank` holds
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
    if ALIGN > 1:  # as in the rows kernel
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
    if ALIGN > 1:  # as in the forward
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
    if ALIGN > 1:  # as in the rows kernel
        N, y_row_stride = aligned(N, ALIGN), aligned(y_row_stride, ALIGN)
        dy_row_stride, dx_row_stride = aligned(dy_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = split.ticket_work(ticket, SLICES, LAG, BLOCK)
        new = (cols < N) & (row < M)
        old = (cols < N) & (done >= 0)
        dy_new = tl.load(dy_ptr + row * dy_row_stride + cols, mask=new, other=0.0).to(tl.float32)
        y_old = tl.load(y_ptr + done * y_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        dy_old = tl.load(dy_ptr + done * dy_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        if LOG:
            part = tl.sum(dy_new, axis=0)
        else:
            y_new = tl.load(y_ptr + row * y_row_stride + cols, mask=new, other=0.0).to(tl.float32)
            part = tl.sum(y_new * dy_new, axis=0)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")

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
    if ALIGN > 1:  # as in the rows kernel
        N, y_row_stride = aligned(N, ALIGN), aligned(y_row_stride, ALIGN)
        dy_row_stride, dx_row_stride = aligned(dy_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = M * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    row = ticket // SLICES
    cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
    y_raw = tl.load(y_ptr + row * y_row_stride + cols, mask=(cols < N) & (row < M), other=0.0)
    dy_raw = tl.load(dy_ptr + row * dy_row_stride + cols, mask=(cols < N) & (row < M), other=0.0)
    split.publish_own(slots_ptr, ticket, end, _partial(y_raw, dy_raw, LOG))
    while ticket < end:
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        next_row = next_ticket // SLICES
        next_cols = (next_ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        next_mask = (next_cols < N) & (next_row < M)
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


# ------------------------------------------------------------------ launch heuristics
# Measured on the H200, bf16, M*N = 2^27.
# Rows plan: (row length up to, elements per program at least, warps). Past the last
# entry a row does not fit on chip and takes the split plan.
FORWARD_ROWS = [(1024, 2048, 4), (2048, 2048, 4), (4096, 8192, 16), (8192, 8192, 16), (16384, 16384, 8)]
# Backward rows of 1025-4096 go two a program at 16 warps (two runs each at 4096:
# log_softmax 1.003 / 1.002 against one a program's 0.962 / 0.962, softmax 1.001 / 1.003
# against 1.002 / 1.006).
BACKWARD_ROWS = [(1024, 2048, 4), (4096, 8192, 16), (8192, 8192, 16), (16384, 16384, 4), (32768, 32768, 16)]
# Rows plan, rows whose starts no vector width divides (cluster.vector_shift: an odd length,
# or a stride), past ROWS_SHIFT_PAST: one row a program from the row's first 16-byte
# boundary, its whole 16-byte pieces one slice of BLOCK = next_power_of_2(N // SHIFT * SHIFT),
# its ends a 1-D tensor (_forward_row_shift_kernel), at the warps of the tables (BLOCK up to,
# warps): about 64 elements a thread forward, 32-128 backward. Kernel alone,
# bf16, softmax forward / backward, the rows plan's 2-byte loads -> this plan:
# 385 0.62 / 0.82 -> 0.59 / 0.88, 513 0.61 / 0.81 -> 0.77 / 0.99, 769 0.74 / 0.85 -> 0.95 /
# 0.99, 1001 0.82 / 0.86 -> 0.94 / 0.99, 4097 0.41 / 0.62 -> 0.94 / 0.99, 7001 0.62 / 0.83 ->
# 0.94 / 0.95, 12289 0.42 / 0.59 -> 0.80 / 0.90, 16383 0.46 / 0.62 -> 0.88 / 0.91; 257 lost
# (0.46 / 0.65 -> 0.40 / 0.59). log_softmax alike (backward 0.93-1.00). Slices of 2048 at
# 1 warp and backward past 16384 (GPUs without clusters only) not measured. The slices start
# on 16-byte boundaries (cluster.window's `boundary`). 16 -> 128, alternating,
# two runs each: forward at 12289 0.80 -> 0.78; backward softmax 769-4097 +0.003, 12289
# 0.91 -> 0.92, 16383 0.91 -> 0.88; log_softmax 769 0.99 -> 0.96, 4097 0.99 -> 0.98, 12289
# 0.93 -> 0.88, 16383 0.95 -> 0.945.
# Rows of 1025-8191 that leave their tile part empty (hidden sizes no power of two: 1536,
# 2560, 3072, 5120, 6144, ...) go one a program at 4 warps, either direction, either op: the
# tables above were tuned on full tiles, where their many warps a row won by 0.01; on part
# empty tiles those warps lost up to 0.2. Kernel alone, H200, bf16, softmax
# forward table -> this at 1536 / 2560 / 3072 / 3584 / 5120 / 6144 / 7168: 0.74 / 0.80 / 0.87
# / 0.92 / 0.80 / 0.88 / 0.93 -> 0.97 / 0.96 / 0.96 / 0.95 / 0.96 / 0.95 / 0.94 (the full
# tiles' tables: 4096 0.95, 8192 0.955; this at 4096 / 8192 0.94); backward 0.93 / 0.87 / 0.93
# / 0.99 / 0.88 / 0.94 / 0.99 -> 1.00 at each; log_softmax forward 2560 / 5120 / 6144 0.76 /
# 0.80 / 0.89 -> 0.96 / 0.96 / 0.95, backward 0.94 / 0.90 / 0.96 -> 0.97 / 0.96 / 1.00.
# Full rows of 2048 take the forward table's 4 warps a row (0.97 against two-row tiles' 0.88).
PART_FILLED_ROWS = (1024, 8192, {"BLOCK_M": 1, "num_warps": 4})
# 16-bit rows that leave a tile of 16384 part empty (8193-16383), where the GPU has
# clusters: forward one row a cluster of 8192-element slices (_ONE_ROW_8192 below), 0.944 at
# 12288 against the rows plan's 0.80-0.81 at 4-32 warps (64-128 floats a thread leave few
# rows in flight); backward one row a cluster of 4096 (BACKWARD_CLUSTER's first entry).
# Kernel alone, bf16, rows plan -> this: forward 12288 0.81 -> 0.944, 14336 ->
# 0.952; backward 10240 / 12288 / 14336 0.900 / 0.961 / 0.987 -> 0.994 / 0.989 / 0.995,
# log_softmax's 0.844 / 0.879 / 0.917 -> 0.961 / 0.991 / 0.993. Rows whose starts no vector
# width divides (12289 / 14337, row-shift plan -> this): softmax forward 0.805 /
# 0.847 -> 0.899 / 0.945, backward 0.910 / 0.914 -> 0.993 / 0.993; log_softmax forward
# 0.822 / 0.868 -> ~0.87 / 0.922; log_softmax's backward keeps the row-shift plan (its 8
# warps: 0.975 / 0.983 against the cluster's 0.964 / 0.923).
PART_FILLED_CLUSTER_TILE = 16384
# 16-bit rows of 8193-10240 that are whole 16-byte vectors (length, strides, starts) go
# forward as two tiles (_launch.rows_tail: 10240 = 8192 + 2048) one a program at 4 warps,
# the tail at least 1024 (_launch.widened_tail), where the cluster of 8192-element slices
# above leaves its second CTA mostly idle. Kernel alone, bf16, 10240, cluster ->
# two tiles: softmax 0.871 -> 0.933, log_softmax 0.825 -> 0.923 (8 warps 0.84 / 0.83: 58
# registers and 11 barriers a row keep fewer bytes in flight). Softmax /
# log_softmax, cluster -> this: 8704 0.80 / 0.74 -> 0.87 / 0.87 (the tail as 512: 0.83 /
# 0.84), 9216 0.82 / 0.77 -> 0.89 / 0.88, 9224 0.78 / 0.72 -> 0.86 / 0.79 (a masked tail;
# 0.76 while the head was masked too: 107 registers, 4 programs an SM where 96 fit 5), 9728
# -> 0.89 / 0.88 (cluster 0.85 / 0.80). Rows whose starts no vector width divides keep the
# cluster's SHIFT.
FORWARD_TWO_TILES = (8192, 10240, {"plan": "rows", "BLOCK_M": 1, "num_warps": 4})
# log_softmax's 16-bit rows of 10241-12288 forward across a cluster of 4096-element slices
# (three fill 12288; two of 8192 fill it 0.75): 12288, 0.894 -> 0.934 (softmax
# 0.925 -> 0.931, kept on 8192).
LOG_FORWARD_CLUSTER_4096 = (10240, 12288, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False})
ROWS_SHIFT_PAST = 512
FORWARD_ROW_SHIFT = [(2048, 1), (4096, 2), (8192, 4), (16384, 8)]
# log_softmax's backward takes 8 warps at slices of 16384 (4 -> 8 warps: 12289
# 0.93 -> 0.97, 16383 0.95 -> 0.98; softmax's 0.90 -> 0.84 and 0.904 -> 0.910, so 4).
BACKWARD_ROW_SHIFT = {False: [(1024, 1), (16384, 4), (32768, 16)],
                      True: [(1024, 1), (8192, 4), (16384, 8), (32768, 16)]}
ROW_SHIFT_BOUNDARY_BYTES = {"forward": 16, "backward": 16}
# Split plan: slice length, warps, persistent programs per SM, and the lag in rounds of
# the persistent grid (one round: the writes trail the reads by as many tickets as there
# are programs, so a row's readers have finished when its writers come, and the lagged
# slices are still in L2; two rounds fell out of L2, half a round waited).
FORWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}
# Two passes over each row, its second read from L2 (eviction hints), between the rows plan
# and the split plan (kernel alone, H200, bf16; split plan 0.80 / 0.81 for softmax /
# log_softmax): softmax 0.78 / 0.90 / 0.85 at N = 16400 / 24576 / 32768 at 8 warps;
# log_softmax 0.91 / 0.86 at 24576 / 32768 at 16 warps, where its 8 warps (48 registers,
# 5 programs per SM where softmax's 54 fit 4) fell to 0.79 at 32768: likely more rows in
# flight than L2 keeps (5 x 132 x 64 KB = 43 MB). Past 32768, two passes of 16384 / 16 warps
# beat the split plan only where the row is whole chunks (softmax / log_softmax 0.83 / 0.85
# against 0.79 / 0.81 at 49152, 0.80-0.81 / 0.82-0.83 against 0.79-0.80 / 0.81 at 65536) and
# lose where it is not (0.73 / 0.77 against 0.78 / 0.80 at 40000); at 131072 they fall to 0.65.
# The gain needs the rows in flight to stay in L2 between the passes, so the limit is in
# bytes a row: float32 rows past the rows plan (16385+ elements, 64 KB+) take the split plan
# (not measured in float32).
FORWARD_TWO_PASS_ROW_BYTES = 65536
# 16-bit rows of even length from 28672 to 32768: the row in registers as packed words
# (_forward_packed_kernel), 16 warps. Kernel alone, H200, bf16,
# against the two-pass plan: softmax 0.86 / 0.86 / 0.90 at 28672 / 30000 / 32768 against
# 0.82 / 0.79 / 0.84-0.85; log_softmax 0.92 at 32768 against 0.86. At 32 warps held to 32
# registers (two programs an SM) 0.83 / 0.83 / 0.87-0.89 (log_softmax 0.92). Shorter rows
# lose to the two-pass plan: 0.75 against 0.91 at 24576, 0.63 against 0.81 at 20000.
FORWARD_PACKED = (28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16})
FORWARD_TWO_PASS = {False: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 8},
                    True: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 16}}  # by log
# Past CLUSTER_PAST elements, where the GPU has thread-block clusters, rows go across a
# cluster as the tables below say (row length up to, the cluster plan's config).
# PERSISTENT: as many clusters as fit at once take the rows in turn, loading the next
# row's slice ahead; else one cluster a row (_forward_cluster_kernel).
CLUSTER_PAST = 16384
# Forward, kernel alone, H200, bf16 (tune_softmax.py --plans cluster,two_pass,rows): one row a cluster of 8192-element slices, 4 warps held to 80 registers (softmax's 87
# fit 5 CTAs an SM, 80 fit 6; log_softmax's take 80 anyway): softmax 0.93 / 0.94-0.95 /
# 0.95 / 0.95 / 0.91 at 20000 / 24576-32768 / 65536 / 131072, against the two-pass plan's
# 0.81-0.91, the packed plan's 0.92 and persistent clusters' 0.87-0.88; log_softmax
# 0.90-0.94. One row a cluster needs no registers for the next row, and the GPU starts a
# cluster where one ended, so the other clusters on an SM hide the exchange. At 262144 it
# falls to 0.60-0.64 (16 x 16384), so persistent clusters of 8 x 32768 / 16 warps (0.87-0.88)
# stay there. Past 65536 (clusters of 9-16 CTAs) each CTA waits for its peers to start only
# once its slice is loaded and summed (LATE_WAIT, two runs each: 0.928 / 0.928
# against 0.910 / 0.919 at 131072); at 32768 the late wait lost 0.007, at 65536 nothing.
# The exps as one FFMA and bf16 widened in one instruction (12.8 -> 11.2 an
# element): 131072 0.923-0.936 -> 0.929-0.942 (log_softmax +0.011), elsewhere unchanged.
_ONE_ROW_8192 = {"BLOCK": 8192, "num_warps": 4, "PERSISTENT": False, "maxnreg": 80}
FORWARD_CLUSTER = [(65536, _ONE_ROW_8192), (131072, {**_ONE_ROW_8192, "LATE_WAIT": True}),
                   (262144, {"BLOCK": 32768, "num_warps": 16, "PERSISTENT": True, "SIDE_ROWS": True})]
# SIDE_ROWS: a CTA of 32768 / 16 warps fills an SM's registers, and the GPCs fit 15 clusters of
# 8 (262144): 12 of 132 SMs idle, and 512 rows take 35 rounds where 34.1 would do. The last
# `side_rows` rows go to the two-pass kernel, launched behind the clusters by programmatic
# dependent launch: each cluster CTA signals at its start, so the side rows' CTAs start while
# the clusters run and find room only on the idle SMs (kernel alone: 0.887 ->
# 0.912 at 262144 with 17 side rows, log_softmax 0.881 -> 0.908; an earlier second stream
# 0.90). Beside the clusters a side row took 69-96 us at 262144 (17-23 rounds of ~4.2 us;
# alone 48-50 us): it must start within SIDE_ROUNDS_A_SLICE rounds a slice of the clusters'
# last; 17-20 side rows on 12 idle SMs gained, 24 lost (SIDE_ROWS_AN_IDLE_SM).
SIDE_ROWS = {"BLOCK": 8192, "num_warps": 8}
SIDE_ROUNDS_A_SLICE = 3
SIDE_ROWS_AN_IDLE_SM = 1.5
# Past 131072 a row whose slices of 32768 it fills less than FORWARD_FILL_BELOW (its last
# slice mostly masked, the CTAs that hold it idle) goes in slices of 16384 / 8 warps, softmax
# only (kernel alone: 0.713 / 0.797 / 0.730 / 0.790 -> 0.802 / 0.851 / 0.773 /
# 0.849 at 135000 / 140000 / 200003 / 200064, fills 0.82-0.87; 170000 0.759 -> 0.751; where
# rows fill 0.92-1.0 the smaller slices won three times and lost four, by up to 0.03).
# log_softmax's 16384 / 8 warps take 176 registers (0.46-0.63), so it keeps 32768.
FORWARD_FILL_BELOW = 0.9
FORWARD_LOW_FILL = {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "PERSISTENT": True}
# float32 (tune_softmax.py --dtype fp32): one row a cluster of 8192 / 8 warps,
# 0.95 at 32768 and 0.96 at 131072, against persistent clusters' 0.89 / 0.91; at 262144
# persistent clusters of 16384 / 32 warps, 0.90 (16 warps 0.89; 32768-element slices spill).
FORWARD_CLUSTER_FP32 = [(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False}),
                        (262144, {"BLOCK": 16384, "num_warps": 32, "PERSISTENT": True})]
# Backward of long rows (H200 sweeps, tools/tune_softmax.py --directions bwd [--log]):
# - softmax: own row, (row length up to, slice, warps, programs per SM); 16-32 slices a row
#   did best (0.83-0.84 at 65536-262144; 64 slices 0.69). Past the last entry a row would
#   need more than 64 slices (_split.py: the own-row plan needs more programs running than
#   half a row's slices) and the lagged plan takes it (0.81 at 262144 with this config).
# - log_softmax: the lagged plan. Its new slice needs dy alone (the partial is sum(dy)), so
#   only dy is re-read from L2: 0.90-0.91 at 131072-262144, against own row's 0.81-0.84.
BACKWARD_OWN_ROW = [(131072, 4096, 4, 4), (524288, 8192, 8, 2)]
# - where the GPU has clusters (CLUSTER_PAST), either op, kernel alone, bf16:
#   one row a cluster of 4096-element slices / 4 warps, 0.99 from 20000 to 32768 and 0.99
#   at 65536 (log_softmax 0.99), against the rows plan's 0.94-0.97 and persistent clusters'
#   0.94-0.95; past 65536 persistent clusters of 16384 / 16 warps loading ahead, 0.96-0.97 at
#   131072 and 262144 (one row a cluster 0.96 at 131072, 0.72-0.79 at 262144), against own
#   row's 0.82 and the lagged plan's 0.90-0.91.
BACKWARD_CLUSTER = [(65536, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False}),
                    (262144, {"BLOCK": 16384, "num_warps": 16, "PERSISTENT": True})]
# float32 rows: one row a cluster of 8192 / 8 warps, 1.01 at 32768 and 131072 (persistent
# clusters of 8192 / 16 warps 0.99; the rows plan not timed in float32); past 131072 the
# own-row plan of 4096 / 4 warps (0.97 at 262144, against 8192 / 8 warps' 0.81 and clusters'
# 0.94): its slices of 16 KB do as well as bf16's 8192-element ones.
BACKWARD_CLUSTER_FP32 = [(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False})]
BACKWARD_OWN_ROW_FP32 = [(262144, 4096, 4, 4), (524288, 8192, 8, 2)]
BACKWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2, "LAG_ROUNDS": 1}
LOG_BACKWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 0.5}


def _config(N, rows_table, split):
    block_n = next_power_of_2(N)
    low, high, part_filled = PART_FILLED_ROWS
    if low < N < block_n <= high:
        return {"plan": "rows", "BLOCK_N": block_n, **part_filled}
    for limit, tile, warps in rows_table:
        if N <= limit:
            return {"plan": "rows", "BLOCK_M": max(1, tile // block_n), "BLOCK_N": block_n, "num_warps": warps}
    return split


def _across_cluster(N, cfg, table, clusters):
    """The cluster plan from `table` (row length up to, config) for rows past CLUSTER_PAST,
    where the GPU runs clusters; else `cfg`."""
    for limit, cluster_cfg in table if clusters and N > CLUSTER_PAST else ():
        if N <= limit:
            return {"plan": "cluster", **cluster_cfg}
    return cfg


def _part_filled_across_cluster(N, cfg, item_size, clusters, cluster_cfg):
    """cluster_cfg for 16-bit rows whose rows plan leaves a tile of PART_FILLED_CLUSTER_TILE
    part empty, where the GPU runs clusters; else cfg."""
    if clusters and item_size == 2 and cfg["plan"] == "rows" and N < cfg["BLOCK_N"] == PART_FILLED_CLUSTER_TILE:
        return {"plan": "cluster", **cluster_cfg}
    return cfg


def forward_config(N, log=False, item_size=2, packable=False, clusters=False, vectors=False):
    """The forward's plan for rows of N elements of item_size bytes; packable: 16-bit rows of
    even length whose rows start 4-byte aligned (the packed plan's words); clusters: the GPU
    runs thread-block clusters (_cluster.available); vectors: the rows are whole 16-byte
    vectors (_whole_vectors)."""
    low, high, two_tiles = FORWARD_TWO_TILES
    if vectors and item_size == 2 and low < N <= high:
        head, tail = rows_tail(N)
        return {**two_tiles, "BLOCK_N": head, "TAIL": widened_tail(tail, two_tiles["num_warps"])}
    low, high, packed = FORWARD_PACKED
    two_pass = N * item_size <= FORWARD_TWO_PASS_ROW_BYTES
    cfg = _config(N, FORWARD_ROWS, FORWARD_TWO_PASS[log] if two_pass else FORWARD_SPLIT)
    if packable and low < N <= high:
        cfg = packed
    cfg = _across_cluster(N, cfg, FORWARD_CLUSTER_FP32 if item_size == 4 else FORWARD_CLUSTER, clusters)
    low, high, log_slices_4096 = LOG_FORWARD_CLUSTER_4096
    cfg = _part_filled_across_cluster(N, cfg, item_size, clusters,
                                      log_slices_4096 if log and low < N <= high else _ONE_ROW_8192)
    if cfg["plan"] == "cluster" and cfg["PERSISTENT"] and item_size == 2 and not log:
        block, unit = cfg["BLOCK"], 16 // item_size  # the slices `cluster.window` cuts
        if N / (cdiv(N // unit * unit, block) * block) < FORWARD_FILL_BELOW:
            return FORWARD_LOW_FILL
    return cfg


def side_rows(M: int, clusters: int, cluster_size: int, sms: int) -> int:
    """Rows of M for the SMs that `clusters` persistent clusters of `cluster_size` CTAs (one
    an SM) leave idle: the most that take rounds off the clusters while no more than
    SIDE_ROWS_AN_IDLE_SM an idle SM run at once and the clusters keep rounds enough for a side
    row (SIDE_ROUNDS_A_SLICE); 0 where none do."""
    most = int((sms - clusters * cluster_size) * SIDE_ROWS_AN_IDLE_SM)
    side = 0
    for rounds in range(cdiv(M, clusters) - 1, SIDE_ROUNDS_A_SLICE * cluster_size - 1, -1):
        rest = M - clusters * rounds
        if rest > most:
            break
        side = rest
    return side


def backward_config(N, log, item_size=2, clusters=False):
    cfg = _across_cluster(N, _config(N, BACKWARD_ROWS, LOG_BACKWARD_SPLIT if log else BACKWARD_SPLIT),
                          BACKWARD_CLUSTER_FP32 if item_size == 4 else BACKWARD_CLUSTER, clusters)
    cfg = _part_filled_across_cluster(N, cfg, item_size, clusters, BACKWARD_CLUSTER[0][1])
    own_row = BACKWARD_OWN_ROW_FP32 if item_size == 4 else BACKWARD_OWN_ROW
    for limit, block, warps, per_sm in own_row if cfg["plan"] == "split" and not log else ():
        if N <= limit:
            return {"plan": "own_row", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    return cfg


def _row_shift_config(N, direction, log, *rows):
    """The row-shift plan of `direction` (forward, backward) for rows of N elements of `rows`
    (the tensors a kernel reads and writes) where the rows plan would move them through
    narrower than 16-byte loads and stores (cluster.vector_shift), past ROWS_SHIFT_PAST; else
    None. Its slice (BLOCK) holds the row's whole pieces between boundaries: at most
    N // SHIFT * SHIFT elements."""
    shift = cluster.vector_shift(N, *rows, boundary=ROW_SHIFT_BOUNDARY_BYTES[direction])
    if N <= ROWS_SHIFT_PAST or not shift:
        return None
    block = next_power_of_2(N // shift * shift)
    table = FORWARD_ROW_SHIFT if direction == "forward" else BACKWARD_ROW_SHIFT[log]
    return {"plan": "row_shift", "BLOCK": block, "SHIFT": shift,
            "num_warps": next(warps for limit, warps in table if block <= limit)}


def _launch_row_shift(kernel, M, N, cfg, *tensors, LOG):
    """One row a program of `kernel` (a row-shift kernel) over the rows of `tensors`."""
    launch(kernel, (M,), *tensors, M, N, *(t.stride(0) for t in tensors), LOG=LOG, BLOCK=cfg["BLOCK"],
           SHIFT=cfg["SHIFT"], num_warps=cfg["num_warps"])


def planned_forward(x, y, log):
    """The forward's plan for these tensors: forward_config's, or the row-shift plan where the
    rows plan's lengths have starts no vector width divides."""
    N = x.shape[1]
    cfg = forward_config(N, log, x.element_size(), packs_into_words(N, (x, y)), cluster.available(x.device),
                         _whole_vectors(N, x, y))
    if cfg["plan"] == "rows":
        cfg = _row_shift_config(N, "forward", log, x, y) or cfg
    return cfg


def _whole_vectors(N, *rows):
    """Whether rows of N elements of `rows` are whole 16-byte vectors: N and every row stride
    a multiple of the vector, every tensor starting on one."""
    vec = 16 // rows[0].element_size()
    return N % vec == 0 and all(t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0 for t in rows)


def planned_backward(y, dy, dx, log):
    """The backward's plan for these tensors (as planned_forward; log_softmax's part-filled
    cluster rows too, PART_FILLED_CLUSTER_TILE)."""
    N = y.shape[1]
    cfg = backward_config(N, log, y.element_size(), cluster.available(y.device))
    if cfg["plan"] == "rows" or (log and N < PART_FILLED_CLUSTER_TILE):
        cfg = _row_shift_config(N, "backward", log, y, dy, dx) or cfg
    return cfg


def launch_forward(x, y, log, config=None):
    """y[M, N] = (log_)softmax(x[M, N]) along rows; both have unit column stride."""
    M, N = x.shape
    cfg = config or planned_forward(x, y, log)
    align = row_alignment(N, x.stride(0), y.stride(0))  # the rows, two-pass and split kernels' ALIGN
    if cfg["plan"] == "rows":
        grid = (cdiv(M, cfg["BLOCK_M"]),)
        launch(_forward_rows_kernel, grid, x, y, M, N, x.stride(0), y.stride(0), LOG=log,
               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TAIL=cfg.get("TAIL", 0), EVEN=whole_tiles(M, N, cfg),
               ALIGN=align, num_warps=cfg["num_warps"])
    elif cfg["plan"] == "row_shift":
        _launch_row_shift(_forward_row_shift_kernel, M, N, cfg, x, y, LOG=log)
    elif cfg["plan"] == "packed":
        launch(_forward_packed_kernel, (M,), x, y, N, x.stride(0), y.stride(0), 0, LOG=log,
               BF16=x.dtype == torch.bfloat16, BLOCK=min(cfg["BLOCK"], next_power_of_2(N)),
               num_warps=cfg["num_warps"])
    elif cfg["plan"] == "cluster":
        _launch_cluster_forward(x, y, cfg, log, align)
    elif cfg["plan"] == "two_pass":
        launch(_forward_two_pass_kernel, (M,), x, y, N, x.stride(0), y.stride(0), 0, LOG=log, BLOCK=cfg["BLOCK"],
               ALIGN=align, num_warps=cfg["num_warps"])
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
        launch(
            _forward_split_kernel, grid,
            x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=next_power_of_2(slices), ALIGN=align, num_warps=cfg["num_warps"])


def _launch_cluster_forward(x, y, cfg, log, align):
    """The cluster plan on rows of x, the last side_rows of them (SIDE_ROWS) by the two-pass
    kernel on the SMs the clusters leave idle."""
    M, N = x.shape
    ctas, shift = cluster.window(N, cfg["BLOCK"], x, y)
    args = (x, y, M, N, x.stride(0), y.stride(0), 0, 1)
    kwargs = dict(LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas),
                  PERSISTENT=cfg["PERSISTENT"], LATE_WAIT=cfg.get("LATE_WAIT", False), SHIFT=shift,
                  num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg"))
    side = 0
    if cfg.get("SIDE_ROWS"):
        key = (x.device.index, x.dtype, y.dtype, log, cfg["BLOCK"], ctas, shift)
        fit = _CLUSTERS_FIT.get(key)
        if fit is None:  # the occupancy query's clusters and the SMs, once (host time: ~20 us a call)
            clusters = cluster.clusters_for(_forward_cluster_kernel, 2**31, ctas, *args, **kwargs)
            fit = _CLUSTERS_FIT[key] = (clusters, multiprocessors(x.device.index))
        side = side_rows(M, min(fit[0], M), ctas, fit[1])
    cluster.launch(_forward_cluster_kernel, M - side, ctas, x, y, M - side, *args[3:], **kwargs)
    if side:
        launch(_forward_two_pass_kernel, (side,), x, y, N, x.stride(0), y.stride(0), M - side, LOG=log, ALIGN=align,
               AFTER_CLUSTERS=True, launch_pdl=True, **SIDE_ROWS)


_CLUSTERS_FIT = {}  # (device, dtypes, log, slice, CTAs, shift) -> (clusters that fit, SMs)


def launch_backward(y, dy, dx, log, config=None):
    """dx[M, N] from y and dy along rows; all three have unit column stride."""
    M, N = y.shape
    cfg = config or planned_backward(y, dy, dx, log)
    align = row_alignment(N, y.stride(0), dy.stride(0), dx.stride(0))  # the rows, own-row and split kernels' ALIGN
    if cfg["plan"] == "rows":
        grid = (cdiv(M, cfg["BLOCK_M"]),)
        launch(_backward_rows_kernel, grid, y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0), LOG=log,
               BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], ALIGN=align, num_warps=cfg["num_warps"])
    elif cfg["plan"] == "row_shift":
        _launch_row_shift(_backward_row_shift_kernel, M, N, cfg, y, dy, dx, LOG=log)
    elif cfg["plan"] == "cluster":
        ctas, shift = cluster.window(N, cfg["BLOCK"], y, dy, dx)
        cluster.launch(_backward_cluster_kernel, M, ctas, y, dy, dx, M, N, y.stride(0), dy.stride(0), dx.stride(0),
                       0, 1, LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=next_power_of_2(ctas),
                       PERSISTENT=cfg["PERSISTENT"], SHIFT=shift, num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg"))
    elif cfg["plan"] == "own_row":
        block, slices, grid, slots = split.own_row_plan(M, N, cfg, y.device)
        launch(_backward_own_row_kernel, grid, y, dy, dx, slots, M, N, y.stride(0), dy.stride(0), dx.stride(0),
               slices, LOG=log, BLOCK=block, SLICES_POW2=next_power_of_2(slices), ALIGN=align,
               num_warps=cfg["num_warps"])
    else:
        slices, lag, grid, slots = split.split_plan(M, N, cfg, y.device)
        launch(
            _backward_split_kernel, grid,
            y, dy, dx, slots, M, N, y.stride(0), dy.stride(0), dx.stride(0), slices, lag, LOG=log,
            BLOCK=cfg["BLOCK"], SLICES_POW2=next_power_of_2(slices), ALIGN=align, num_warps=cfg["num_warps"])


# --------------------------------------------------------------- tensor-level functions


def _kernels_take(*dtypes):
    return all(d in KERNEL_DTYPES for d in dtypes)


def _forward(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    y = empty_like_rows(x, dim, out_dtype)
    if not (runs_kernels(x) and _kernels_take(x.dtype, out_dtype)):
        return y.copy_(reference.softmax_forward(x, dim, log, out_dtype))
    if x.numel() > 0:
        launch_forward(as_rows(x, dim), as_rows(y, dim), log)
    return y


def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool, in_dtype: torch.dtype) -> torch.Tensor:
    dx = empty_like_rows(y, dim, in_dtype)
    if not (runs_kernels(y) and _kernels_take(y.dtype, in_dtype)):
        return dx.copy_(reference.softmax_backward(y, dy, dim, log, in_dtype))
    if y.numel() > 0:
        launch_backward(as_rows(y, dim), as_rows(dy.to(y.dtype), dim), as_rows(dx, dim), log)
    return dx


# ------------------------------------------------------------- autograd and torch.library
# Eager calls take a plain autograd.Function: torch.library's custom-op dispatch costs about
# 70 us of host time a call, more than the
# kernel itself at some sizes. Under torch.compile the same functions are reached as custom
# ops with fake implementations: one graph node each, no graph break.


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, log, out_dtype):
        y = _forward(x, dim, log, out_dtype)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return no_second_derivative((_backward(y, dy, ctx.dim, ctx.log, ctx.in_dtype), None, None, None), y, dy)


_forward_op = torch.library.custom_op("pintail::softmax_forward", _forward, mutates_args=())
_backward_op = torch.library.custom_op("pintail::softmax_backward", _backward, mutates_args=())


@_forward_op.register_fake
def _softmax_forward_fake(x, dim, log, out_dtype):
    """x's shape in out_dtype, each row along dim contiguous (empty_like_rows), on every path."""
    return empty_like_rows(x, dim, out_dtype)


@_backward_op.register_fake
def _softmax_backward_fake(y, dy, dim, log, in_dtype):
    """y's shape in in_dtype, each row along dim contiguous (empty_like_rows)."""
    return empty_like_rows(y, dim, in_dtype)


def _setup_context(ctx, inputs, output):
    x, dim, log, _ = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.log, ctx.in_dtype = dim, log, x.dtype


def _backward_of_op(ctx, dy):
    (y,) = ctx.saved_tensors
    return _backward_op(y, dy, ctx.dim, ctx.log, ctx.in_dtype), None, None, None


_forward_op.register_autograd(_backward_of_op, setup_context=_setup_context)


def _softmax(x, dim, log, out_dtype):
    if torch.compiler.is_compiling():
        return _forward_op(x, dim, log, out_dtype)
    return _Softmax.apply(x, dim, log, out_dtype)


# ------------------------------------------------------------------------ public API


def _checked(name, input, dim, dtype):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"pintail.{name}: input must be a torch.Tensor, got {type(input).__name__}")
    if dim is None:
        raise TypeError(f"pintail.{name}: dim must be an int, got None (implicit dim choice is "
                        "deprecated in torch; pass dim explicitly)")
    dim = canonical_dim(int(dim), input.dim())
    if dtype is not None:
        if not dtype.is_floating_point:
            raise TypeError(f"pintail.{name}: dtype must be a floating point dtype, got {dtype}")
        if not input.dtype.is_floating_point:
            input = input.to(dtype)  # torch casts first, then computes in dtype
    elif not input.dtype.is_floating_point:
        raise NotImplementedError(
            f"pintail.{name}: input has dtype {input.dtype}, expected a floating point dtype "
            f"(or pass dtype=torch.float32 to compute in float, as torch does)")
    return input, dim, dtype or input.dtype


def softmax(input, dim=-1, dtype=None):
    """torch.nn.functional.softmax(input, dim, dtype=dtype), with Triton kernels on CUDA."""
    input, dim, out_dtype = _checked("softmax", input, dim, dtype)
    return _softmax(input, dim, False, out_dtype)


def log_softmax(input, dim=-1, dtype=None):
    """torch.nn.functional.log_softmax(input, dim, dtype=dtype), with Triton kernels on CUDA."""
    input, dim, out_dtype = _checked("log_softmax", input, dim, dtype)
    return _softmax(input, dim, True, out_dtype)
