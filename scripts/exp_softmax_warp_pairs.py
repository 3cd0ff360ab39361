"""Softmax forward one row a cluster, each warp's (max, sum) sent to the peers (session 20).

The library's one-row forward (pintail.softmax._forward_cluster_kernel, PERSISTENT False)
reduces its slice twice block-wide (the max, then the sum of exps: 6 bar.syncs) before it
sends one pair to each peer. Here the slice is seen as (REPS, WARPS, 32 * VEC), which is the
load's own layout (VEC elements of 16 bytes a thread, 32 lanes, warps along the middle
axis), so each warp reduces its own part by shuffles alone: its max, its exps against that
max, their sum. Each warp then sends its pair to every peer (lane t to peer t), and each CTA
combines CLUSTER x WARPS pairs: no bar.sync from the loads to the stores. Predicted: the
wait from a CTA's last byte to its send shrinks by the two block reductions, so a CTA holds
its slot for less time with nothing in flight; +0.01-0.02 at 131072 (clusters of 16).
Measured (session 20, kernel alone, bf16; library in the same run): lost. 131072 0.920 at
8192 / 4 warps held to 80 registers (library 0.927), 65536 0.935 (0.928), 32768 0.93-0.95
(0.95), 262144 0.80 (persistent library 0.88); 16384 / 8 warps at 80 spills (0.85 at 131072).
This is quack's reduction, so it is not what quack's 0.94 at 131072 comes from. ptxas puts a
bar.sync after every barrier.cluster.wait, so the late wait still joins the CTA's warps.

    python scripts/exp_softmax_warp_pairs.py --inspect     # CPU: sm_90 registers, spills, bar.syncs
    python scripts/exp_softmax_warp_pairs.py [--sizes N,...]  # GPU: checked against torch, then timed
"""

import argparse
import importlib

import torch
import triton
import triton.language as tl

cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
PAIRS_AT: tl.constexpr = tl.constexpr(16)  # the pairs start 16 bytes past the mbarrier (16-byte loads)

# thread 0 initialises the one mbarrier (one arrival: its expect_tx) at $1 past global_smem
_INIT = tl.constexpr(
    "{\n.reg .b32 t, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
    "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\n@p mbarrier.init.shared::cta.b64 [b], 1;\n"
    "@p fence.mbarrier_init.release.cluster;\nmov.b32 $0, $2;\n}")
# thread 0 expects CLUSTER x WARPS pairs on the mbarrier at $1; lane l < CLUSTER of warp w sends
# its warp's pair ($3, $4) to slot (rank $2) * WARPS + w of peer l, counted on peer l's mbarrier
_SEND = tl.constexpr(
    "{\n.reg .b32 t, l, s, b;\n.reg .pred p, q;\n.reg .b64 r;\nmov.u32 t, %tid.x;\n"
    "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\nsetp.eq.u32 q, t, 0;\n"
    "@q mbarrier.arrive.expect_tx.shared::cta.b64 r, [b], $5;\n"
    "and.b32 l, t, 31;\nsetp.lt.u32 p, l, $6;\nshr.u32 t, t, 5;\nmad.lo.u32 s, $2, $7, t;\n"
    "shl.b32 s, s, 3;\nadd.u32 s, s, b;\nadd.u32 s, s, 16;\n"
    "@p mapa.shared::cluster.u32 s, s, l;\n@p mapa.shared::cluster.u32 b, b, l;\n"
    "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [s], {$3, $4}, [b];\n"
    "mov.b32 $0, $8;\n}")
_WAIT = tl.constexpr(
    "{\n.reg .b32 b;\n.reg .pred p;\nmov.u32 b, global_smem;\nadd.u32 b, b, $1;\nWAIT:\n"
    "mbarrier.try_wait.parity.shared::cta.b64 p, [b], 0;\n@!p bra WAIT;\nmov.b32 $0, $2;\n}")
# a peer's WARPS pairs (max, sum, max, sum, ...) from $(2 WARPS) past global_smem
_READ4 = tl.constexpr(
    "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $8;\n"
    "ld.shared.v4.f32 {$0, $1, $2, $3}, [a];\nld.shared.v4.f32 {$4, $5, $6, $7}, [a+16];\n}")
_READ8 = tl.constexpr(
    "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $16;\n"
    + "".join(f"ld.shared.v4.f32 {{${4 * k}, ${4 * k + 1}, ${4 * k + 2}, ${4 * k + 3}}}, [a+{16 * k}];\n"
                    for k in range(4)) + "}")


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_warp_pairs_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG: tl.constexpr,
                               BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                               WARPS: tl.constexpr, VEC: tl.constexpr, LATE_WAIT: tl.constexpr):
    cta = tl.program_id(0)
    # Nothing below needs Triton's shared memory, and without any Triton declares no
    # global_smem for the asm to address: one block reduction at the start (its bar.syncs
    # before any load) makes it allocate some.
    token = tl.sum(tl.zeros([32 * WARPS], tl.int32) + cta, axis=0)
    token = tl.inline_asm_elementwise(_INIT, "=r,r,r", [WORDS, token], dtype=tl.int32, is_pure=False, pack=1)
    token = tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\nmov.b32 $0, $1;", "=r,r", [token],
                                      dtype=tl.int32, is_pure=False, pack=1)
    if not LATE_WAIT:
        token = cluster.wait(token)
    rank, row = cta % CLUSTER, (cta // CLUSTER).to(tl.int64)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    # seen as (REPS, WARPS, 32 * VEC): the load's own layout (VEC contiguous elements a
    # thread, 32 lanes, then the warps), so the reshape moves nothing and the middle axis is
    # the warp's
    REPS: tl.constexpr = BLOCK // (WARPS * 32 * VEC)
    x = tl.reshape(x, (REPS, WARPS, 32 * VEC))
    warp_max = tl.max(tl.max(x, axis=0), axis=1)  # (WARPS,): registers, then shuffles
    shift = tl.where(warp_max == -float("inf"), 0.0, warp_max)
    e = tl.exp2((x - shift[None, :, None]) * LOG2E)
    warp_sum = tl.sum(tl.sum(e, axis=0), axis=1)
    if LATE_WAIT:  # behind the warp's sum: the peers start while the slice loads
        token = cluster.wait(token + (warp_sum != warp_sum).to(tl.int32))
    token = tl.inline_asm_elementwise(_SEND, "=r,r,r,f,f,r,r,r,r",
                                      [WORDS, rank, warp_max, warp_sum, CLUSTER * WARPS * 8, CLUSTER, WARPS, token],
                                      dtype=tl.int32, is_pure=False, pack=1)
    token = tl.inline_asm_elementwise(_WAIT, "=r,r,r", [WORDS, token], dtype=tl.int32, is_pure=False, pack=1)
    peers = tl.arange(0, CLUSTER_POW2)
    # no token into the reads: a (WARPS,) token would need a reduction across warps, and the
    # asm statements (not pure) keep their order anyway
    at = WORDS + PAIRS_AT + tl.minimum(peers, CLUSTER - 1) * (WARPS * 8)
    if WARPS == 4:
        m0, s0, m1, s1, m2, s2, m3, s3 = tl.inline_asm_elementwise(
            _READ4, "=f,=f,=f,=f,=f,=f,=f,=f,r", [at], dtype=(tl.float32,) * 8, is_pure=False, pack=1)
        maxes = tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3))
    else:
        m0, s0, m1, s1, m2, s2, m3, s3, m4, s4, m5, s5, m6, s6, m7, s7 = tl.inline_asm_elementwise(
            _READ8, "=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,=f,r", [at], dtype=(tl.float32,) * 16,
            is_pure=False, pack=1)
        maxes = tl.maximum(tl.maximum(tl.maximum(m0, m1), tl.maximum(m2, m3)),
                           tl.maximum(tl.maximum(m4, m5), tl.maximum(m6, m7)))
    row_max = tl.max(tl.where(peers < CLUSTER, maxes, -float("inf")), axis=0)  # -inf: a row of -inf, NaN as torch
    sums = (s0 * tl.exp2((m0 - row_max) * LOG2E) + s1 * tl.exp2((m1 - row_max) * LOG2E)
            + s2 * tl.exp2((m2 - row_max) * LOG2E) + s3 * tl.exp2((m3 - row_max) * LOG2E))
    if WARPS == 8:
        sums += (s4 * tl.exp2((m4 - row_max) * LOG2E) + s5 * tl.exp2((m5 - row_max) * LOG2E)
                 + s6 * tl.exp2((m6 - row_max) * LOG2E) + s7 * tl.exp2((m7 - row_max) * LOG2E))
    log2_total = tl.log2(tl.sum(tl.where(peers < CLUSTER, sums, 0.0), axis=0))
    if LOG:
        y = (x - row_max) - log2_total * LN2
    else:  # a warp of -inf has exps 0 and scale 0 (not 0 x inf where the row's max is very negative)
        scale = tl.where(warp_max == -float("inf"), 0.0, tl.exp2((shift - row_max) * LOG2E - log2_total))
        y = e * scale[None, :, None]
    y = tl.reshape(y, (BLOCK,))
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def warp_pairs_forward(x, block, warps, log=False, late_wait=True, maxnreg=None):
    """y from the warp-pairs kernel on a grid of one cluster a row."""
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    args = (x, y, M, N, x.stride(0), y.stride(0), 0, 1)
    kw = dict(LOG=log, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), WARPS=warps,
              VEC=16 // x.element_size(), LATE_WAIT=late_wait, num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg

    def prepare(compiled):
        words = -(-compiled.metadata.shared // 16) * 16
        shared = words + 16 + ctas * warps * 8
        fits = cluster._clusters_that_fit(compiled.function, compiled.metadata.num_warps, ctas, shared)
        return compiled, words, (compiled.metadata.num_warps, ctas, shared), fits

    bound, (compiled, words, packed, _) = launch_.compiled_for(_forward_warp_pairs_kernel, x.device.index,
                                                               (ctas,), args, kw, prepare)
    bound["WORDS"] = words
    compiled.run(M, 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, packed,
                 None, None, None, *bound.values())
    return y


def inspect():
    """Registers, spills and bar.syncs for sm_90 (CPU machine)."""
    ik = importlib.import_module("inspect_kernel")
    sig = {**ik.signature(_forward_warp_pairs_kernel), "WORDS": "i32", "ROUNDS": "i32"}
    for block, warps, cl, r in ((8192, 4, 16, 80), (8192, 4, 16, None), (8192, 8, 16, None), (16384, 8, 16, 80)):
        for log in (False, True):
            const = {"LOG": log, "BLOCK": block, "CLUSTER": cl, "CLUSTER_POW2": cl, "WARPS": warps, "VEC": 8,
                     "LATE_WAIT": True}
            ik.EXTRA_OPTIONS.clear()
            if r:
                ik.EXTRA_OPTIONS["maxnreg"] = r
            ik.inspect(_forward_warp_pairs_kernel, sig, const, warps)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--sizes", default="32768,65536,131072,262144")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import softmax_forms

    def forms(N, x):
        return [(f"warp-pairs {triton.cdiv(N, block)} x {block}/{warps}w maxnreg {r}{' late' if late else ''}",
                 lambda log, b=block, w=warps, r=r, late=late: warp_pairs_forward(x, b, w, log, late, r))
                for block, warps, r in ((8192, 4, 80), (8192, 4, None), (8192, 8, None), (16384, 8, 80),
                                        (16384, 8, None))
                if 2 <= triton.cdiv(N, block) <= 16 for late in (True, False)]

    softmax_forms(forms, tuple(map(int, args.sizes.split(","))))


if __name__ == "__main__":
    main()
