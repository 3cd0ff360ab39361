"""The norms across a thread-block cluster (pintail/_cluster.py), prepared in session 15 for
a later device call: softmax's backward at 131072 went 0.84 -> 0.94 of copy that way.

- RMSNorm / LayerNorm backward past 8192 (library 0.53-0.64, bar 0.85): CTA `rank` of a
  cluster holds slice `rank` of a row's x and dy, trades the slice's sum(g) and sum(g * x^)
  (g = dy * weight) with its peers, writes its slice of dx, and sums dy * x^ (and dy) for its
  columns over the rows of its cluster: one float32 partial row per cluster for the
  library's _sum_partials_kernel.
- RMSNorm forward past 32768 (library 0.79-0.80, bar 0.90): the slice's sum of squares
  traded, y written from the registers, rstd stored by rank 0.
- LayerNorm forward past 32768 (library 0.73, bar 0.90): exact two-pass statistics from the
  registers, two exchanges a row (the sums, then the squared deviations from the mean).

Session 16 measured these (docs/perf-notes.md) and added AHEAD: each kernel issues the loads
of its next row's slice before this row's reductions and exchange, as softmax's cluster
kernels do since (their backward at 262144: 0.78 -> 0.97).

    python scripts/exp_norm_cluster.py [--ahead 0,1] [--sizes ...]  # GPU: each form checked, then timed
    python scripts/exp_norm_cluster.py --inspect  # CPU: registers (ptxas for sm_90)
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")
cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")


@triton.jit
def _slice(ptr, row, row_stride, cols, col_mask, M):
    # a CTA's slice of `row` as loaded (zeros past the last row and column)
    return tl.load(ptr + row * row_stride + cols, mask=col_mask & (row < M), other=0.0)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _backward_cluster_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                             x_row_stride, dy_row_stride, dx_row_stride, weight_offset, WORDS, ROUNDS,
                             RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                             CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, HOLD_WEIGHT: tl.constexpr,
                             AHEAD: tl.constexpr):
    # HOLD_WEIGHT: the weight's slice in registers for all rows, else re-read each row (L1 / L2);
    # AHEAD: the next row's x and dy loaded before this row's exchange
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    if AHEAD:
        x_next = _slice(x_ptr, first_row.to(tl.int64), x_row_stride, cols, col_mask, M)
        dy_next = _slice(dy_ptr, first_row.to(tl.int64), dy_row_stride, cols, col_mask, M)
    if HOLD_WEIGHT:
        w_held = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    real = tl.arange(0, CLUSTER_POW2) < CLUSTER  # exchange pads its first values with -inf
    for i in range(0, ROUNDS):
        row = first_row + i * clusters  # rows past M join the exchange with zeros
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        if AHEAD:
            x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)
            x_next = _slice(x_ptr, row64 + clusters, x_row_stride, cols, col_mask, M)
            dy_next = _slice(dy_ptr, row64 + clusters, dy_row_stride, cols, col_mask, M)
        else:
            x = _slice(x_ptr, row64, x_row_stride, cols, col_mask, M).to(tl.float32)
            dy = _slice(dy_ptr, row64, dy_row_stride, cols, col_mask, M).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
        if HOLD_WEIGHT:
            w_eff = w_held
        else:
            w_eff = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        if RMS:
            x_hat = x * rstd
        else:
            x_hat = tl.where(mask, x - tl.load(mean_ptr + row, mask=in_rows, other=0.0), 0.0) * rstd
        g = dy * w_eff
        sums_g, sums_gx, token = cluster.exchange(WORDS, i, tl.sum(g, axis=0), tl.sum(g * x_hat, axis=0), token,
                                                  CLUSTER, CLUSTER_POW2)
        sum_gx = tl.sum(sums_gx, axis=0)
        if RMS:
            dx = (g - x_hat * (sum_gx * inv_n)) * rstd
        else:
            sum_g = tl.sum(tl.where(real, sums_g, 0.0), axis=0)
            dx = (g - x_hat * (sum_gx * inv_n) - sum_g * inv_n) * rstd
        tl.store(dx_ptr + row64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    part = first_row.to(tl.int64) * N + cols
    tl.store(dw_ptr + part, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + part, db, mask=col_mask)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _rms_forward_cluster_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, inv_n, eps, x_row_stride, y_row_stride,
                                weight_offset, WORDS, ROUNDS, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                                CLUSTER_POW2: tl.constexpr, HOLD_WEIGHT: tl.constexpr, AHEAD: tl.constexpr,
                                PERSISTENT: tl.constexpr):
    # PERSISTENT (read by cluster.launch): False gives a grid of M clusters, one round each
    # (one row a cluster, as softmax's forward since session 17; then AHEAD must be False)
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    if HOLD_WEIGHT:
        w_held = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    if AHEAD:
        x_next = _slice(x_ptr, first_row.to(tl.int64), x_row_stride, cols, col_mask, M)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        if AHEAD:
            x, x_next = x_next.to(tl.float32), _slice(x_ptr, row64 + clusters, x_row_stride, cols, col_mask, M)
        else:
            x = _slice(x_ptr, row64, x_row_stride, cols, col_mask, M).to(tl.float32)
        _, squares, token = cluster.exchange(WORDS, i, tl.full((), 0.0, tl.float32), tl.sum(x * x, axis=0), token,
                                             CLUSTER, CLUSTER_POW2)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) * inv_n + eps)
        if HOLD_WEIGHT:
            w_eff = w_held
        else:  # loaded after the exchange: its registers are not live across it
            w_eff = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        tl.store(y_ptr + row64 * y_row_stride + cols, (x * rstd * w_eff).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd, mask=in_rows & (rank == 0))


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _layer_forward_cluster_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, inv_n, eps, x_row_stride,
                                  y_row_stride, weight_offset, WORDS, ROUNDS, BLOCK: tl.constexpr,
                                  CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, AHEAD: tl.constexpr,
                                  PERSISTENT: tl.constexpr):
    # Exact two-pass statistics across the cluster: two exchanges a row (exchange 2i: the
    # slices' sums, for the mean; 2i + 1: their squared deviations from it), from registers.
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    real = tl.arange(0, CLUSTER_POW2) < CLUSTER  # exchange pads its first values with -inf
    if AHEAD:
        x_next = _slice(x_ptr, first_row.to(tl.int64), x_row_stride, cols, col_mask, M)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        if AHEAD:
            x, x_next = x_next.to(tl.float32), _slice(x_ptr, row64 + clusters, x_row_stride, cols, col_mask, M)
        else:
            x = _slice(x_ptr, row64, x_row_stride, cols, col_mask, M).to(tl.float32)
        sums, _, token = cluster.exchange(WORDS, 2 * i, tl.sum(x, axis=0), tl.full((), 0.0, tl.float32), token,
                                          CLUSTER, CLUSTER_POW2)
        mean = tl.sum(tl.where(real, sums, 0.0), axis=0) * inv_n
        d = tl.where(mask, x - mean, 0.0)
        _, squares, token = cluster.exchange(WORDS, 2 * i + 1, tl.full((), 0.0, tl.float32), tl.sum(d * d, axis=0),
                                             token, CLUSTER, CLUSTER_POW2)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) * inv_n + eps)
        w_eff = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        bias = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row64 * y_row_stride + cols, (d * rstd * w_eff + bias).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean, mask=in_rows & (rank == 0))
        tl.store(rstd_ptr + row, rstd, mask=in_rows & (rank == 0))


def layer_cluster_forward(x, w, b, block, warps, ahead=False, eps=1e-5, persistent=True, maxnreg=None):
    M, N = x.shape
    ctas = triton.cdiv(N, block)
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    cluster.launch(_layer_forward_cluster_kernel, M, ctas, x, w, b, y, mean, rstd, M, N, 1.0 / N, eps, x.stride(0),
                   y.stride(0), 0.0, 0, 1, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas),
                   AHEAD=ahead, PERSISTENT=persistent, num_warps=warps, maxnreg=maxnreg)
    return y, mean, rstd


def _clusters(kernel, args, kw, rows):
    """The clusters cluster.launch ran for these arguments (from the launch cache, after a launch)."""
    _, (_, _, _, fits) = launch_.compiled_for(kernel, args[0].device.index, None, args, kw)
    return min(fits, rows)


def cluster_backward(x, w, bias, dy, mean, rstd, rms, block, warps, parts, db_parts, hold=False, ahead=False):
    M, N = x.shape
    ctas = triton.cdiv(N, block)
    dx = torch.empty_like(x)
    args = (x, w, dy, mean if mean.numel() else rstd, rstd, dx, parts, db_parts, M, N, 1.0 / N, x.stride(0),
            dy.stride(0), dx.stride(0), 0.0, 0, 1)
    kw = dict(RMS=rms, HAS_BIAS=bias is not None, BLOCK=block, CLUSTER=ctas,
              CLUSTER_POW2=triton.next_power_of_2(ctas), HOLD_WEIGHT=hold, AHEAD=ahead, num_warps=warps)
    cluster.launch(_backward_cluster_kernel, M, ctas, *args, **kw)
    used = _clusters(_backward_cluster_kernel, args, kw, M)
    dw, db = norm._sum_partials(parts[:used], db_parts[:used] if bias is not None else None, torch.float32,
                                torch.float32)
    return dx, dw, db


def rms_cluster_forward(x, w, block, warps, hold=False, ahead=False, eps=1e-5, persistent=True, maxnreg=None):
    M, N = x.shape
    ctas = triton.cdiv(N, block)
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    cluster.launch(_rms_forward_cluster_kernel, M, ctas, x, w, y, rstd, M, N, 1.0 / N, eps, x.stride(0), y.stride(0),
                   0.0, 0, 1, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), HOLD_WEIGHT=hold,
                   AHEAD=ahead, PERSISTENT=persistent, num_warps=warps, maxnreg=maxnreg)
    return y, rstd


# (slice, warps) of each form; session 16 dropped the weight-held forms (they lost but at
# 4096 / 8 warps, where 2048 / 4 warps did better still) and the backward's 16384 / 16 warps
# (it spills: 80-592 bytes of stack). Registers on the CPU machine (sm_90), without / with
# AHEAD: backward RMSNorm 2048 / 4 warps 88 / 107 (5 / 4 CTAs an SM), 4096 / 8 108 / 103,
# 8192 / 16 108 / 105; LayerNorm 116-117 / 128; RMSNorm forward 8192 / 8 62 / 105, 16384 / 16
# 80 / 102; LayerNorm forward 8192 / 8 79 / 128, 16384 / 16 64 / 128; 32768 / 16 warps
# spills with AHEAD (264-288 bytes).
BACKWARD_FORMS = ((2048, 4), (4096, 8), (8192, 8), (8192, 16))
RMS_FORWARD_FORMS = ((8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16))
LAYER_FORWARD_FORMS = ((8192, 4), (8192, 8), (16384, 16), (32768, 16))


def inspect():
    ik = importlib.import_module("inspect_kernel")
    sig = {**ik.signature(_backward_cluster_kernel), "WORDS": "i32", "ROUNDS": "i32"}
    for ahead in (False, True):
        for rms in (True, False):
            for block, warps in BACKWARD_FORMS:
                ik.inspect(_backward_cluster_kernel, sig, {"RMS": rms, "HAS_BIAS": not rms, "BLOCK": block,
                                                           "CLUSTER": 16, "CLUSTER_POW2": 16, "HOLD_WEIGHT": False,
                                                           "AHEAD": ahead}, warps)
    sig = {**ik.signature(_rms_forward_cluster_kernel), "WORDS": "i32", "ROUNDS": "i32"}
    for ahead in (False, True):
        for block, warps in RMS_FORWARD_FORMS:
            ik.inspect(_rms_forward_cluster_kernel, sig, {"BLOCK": block, "CLUSTER": 16, "CLUSTER_POW2": 16,
                                                          "HOLD_WEIGHT": False, "AHEAD": ahead, "PERSISTENT": True},
                       warps)
    sig = {**ik.signature(_layer_forward_cluster_kernel), "WORDS": "i32", "ROUNDS": "i32"}
    for ahead in (False, True):
        for block, warps in LAYER_FORWARD_FORMS:
            ik.inspect(_layer_forward_cluster_kernel, sig, {"BLOCK": block, "CLUSTER": 16, "CLUSTER_POW2": 16,
                                                            "AHEAD": ahead, "PERSISTENT": True}, warps)


def close(ours, theirs, what):
    err = (ours.float() - theirs.float()).abs().max().item()
    scale = theirs.float().abs().max().item()
    assert err <= 2e-2 * scale + 1e-6, f"{what}: max error {err:.3g} against {scale:.3g}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--sizes", default="16384,32768,131072,262144")
    p.add_argument("--ahead", default="0,1", help="forms without (0) and with (1) the next row loaded ahead, "
                                                  "and (r, forwards only) one row a cluster, (r80) held to 80 registers")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import copy_bandwidth, print_fraction
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    modes = args.ahead.split(",")

    def measure(label, fn, check, nbytes):
        try:
            check()
        except Exception as e:
            print(f"{label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        print_fraction(label, fn, nbytes, copy_bw)

    def forms(table, N, one_row=True):
        for mode in modes if one_row else [m for m in modes if not m.startswith("r")]:
            label = {"0": "", "1": " ahead", "r": " one row", "r80": " one row maxnreg 80"}[mode]
            for block, warps in table:
                if 2 <= triton.cdiv(N, block) <= 16:
                    yield (dict(ahead=mode == "1", persistent=not mode.startswith("r"),
                                maxnreg=80 if mode == "r80" else None),
                           block, warps, f"{triton.cdiv(N, block)} x {block}/{warps}w{label}")

    for N in map(int, args.sizes.split(",")):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        parts = torch.empty(M, N, dtype=torch.float32, device="cuda")
        db_parts = torch.empty_like(parts)
        for name, rms, bias in (("rms", True, None), ("layer", False, b)):
            _, _, mean, rstd = norm._forward(x, None, w, bias, 1e-5, 0.0, rms, x.dtype)
            library = lambda: norm._backward(dy, None, x, w, bias is not None, mean, rstd, 0.0, rms, x.dtype)
            print_fraction(f"N={N} {name} backward library", library, 3 * M * N * 2, copy_bw)
            want = library()
            for mode, block, warps, form in forms(BACKWARD_FORMS, N, one_row=False):
                fn = lambda: cluster_backward(x, w, bias, dy, mean, rstd, rms, block, warps, parts, db_parts,
                                              ahead=mode["ahead"])
                check = lambda: [close(ours, theirs, what) for ours, theirs, what in zip(fn(), want, ("dx", "dw", "db"))
                                 if theirs is not None]
                measure(f"N={N} {name} backward cluster {form}", fn, check, 3 * M * N * 2)
        if N > 32768:
            print_fraction(f"N={N} rms forward library", lambda: norm._forward(x, None, w, None, 1e-5, 0.0, True, x.dtype),
                           2 * M * N * 2, copy_bw)
            y_want, _, _, rstd_want = norm._forward(x, None, w, None, 1e-5, 0.0, True, x.dtype)
            for mode, block, warps, form in forms(RMS_FORWARD_FORMS, N):
                fn = lambda: rms_cluster_forward(x, w, block, warps, **mode)
                check = lambda: [close(ours, theirs, what) for ours, theirs, what in zip(fn(), (y_want, rstd_want),
                                                                                         ("y", "rstd"))]
                measure(f"N={N} rms forward cluster {form}", fn, check, 2 * M * N * 2)
            print_fraction(f"N={N} layer forward library", lambda: norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype),
                           2 * M * N * 2, copy_bw)
            y_want, _, mean_want, rstd_want = norm._forward(x, None, w, b, 1e-5, 0.0, False, x.dtype)
            for mode, block, warps, form in forms(LAYER_FORWARD_FORMS, N):
                fn = lambda: layer_cluster_forward(x, w, b, block, warps, **mode)
                check = lambda: [close(ours, theirs, what) for ours, theirs, what in
                                 zip(fn(), (y_want, mean_want, rstd_want), ("y", "mean", "rstd"))]
                measure(f"N={N} layer forward cluster {form}", fn, check, 2 * M * N * 2)
        del x, dy, parts, db_parts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
