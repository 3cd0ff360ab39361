"""Softmax's persistent clusters taking their rows from a counter (prepared in session 49).

At 262144 the library's 15 persistent clusters of 8 x 32768 take rows c, c + 15, ... : a
static share. Session 49's timeline (`exp_side_rows_timeline.py`) had their CTAs end over a
spread of 15-25 us of a ~150 us launch, with 33 rows each. Here a cluster's first two rows
are static and each later one is claimed: in round i, rank 0 takes a row from a counter
(an atomic add) and sends it to its peers in the same 16-byte word as its (max, sum), so
every CTA knows the row after next when it issues that row's loads (one row ahead, as the
library). Fast clusters then take more rows. The side rows (SIDE_ROWS) stay static at the
end. Predicted: the ends' spread shrinks to about a round (~4 us), up to +0.02-0.04 at
262144 if the spread is the clusters' speed rather than their start; nothing if the
clusters are held by HBM as a whole. Session 50: tl.atomic_add's form 0.72-0.74 (every
round waits the atomic); AHEAD 0.911-0.924 against the library's 0.898-0.908; the library
form (branch next/claimed-rows) balanced the clusters' ends but did not move the bench.

    python scripts/exp_softmax_claimed_rows.py --inspect   # CPU: sm_90 registers and stack
    python scripts/exp_softmax_claimed_rows.py             # GPU: checked against torch, timed
"""

import importlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

import measure

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
_launch = importlib.import_module("pintail._launch")

BUFFERS = cluster.BUFFERS.value


def words_bytes(size):
    """Shared memory past Triton's: BUFFERS mbarriers and BUFFERS buffers of one 16-byte
    word a CTA (the library's words are 8 bytes)."""
    return BUFFERS * 8 + BUFFERS * 16 * size


@triton.jit
def _claim_async(count_ptr, rank, token):
    """Thread 0 of rank 0 adds 1 to the counter; its old value lands in that thread's register
    (0 in every other thread) whenever the atomic returns: nothing waits for it before its
    first use (the next round's exchange, where lane 0 shuffles it to its warp)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t;\n.reg .pred p;\nmov.u32 $0, 0;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
        "setp.eq.and.u32 p, $2, 0, p;\n@p atom.global.relaxed.gpu.add.u32 $0, [$1], 1;\n}",
        "=r,l,r,r", [count_ptr, rank, token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _exchange_with_claim(WORDS, i, hi, lo, claim, token, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    """cluster.exchange with a third value: (hi, lo, claim bits) to every peer as one 16-byte
    st.async; returns every CTA's (hi, lo, claim), padding (-inf, 0, -1). Each warp's lanes send
    their lane 0's claim (the same value but from `_claim_async`, where only lane 0 has it)."""
    bar = WORDS + (i % 4) * 8 + token * 0
    words = WORDS + 4 * 8 + (i % 4) * (CLUSTER * 16)
    rank = tl.program_id(0) % CLUSTER
    token = cluster.arrive_expecting(bar, CLUSTER * 16, token)
    token = tl.inline_asm_elementwise(
        "{\n.reg .b32 t, s, b, c;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.lt.u32 p, t, $6;\n"
        "shfl.sync.idx.b32 c, $5, 0, 0x1f, -1;\n"
        "mov.u32 s, global_smem;\nadd.u32 s, s, $1;\nmov.u32 b, global_smem;\nadd.u32 b, b, $2;\n"
        "@p mapa.shared::cluster.u32 s, s, t;\n@p mapa.shared::cluster.u32 b, b, t;\n"
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [s], {$3, $4, c, c}, [b];\n"
        "mov.b32 $0, $7;\n}",
        "=r,r,r,r,r,r,r,r", [words + rank * 16 + token * 0, bar, hi.to(tl.int32, bitcast=True),
                             lo.to(tl.int32, bitcast=True), claim, CLUSTER, token],
        dtype=tl.int32, is_pure=False, pack=1)
    token = cluster.wait_phase(bar, (i // 4) % 2, token)
    peers = tl.arange(0, CLUSTER_POW2)
    his, los, claims = tl.inline_asm_elementwise(
        "{\n.reg .b32 a, pad;\nmov.u32 a, global_smem;\nadd.u32 a, a, $3;\n"
        "ld.shared.v4.b32 {$0, $1, $2, pad}, [a];\n}",
        "=r,=r,=r,r", [words + tl.minimum(peers, CLUSTER - 1) * 16 + token * 0],
        dtype=(tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
    real = peers < CLUSTER
    return (tl.where(real, his.to(tl.float32, bitcast=True), -float("inf")),
            tl.where(real, los.to(tl.float32, bitcast=True), 0.0), tl.where(real, claims, -1), token)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _claimed_rows_kernel(x_ptr, y_ptr, count_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS,
                         LOG: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                         AHEAD: tl.constexpr = False):
    # the library's persistent forward (whole 16-byte rows only: no SHIFT), rows 2 rounds on
    # taken from count_ptr (zeroed) by rank 0 and traded with the round's (max, sum). AHEAD:
    # the atomic is issued a round before its claim is sent (`_claim_async`), so its latency
    # is not in the round; else tl.atomic_add, which every thread waits for at once.
    gdc_launch_dependents()
    rank, row, clusters, token = cluster.start(WORDS, CLUSTER)
    next_row = row + clusters
    x_next, _ = sm._load_slice(x_ptr, row, M, N, x_row_stride, rank, BLOCK, 0, CLUSTER)
    taken_ahead = _claim_async(count_ptr, rank, token) if AHEAD else 0
    i = 0
    while row < M:  # the same row in every CTA of the cluster: they leave together
        x = sm._widened(x_next)
        x_next, _ = sm._load_slice(x_ptr, next_row, M, N, x_row_stride, rank, BLOCK, 0, CLUSTER)
        if AHEAD:
            claim = taken_ahead  # the counter's old value in thread 0 of rank 0, else 0
            taken_ahead = _claim_async(count_ptr, rank, token)
        else:
            taken = tl.atomic_add(count_ptr, 1, mask=rank == 0, sem="relaxed")
            claim = tl.where(rank == 0, taken, 0)
        slice_max = tl.max(x, axis=0)
        shift2 = tl.where(slice_max == -float("inf"), 0.0, sm._log2_units(slice_max))
        e = sm._exp2_shifted(x, shift2)
        maxes, sums, claims, token = _exchange_with_claim(WORDS, i, slice_max, tl.sum(e, axis=0), claim, token,
                                                          CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)
        row_max2 = sm._log2_units(row_max)
        log2_total = tl.log2(tl.sum(sums * tl.exp2(sm._log2_units(maxes) - row_max2), axis=0))
        if LOG:
            log2_total -= sm._log2_units_rounding(row_max, row_max2)
            y = (x - row_max) - log2_total * sm.LN2
        else:
            empty = (slice_max == -float("inf")) & (row_max != -float("inf"))
            y = e * tl.where(empty, 0.0, tl.exp2(shift2 - row_max2 - log2_total))
        sm._store_slice(y_ptr, y, y, row, M, N, x_row_stride, y_row_stride, rank, BLOCK, 0, CLUSTER)
        row, next_row = next_row, 2 * clusters + tl.max(claims, axis=0)
        i += 1


def claimed_forward(x, log, side, ahead):
    """(log_)softmax of x (rows of 262144, 16-byte whole rows): the claimed-rows clusters on
    the first M - side rows, the library's two-pass kernel by PDL on the rest."""
    M, N = x.shape
    y = torch.empty_like(x)
    count = torch.zeros(1, dtype=torch.int32, device=x.device)
    block, ctas = 32768, triton.cdiv(N, 32768)
    library_words = cluster.words_bytes
    cluster.words_bytes = words_bytes  # read when the kernel is first prepared
    try:
        cluster.launch(_claimed_rows_kernel, M - side, ctas, x, y, count, M - side, N, x.stride(0), y.stride(0), 0, 1,
                       LOG=log, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), AHEAD=ahead,
                       num_warps=16)
    finally:
        cluster.words_bytes = library_words
    if side:
        _launch.launch(sm._forward_two_pass_kernel, (side,), x, y, N, x.stride(0), y.stride(0), M - side, LOG=log,
                       ALIGN=_launch.row_alignment(N, x.stride(0), y.stride(0)), AFTER_CLUSTERS=True,
                       launch_pdl=True, **sm.SIDE_ROWS)
    return y


def inspect():
    import inspect_kernel as ik
    ik.INT_POINTERS["count_ptr"] = "*i32"
    for log in (False, True):
        for ahead in (False, True):
            ik.inspect(_claimed_rows_kernel, ik.signature(_claimed_rows_kernel),
                       {"LOG": log, "BLOCK": 32768, "CLUSTER": 8, "CLUSTER_POW2": 8, "AHEAD": ahead}, 16)
        ik.inspect(sm._forward_cluster_kernel, ik.signature(sm._forward_cluster_kernel),
                   {"LOG": log, "BLOCK": 32768, "CLUSTER": 8, "CLUSTER_POW2": 8, "PERSISTENT": True}, 16)


def forms_of(N, x):
    return ([(f"claimed rows + {k} side rows", lambda log, k=k: claimed_forward(x, log, k, False)) for k in (0, 17)]
            + [(f"claimed ahead + {k} side rows", lambda log, k=k: claimed_forward(x, log, k, True))
               for k in (0, 12, 17, 24, 30)])


if __name__ == "__main__":
    measure.experiment(lambda device: None, inspect, lambda: measure.softmax_forms(forms_of, sizes=(262144,)))
