"""Softmax forward of long bf16 rows across a thread-block cluster, each CTA's slice brought
into shared memory by one 1-D bulk copy (cp.async.bulk, the TMA engine), STAGES rows ahead.

Why: the library's forwards hold their bytes in flight in registers. One row a cluster
(8192 / 4 warps at 80 registers, 6 CTAs an SM) waits for the slowest of 16 slices with no
load in flight, and persistent clusters that load the next row ahead pay 127 registers (4
CTAs an SM); both stop at 0.87-0.92 at 131072-262144. A bulk copy into shared memory costs
no registers and one instruction, so the next rows' bytes stay in flight during this row's
exchange and writes at any occupancy. The slice is read from shared memory as 16-byte words
(ld.shared.v4) and y is written as 16-byte words from registers (st.global.v4).

REREAD: read the slice from shared memory again for y (registers hold nothing across the
exchange; the buffer is refilled after y), else keep the words in registers (the buffer is
refilled right after the slice max). Rows of N = CLUSTER * BLOCK only (no masks): an
experiment, not a plan.

    python scripts/exp_softmax_bulk.py --inspect           # CPU: compiles for sm_90, registers
    python scripts/exp_softmax_bulk.py [--sizes N,...]     # GPU: each form checked, then timed
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

from pintail import _cluster as cluster
from pintail import _launch as launch_
from pintail._launch import pack_pairs, unpack_pairs

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _init_load_barriers(BARS, STAGES: tl.constexpr, token):
    # thread 0 initialises STAGES mbarriers (one arrival a phase: its expect_tx); the
    # cluster sync in cluster.start, after this, orders it before any use
    for s in tl.static_range(STAGES):
        token = tl.inline_asm_elementwise(
            "{\n.reg .b32 t, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
            "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\n@p mbarrier.init.shared::cta.b64 [b], 1;\n"
            "@p fence.mbarrier_init.release.cluster;\nmov.b32 $0, $2;\n}",
            "=r,r,r", [BARS + 8 * s, token], dtype=tl.int32, is_pure=False, pack=1)
    return token


@triton.jit
def _bulk_load(bar, dst, src, nbytes, issue, token, CHUNKS: tl.constexpr):
    # where `issue`: thread 0 expects nbytes on mbarrier `bar`; threads 0..CHUNKS-1 each copy
    # one CHUNKS-th of nbytes from global address src to shared offset dst, counted on `bar`
    # (a copy may land before the expect: the phase waits for both). The proxy fence orders
    # this CTA's earlier generic reads of the buffer before the async proxy's writes.
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t, b, d, n;\n.reg .pred p, q, c;\n.reg .b64 s, a;\nmov.u32 t, %tid.x;\n"
        "setp.ne.u32 q, $5, 0;\nsetp.eq.and.u32 p, t, 0, q;\nsetp.lt.and.u32 c, t, $6, q;\n"
        "div.u32 n, $4, $6;\n"
        "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\nmov.u32 d, global_smem;\nadd.u32 d, d, $2;\n"
        "mad.lo.u32 d, t, n, d;\nmad.wide.u32 a, t, n, $3;\n"
        "@c fence.proxy.async.shared::cta;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 s, [b], $4;\n"
        "@c cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [d], [a], n, [b];\n"
        "mov.b32 $0, $7;\n}",
        "=r,r,r,l,r,r,r,r", [bar, dst, src, nbytes, issue.to(tl.int32), CHUNKS, token], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def _wait_load(bar, parity, wait, token):
    # every thread spins on the mbarrier's phase `parity` (where `wait`)
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 b;\n.reg .pred p, q;\nsetp.eq.u32 q, $3, 0;\n@q bra DONE;\n"
        "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [b], $2;\n@!p bra WAIT;\nDONE:\nmov.b32 $0, $4;\n}",
        "=r,r,r,r,r", [bar, parity, wait.to(tl.int32), token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read_words(offsets):
    # four 32-bit words (eight bf16) from shared offset `offsets`, 16 bytes a read
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $4;\nld.shared.v4.b32 {$0, $1, $2, $3}, [a];\n}",
        "=r,=r,=r,=r,r", [offsets], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def _write_words(addresses, w0, w1, w2, w3, store):
    # four words to global address `addresses` (16 bytes), where `store`
    return tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.u32 p, $6, 0;\n@p st.global.v4.b32 [$1], {$2, $3, $4, $5};\nmov.b32 $0, 0;\n}",
        "=r,l,r,r,r,r,r", [addresses, w0, w1, w2, w3, store.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _eight(w0, w1, w2, w3):
    a0, b0 = unpack_pairs(w0, True)
    a1, b1 = unpack_pairs(w1, True)
    a2, b2 = unpack_pairs(w2, True)
    a3, b3 = unpack_pairs(w3, True)
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def _max8(w0, w1, w2, w3):
    a0, b0, a1, b1, a2, b2, a3, b3 = _eight(w0, w1, w2, w3)
    return tl.max(tl.maximum(tl.maximum(tl.maximum(a0, b0), tl.maximum(a1, b1)),
                             tl.maximum(tl.maximum(a2, b2), tl.maximum(a3, b3))), axis=0)


@triton.jit
def _sum_exp8(w0, w1, w2, w3, shift):
    a0, b0, a1, b1, a2, b2, a3, b3 = _eight(w0, w1, w2, w3)
    e = (tl.exp2((a0 - shift) * LOG2E) + tl.exp2((b0 - shift) * LOG2E) + tl.exp2((a1 - shift) * LOG2E)
         + tl.exp2((b1 - shift) * LOG2E) + tl.exp2((a2 - shift) * LOG2E) + tl.exp2((b2 - shift) * LOG2E)
         + tl.exp2((a3 - shift) * LOG2E) + tl.exp2((b3 - shift) * LOG2E))
    return tl.sum(e, axis=0)


@triton.jit
def _y_word(w, row_max, log2_total):
    a, b = unpack_pairs(w, True)
    return pack_pairs(tl.exp2((a - row_max) * LOG2E - log2_total), tl.exp2((b - row_max) * LOG2E - log2_total), True)


@triton.jit(do_not_specialize=["zero", "WORDS", "ROUNDS"])
def _forward_bulk_kernel(x_addr, y_addr, M, x_row_stride, y_row_stride, zero, WORDS, ROUNDS, BLOCK: tl.constexpr,
                         CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, STAGES: tl.constexpr,
                         REREAD: tl.constexpr, CHUNKS: tl.constexpr):
    # Shared memory past Triton's: the exchange's words (cluster.start / exchange), STAGES
    # load mbarriers, then STAGES buffers of BLOCK bf16 (128-byte aligned).
    BARS = WORDS + cluster.BUFFERS * 8 * (1 + CLUSTER)  # cluster.words_bytes
    BUF0 = (BARS + 8 * STAGES + 127) // 128 * 128
    NBYTES: tl.constexpr = BLOCK * 2
    token = _init_load_barriers(BARS, STAGES, zero)
    rank, first_row, clusters, token = cluster.start(WORDS + token * 0, CLUSTER)
    slice_start = rank.to(tl.int64) * NBYTES
    for k in tl.static_range(STAGES):
        ahead = first_row + k * clusters
        token = _bulk_load(BARS + 8 * k, BUF0 + k * NBYTES,
                           x_addr + ahead.to(tl.int64) * x_row_stride * 2 + slice_start, NBYTES, ahead < M, token, CHUNKS)
    offsets = tl.arange(0, BLOCK // 8) * 16
    for i in range(0, ROUNDS):
        row = first_row + i * clusters  # every CTA runs every round: rows past M join the exchange
        s = i % STAGES
        token = _wait_load(BARS + 8 * s, (i // STAGES) % 2, row < M, token)
        buffer = BUF0 + s * NBYTES
        w0, w1, w2, w3 = _read_words(buffer + offsets + token * 0)
        slice_max = _max8(w0, w1, w2, w3)
        next_row = row + STAGES * clusters
        next_src = x_addr + next_row.to(tl.int64) * x_row_stride * 2 + slice_start
        if not REREAD:  # the words are in registers: refill the buffer now
            token = _bulk_load(BARS + 8 * s, buffer, next_src, NBYTES, next_row < M,
                               token + (slice_max != slice_max).to(tl.int32), CHUNKS)
        shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)  # all -inf: sum 0, not NaN
        # `zero & bits` keeps the compiler from holding the unpacked float32 values
        key = zero & slice_max.to(tl.int32, bitcast=True)
        part = _sum_exp8(w0 ^ key, w1 ^ key, w2 ^ key, w3 ^ key, shift)
        maxes, sums, token = cluster.exchange(WORDS, i, slice_max, part, token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)  # -inf only where the whole row is: then NaN, as torch
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        if REREAD:
            w0, w1, w2, w3 = _read_words(buffer + offsets + token * 0)
        else:
            key = zero & log2_total.to(tl.int32, bitcast=True)
            w0, w1, w2, w3 = w0 ^ key, w1 ^ key, w2 ^ key, w3 ^ key
        done = _write_words(y_addr + row.to(tl.int64) * y_row_stride * 2 + slice_start + offsets,
                            _y_word(w0, row_max, log2_total), _y_word(w1, row_max, log2_total),
                            _y_word(w2, row_max, log2_total), _y_word(w3, row_max, log2_total), row < M)
        if REREAD:  # every thread has read the buffer (the words it wrote came from it)
            tl.debug_barrier()
            token = _bulk_load(BARS + 8 * s, buffer, next_src, NBYTES, next_row < M, token + tl.max(done, axis=0),
                               CHUNKS)


def bulk_forward(x, block, warps, stages, reread, persistent=True, maxnreg=None, chunks=1):
    M, N = x.shape
    ctas = N // block
    assert N == ctas * block and x.stride(1) == 1 and x.dtype == torch.bfloat16 and x.data_ptr() % 16 == 0
    y = torch.empty_like(x)
    args = (x.data_ptr(), y.data_ptr(), M, x.stride(0), y.stride(0), 0, 0, 1)
    kw = dict(BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), STAGES=stages, REREAD=reread,
              CHUNKS=chunks, num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg

    def prepare(compiled):  # cluster.launch's, with the load barriers and buffers past the words
        words = -(-compiled.metadata.shared // 16) * 16
        bars = words + cluster.words_bytes(ctas)
        shared = -(-(bars + 8 * stages) // 128) * 128 + stages * block * 2
        fits = cluster._clusters_that_fit(compiled.function, compiled.metadata.num_warps, ctas, shared)
        return compiled, words, (compiled.metadata.num_warps, ctas, shared), fits

    bound, (compiled, words, packed, fits) = launch_.compiled_for(_forward_bulk_kernel, x.device.index, (ctas,), args,
                                                                  kw, prepare)
    clusters = min(fits, M) if persistent else M
    bound["WORDS"], bound["ROUNDS"] = words, -(-M // clusters)
    compiled.run(clusters, 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, packed, None, None, None,
                 *bound.values())
    return y


def inspect():
    ik = importlib.import_module("inspect_kernel")
    sig = {"x_addr": "i64", "y_addr": "i64", "M": "i32", "x_row_stride": "i32", "y_row_stride": "i32", "zero": "i32",
           "WORDS": "i32", "ROUNDS": "i32", "BLOCK": "constexpr", "CLUSTER": "constexpr", "CLUSTER_POW2": "constexpr",
           "STAGES": "constexpr", "REREAD": "constexpr", "CHUNKS": "constexpr"}
    for block, warps, cluster_, stages, reread in ((8192, 4, 16, 1, False), (8192, 4, 16, 2, True),
                                                   (16384, 8, 16, 2, True), (32768, 16, 8, 1, False)):
        ik.inspect(_forward_bulk_kernel, sig, {"BLOCK": block, "CLUSTER": cluster_, "CLUSTER_POW2": cluster_,
                                               "STAGES": stages, "REREAD": reread, "CHUNKS": 16}, warps)


# (BLOCK, warps, STAGES, REREAD, persistent, maxnreg, CHUNKS) by N; call 2 (session 18) ran
# these with CHUNKS 1: 0.73-0.85 against the library's 0.89-0.94
FORMS = {
    65536: [(8192, 4, 1, False, True, None, c) for c in (1, 8, 32)] + [(8192, 4, 1, False, False, 56, c) for c in (8, 32)],
    131072: [(8192, 4, 1, False, True, None, c) for c in (1, 4, 16, 64)]
    + [(8192, 4, 1, False, False, None, c) for c in (4, 16, 64)] + [(8192, 4, 2, True, True, None, 16)],
    262144: [(16384, 8, 1, False, True, None, c) for c in (1, 16, 64)] + [(16384, 8, 1, False, False, 56, c)
                                                                         for c in (1, 16, 64)],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--sizes", default="65536,131072,262144")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import long_rows, print_fraction
    sm = importlib.import_module("pintail.softmax")
    for N, M, copy_bw in long_rows(lambda device: None, sizes=tuple(map(int, args.sizes.split(",")))):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3
        nbytes = 2 * x.numel() * 2
        print_fraction(f"N={N} library", lambda: sm.softmax(x), nbytes, copy_bw)
        for block, warps, stages, reread, persistent, maxnreg, chunks in FORMS[N]:
            label = (f"N={N} bulk {N // block} x {block}/{warps}w stages {stages}{' reread' if reread else ''}"
                     f"{'' if persistent else ' one row'}{f' maxnreg {maxnreg}' if maxnreg else ''} chunks {chunks}")
            fn = lambda: bulk_forward(x, block, warps, stages, reread, persistent, maxnreg, chunks)  # noqa: E731
            try:
                err = (fn().float() - torch.softmax(x.float(), -1)).abs().max().item()
            except Exception as e:
                print(f"{label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            print_fraction(f"{label} (err {err:.1e})", fn, nbytes, copy_bw)


if __name__ == "__main__":
    main()
