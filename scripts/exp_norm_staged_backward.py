"""Experiment (session 45; lost, perf-notes "Session 45"): the norms' backward across a cluster with the next
DEPTH rows' x and dy staged in shared memory by cp.async, instead of one row ahead in
registers (the library's `_backward_cluster_kernel` with AHEAD).

Why: session 45 found the cluster backward held by the rows in flight, not by the CTA count.
One CTA an SM (16 warps at 106-128 registers), a cluster of 9-16 CTAs fits once a GPC, so a
GPC has one row (and the row ahead) of x and dy in flight however the row is cut; the
fraction follows N (0.48-0.58 at 66560, 0.63 at 98304, 0.76 at 131072, 0.80 at 65536 where
two clusters fit a GPC). Registers cannot hold more rows (slices of 16384 with the row ahead
spill: 0.26); shared memory can: 228 KB an SM against the 32 KB of one row's slice of 8192
(x and dy, bf16). Here each thread copies its own 16-byte chunks of row r + DEPTH into stage
(r + DEPTH) % (DEPTH + 1), waits for its copies of row r (cp.async.wait_group DEPTH), a
bar.sync (so no layout question: any thread may read any chunk), and reads row r's slice
back with 16-byte ld.shared; the rest is the library's kernel (no residual's gradient).

Predicted: 0.75-0.85 at 65537-131072 (RMSNorm 0.56-0.76 now) if rows in flight are the
limit, and slices of 16384 at 262144 (16 CTAs, 64 KB a stage) near 0.75 against the blocks
plan's 0.60; if it reads as the library, the limit is the exchange's round trip a row.
Measured (RMSNorm, kernel alone, bf16): below the library at 131072 (0.64 best against 0.76)
and 262144 (0.55 against the blocks plan's 0.60); at 81920 0.62 (16384 / 16) against 0.55.

    python scripts/exp_norm_staged_backward.py --inspect        # CPU: sm_90 registers, spills
    python scripts/exp_norm_staged_backward.py [--layer] [--sizes 65536,...]   # GPU: checked, then timed
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

from exp_softmax_staged import _READ, _STAGE  # a 16-byte chunk by cp.async into shared memory; one read back
from measure import copy_bandwidth, norm_backward_inputs, record

norm = importlib.import_module("pintail.norm")
cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")

_COMMIT = tl.constexpr("cp.async.commit_group;\nmov.b32 $0, $1;")


@triton.jit
def _stage_row(x_ptr, dy_ptr, row, M, N, x_row_stride, dy_row_stride, slot_at, first, chunks, token,
               BLOCK: tl.constexpr, ELEM: tl.constexpr):
    """Copy this CTA's slice of `row`'s x and dy (zeros past N or M) into the stage at
    `slot_at` (x, then dy), one cp.async a 16-byte chunk, as one commit group."""
    size = tl.where((first < N) & (row < M), 16, 0)
    row64 = tl.minimum(row, M - 1).to(tl.int64)
    tl.inline_asm_elementwise(_STAGE, "=r,r,l,r", [slot_at + chunks * 16, x_ptr + row64 * x_row_stride + first, size],
                              dtype=tl.int32, is_pure=False, pack=1)
    tl.inline_asm_elementwise(_STAGE, "=r,r,l,r", [slot_at + BLOCK * ELEM + chunks * 16,
                                                   dy_ptr + row64 * dy_row_stride + first, size],
                              dtype=tl.int32, is_pure=False, pack=1)
    return tl.inline_asm_elementwise(_COMMIT, "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read(at, anchor, ptr):
    """The chunk at `at` past global_smem, in `ptr`'s element type."""
    return tl.inline_asm_elementwise(_READ, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [at + anchor], dtype=ptr.dtype.element_ty,
                                     is_pure=False, pack=8)


@triton.jit
def _staged_row(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd, row, in_rows, mask, cols, col_mask, zero, at,
                RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, ELEM: tl.constexpr):
    """(dy, x^, g) of the row staged at `at` (x, then dy)."""
    # a load with every lane masked off (`zero` is 0): no bytes move, but the read-back gets
    # the load's layout, VEC contiguous values a thread, so that each asm reads one chunk.
    # Made at each read: held across the loop it would take BLOCK / threads registers.
    anchor = tl.load(x_ptr + cols, mask=cols < zero, other=0).to(tl.int32)
    x = _read(at, anchor, x_ptr).to(tl.float32)
    dy = _read(at + BLOCK * ELEM, anchor, dy_ptr).to(tl.float32)
    if RMS:
        x_hat = x * rstd
    else:
        x_hat = tl.where(mask, x - tl.load(mean_ptr + row, mask=in_rows, other=0.0), 0.0) * rstd
    if HAS_WEIGHT:
        g = dy * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        g = dy
    return dy, x_hat, g


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _backward_staged_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
                            x_row_stride, dy_row_stride, dx_row_stride, zero, STAGES_AT, WORDS, ROUNDS,
                            RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                            DEPTH: tl.constexpr, ELEM: tl.constexpr, REREAD: tl.constexpr):
    STAGES: tl.constexpr = DEPTH + 1
    VEC: tl.constexpr = 16 // ELEM
    STAGE_BYTES: tl.constexpr = 2 * BLOCK * ELEM
    rank, first_row, clusters, token = cluster.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < N
    chunks = tl.arange(0, BLOCK // VEC)
    first = rank * BLOCK + chunks * VEC
    for d in tl.static_range(DEPTH):
        token = _stage_row(x_ptr, dy_ptr, first_row + d * clusters, M, N, x_row_stride, dy_row_stride,
                           STAGES_AT + d * STAGE_BYTES, first, chunks, token, BLOCK, ELEM)
    in_slice = (cols - rank * BLOCK) * ELEM
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters  # every CTA runs every round: rows past M join with zeros
        in_rows = row < M
        mask = col_mask & in_rows
        row64 = row.to(tl.int64)
        token = _stage_row(x_ptr, dy_ptr, row + DEPTH * clusters, M, N, x_row_stride, dy_row_stride,
                           STAGES_AT + ((i + DEPTH) % STAGES) * STAGE_BYTES, first, chunks, token, BLOCK, ELEM)
        # this thread's copies of row i are in once at most DEPTH groups are pending; the
        # bar.sync makes every thread's copies visible to every thread
        if DEPTH == 1:
            token = tl.inline_asm_elementwise("cp.async.wait_group 1;\nmov.b32 $0, $1;", "=r,r", [token],
                                              dtype=tl.int32, is_pure=False, pack=1)
        elif DEPTH == 2:
            token = tl.inline_asm_elementwise("cp.async.wait_group 2;\nmov.b32 $0, $1;", "=r,r", [token],
                                              dtype=tl.int32, is_pure=False, pack=1)
        else:
            token = tl.inline_asm_elementwise("cp.async.wait_group 3;\nmov.b32 $0, $1;", "=r,r", [token],
                                              dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        at = STAGES_AT + (i % STAGES) * STAGE_BYTES + in_slice + token * 0
        rstd = tl.load(rstd_ptr + row, mask=in_rows, other=0.0)
        dy, x_hat, g = _staged_row(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd, row, in_rows, mask, cols, col_mask, zero,
                                   at, RMS, HAS_WEIGHT, BLOCK, ELEM)
        sum_g, sum_gx, token = cluster.exchange_sums(WORDS, i, tl.sum(g, axis=0), tl.sum(g * x_hat, axis=0), token,
                                                     CLUSTER, CLUSTER_POW2)
        if REREAD:  # x and dy again from the stage: no registers hold them across the exchange
            dy, x_hat, g = _staged_row(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd, row, in_rows, mask, cols, col_mask,
                                       zero + token * 0, at + token * 0, RMS, HAS_WEIGHT, BLOCK, ELEM)
        mean_gx = sum_gx * inv_n
        if RMS:
            dx = rstd * (g - x_hat * mean_gx)
        else:
            dx = rstd * (g - sum_g * inv_n - x_hat * mean_gx)
        tl.store(dx_ptr + row64 * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
        # every thread has read stage i before any thread's next copy may land in it (the
        # copy into this stage is issued DEPTH rounds from now, after this barrier)
        tl.debug_barrier()
    # the copies staged past the last row (zero-fills) land before the CTA ends: shared
    # memory may go to the next CTA on the SM
    tl.inline_asm_elementwise("cp.async.wait_all;\nmov.b32 $0, $1;", "=r,r", [token], dtype=tl.int32, is_pure=False,
                              pack=1)
    part = first_row.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(dw_ptr + part, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + part, db, mask=col_mask)


def staged_backward(dy, x, w, b, mean, rstd, rms, cfg):
    """(dx, dweight, dbias) of rows x[M, N] (contiguous, 16-bit, N a multiple of 8); cfg:
    BLOCK, num_warps, DEPTH, REREAD and maybe maxnreg."""
    M, N = x.shape
    block, depth = cfg["BLOCK"], cfg["DEPTH"]
    ctas = triton.cdiv(N, block)
    dx = torch.empty_like(x)
    elem = x.element_size()
    kw = dict(RMS=rms, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None, BLOCK=block, CLUSTER=ctas,
              CLUSTER_POW2=triton.next_power_of_2(ctas), DEPTH=depth, ELEM=elem, REREAD=cfg["REREAD"],
              num_warps=cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}))

    def prepare(compiled):
        words = -(-compiled.metadata.shared // 16) * 16
        stages_at = words + -(-cluster.words_bytes(ctas) // 128) * 128
        shared = stages_at + (depth + 1) * 2 * block * elem
        fits = cluster._clusters_that_fit(compiled.function, compiled.metadata.num_warps, ctas, shared)
        return compiled, (words, stages_at), (compiled.metadata.num_warps, ctas, shared), fits

    def args(dw, db):
        return (x, w if w is not None else x, dy, mean if mean.numel() else rstd, rstd, dx, dw, db, M, N, 1.0 / N,
                x.stride(0), dy.stride(0), dx.stride(0), 0, 0, 0, 1)

    _, (_, _, _, fits) = launch_.compiled_for(_backward_staged_kernel, x.device.index, (ctas,), args(rstd, rstd),
                                              kw, prepare)
    clusters = min(fits, M)
    dw = torch.empty(clusters, N, dtype=torch.float32, device=x.device) if w is not None else None
    db = torch.empty(clusters, N, dtype=torch.float32, device=x.device) if b is not None else None
    bound, (compiled, (words, stages_at), packed, _) = launch_.compiled_for(
        _backward_staged_kernel, x.device.index, (ctas,), args(dw if dw is not None else rstd,
                                                               db if db is not None else rstd), kw, prepare)
    bound["WORDS"], bound["STAGES_AT"], bound["ROUNDS"] = words, stages_at, -(-M // clusters)
    compiled.run(clusters, 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, packed,
                 None, None, None, *bound.values())
    return (dx, *norm._sum_partials(dw, db, x.dtype, x.dtype))


# (slice, warps, rows staged ahead, x and dy re-read after the exchange, register cap):
# 8192 / 16 warps at 64 registers fits two CTAs an SM (two clusters' rows in flight)
CONFIGS = [{"BLOCK": block, "num_warps": warps, "DEPTH": depth, "REREAD": reread, **({"maxnreg": cap} if cap else {})}
           for block, warps, depth, reread, cap in (
               (8192, 16, 1, False, None), (8192, 16, 2, False, None), (8192, 16, 3, False, None),
               (8192, 16, 1, True, None), (8192, 16, 2, True, None), (8192, 16, 1, True, 64), (8192, 16, 2, True, 64),
               (4096, 8, 2, False, None), (4096, 8, 2, True, 128), (16384, 16, 1, True, None),
               (16384, 16, 2, True, None))]


def inspect():
    """Registers, spills and shared memory for sm_90 (CPU machine)."""
    ik = importlib.import_module("inspect_kernel")
    sig = {**ik.signature(_backward_staged_kernel), "WORDS": "i32", "STAGES_AT": "i32", "ROUNDS": "i32",
           "zero": "i32"}
    for rms in (True, False):
        for cfg in CONFIGS:
            const = {"RMS": rms, "HAS_WEIGHT": True, "HAS_BIAS": not rms, "BLOCK": cfg["BLOCK"], "CLUSTER": 16,
                     "CLUSTER_POW2": 16, "DEPTH": cfg["DEPTH"], "ELEM": 2, "REREAD": cfg["REREAD"]}
            ik.EXTRA_OPTIONS.clear()
            if "maxnreg" in cfg:
                ik.EXTRA_OPTIONS["maxnreg"] = cfg["maxnreg"]
            ik.inspect(_backward_staged_kernel, sig, const, cfg["num_warps"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--layer", action="store_true")
    p.add_argument("--sizes", default="65536,81920,98304,131072,262144")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    rms = not args.layer
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    results = []
    for N in map(int, args.sizes.split(",")):
        x, w, b, dy, mean, rstd = norm_backward_inputs(norm, N, rms)
        M = x.shape[0]
        default = norm.backward_config(N, rms, clusters=True)
        library = lambda: norm._backward(dy, None, x, w, b is not None, mean, rstd, 0.0, rms, x.dtype)
        want = library()
        nbytes = 3 * M * N * x.element_size()
        record(results, "bwd", N, default, library, nbytes, copy_bw, default)
        for cfg in CONFIGS:
            if not 2 <= triton.cdiv(N, cfg["BLOCK"]) <= 16:
                continue
            fn = lambda: staged_backward(dy, x, w, b, mean, rstd, rms, cfg)
            label = {"plan": "staged", **cfg}
            try:
                got = fn()
                for g, g_want, name in zip(got, want, ("dx", "dweight", "dbias")):
                    if g is not None and not torch.allclose(g.float(), g_want.float(), rtol=2e-2, atol=2e-2):
                        raise AssertionError(f"{name} off by {(g.float() - g_want.float()).abs().max().item():.3g}")
            except Exception as e:
                print(f"bwd N={N} {label}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            record(results, "bwd", N, label, fn, nbytes, copy_bw, default)
        del x, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
