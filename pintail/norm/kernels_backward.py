"""The norm backward's Triton kernels and the sum of the partial weight / bias rows."""


import triton
import triton.language as tl

from .._core import cluster, split
from .._core.launch import aligned, in_row
from .kernels_forward import _add_pairs, _pair_sums

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
    # reads them twice). Ticket t (an atomic counter, as in pintail/_core/split.py) is slice
    # t % SLICES of the block of ROWS rows t // SLICES. The SLICES programs holding a block
    # meet at each of its rows: each publishes its slice's sum of g x^ (the next row's before
    # it waits for this one's), waits for the other slices' and writes its slice of dx from
    # registers. dweight / dbias of the slice add up over the block's rows in registers: one
    # float32 partial row per block (4 / ROWS bytes per element written and read again).
    # A program takes a new ticket only when its block is done, so a wait can stall only on
    # the newest block, whose missing tickets go to the next programs to finish: no deadlock
    # while SLICES programs can run at once (the host keeps SLICES <= the SMs).
    N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
    dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    end = tl.cdiv(M, ROWS) * SLICES
    ticket = split.take_ticket(slots_ptr)
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
        ticket = split.take_ticket(slots_ptr)


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
    N, x_row_stride, dy_row_stride = aligned(N, ALIGN), aligned(x_row_stride, ALIGN), aligned(dy_row_stride, ALIGN)
    dh_row_stride, dx_row_stride = aligned(dh_row_stride, ALIGN), aligned(dx_row_stride, ALIGN)
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols, col_mask = cluster.slice_columns(rank, N, BLOCK)
    if AHEAD:
        mask = col_mask & (first_row < M)
        x_next = tl.load(x_ptr + first_row.to(tl.int64) * x_row_stride + cols, mask=mask, other=0.0)
        dy_next = tl.load(dy_ptr + first_row.to(tl.int64) * dy_row_stride + cols, mask=mask, other=0.0)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROUNDS):
        row, in_rows, mask, row64 = cluster.round_row(first_row, i, clusters, M, col_mask)
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
