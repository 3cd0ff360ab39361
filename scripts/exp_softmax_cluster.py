"""Softmax forward past 32768 with thread-block clusters, in Triton 3.6 as it is: the kernel
is compiled for one CTA, launched with a cluster dimension (the launcher's packed metadata
says CLUSTER CTAs per cluster), and the CTAs of a row exchange their (max, sum) through
distributed shared memory with inline PTX (mapa + st.shared::cluster into a few words past
the shared memory Triton allocated, barrier.cluster). The row is read once, its exps stay
in registers, y is written once: one exp an element, no L2 re-read, no waiting on L2.

    python scripts/exp_softmax_cluster.py [--form F] [--sizes N,...]  # GPU: each form checked, then timed
    python scripts/exp_softmax_cluster.py --inspect  # CPU: compiles for sm_90 (ptxas), registers
"""

import argparse
import ctypes
import importlib

import torch
import triton
import triton.language as tl

sm = importlib.import_module("pintail.softmax")
cluster_ = importlib.import_module("pintail._cluster")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _cluster_arrive(token, RELEASE: tl.constexpr):
    # every thread of every CTA of the cluster arrives once; release orders this thread's
    # earlier stores (the remote ones) before the peers' acquire
    if RELEASE:
        return tl.inline_asm_elementwise("barrier.cluster.arrive.release;\nmov.b32 $0, $1;", "=r,r", [token],
                                         dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\nmov.b32 $0, $1;", "=r,r", [token],
                                         dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _cluster_wait(token):
    return tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\nmov.b32 $0, $1;", "=r,r", [token],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_to_peers(offset, peers, hi, lo):
    # (hi, lo) into the word at `offset` of each peer CTA's shared memory
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $1;\nmapa.shared::cluster.u32 a, a, $2;\n"
        "st.shared::cluster.v2.f32 [a], {$3, $4};\nmov.b32 $0, 0;\n}",
        "=r,r,r,f,f", [offset + peers * 0, peers, hi + peers * 0.0, lo + peers * 0.0],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_local(offsets):
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $2;\nld.shared.v2.f32 {$0, $1}, [a];\n}",
        "=f,=f,r", [offsets], dtype=(tl.float32, tl.float32), is_pure=False, pack=1)


@triton.jit(do_not_specialize=["SLOTS"])
def _forward_cluster_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, SLOTS, LOG: tl.constexpr,
                            BLOCK: tl.constexpr, CLUSTER: tl.constexpr):
    cta = tl.program_id(0)
    row = (cta // CLUSTER).to(tl.int64)
    rank = cta % CLUSTER
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
    token = _cluster_arrive(rank, RELEASE=False)  # peers must be running before their shared memory is written
    slice_max = tl.max(x, axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    e = tl.exp2((x - shift) * LOG2E)
    part = tl.sum(e, axis=0)
    token = _cluster_wait(token)
    peers = tl.arange(0, CLUSTER)
    done = _store_to_peers(SLOTS + rank * 8 + token * 0, peers, slice_max, part)
    token = _cluster_arrive(tl.max(done, axis=0), RELEASE=True)
    token = _cluster_wait(token)
    maxes, sums = _load_local(SLOTS + peers * 8 + token * 0)
    row_max = tl.max(maxes, axis=0)
    log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
    if LOG:
        y = (x - row_max) - log2_total * LN2
    else:
        y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit(do_not_specialize=["SLOTS", "ROUNDS"])
def _forward_cluster_rounds_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, SLOTS, ROUNDS, LOG: tl.constexpr,
                                   BLOCK: tl.constexpr, CLUSTER: tl.constexpr, STAGES: tl.constexpr):
    # Persistent clusters: cluster c takes rows c, c + clusters, ...; nothing waits across
    # clusters, so a static order costs no lockstep, and the pipeliner streams the next
    # rows' slices into shared memory (cp.async) while this row's exchange waits. The
    # exchange words alternate between two buffers: a peer can be one row ahead, not two
    # (it cannot pass the next barrier before this CTA has read).
    cta = tl.program_id(0)
    clusters = tl.num_programs(0) // CLUSTER
    cluster = cta // CLUSTER
    rank = cta % CLUSTER
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    peers = tl.arange(0, CLUSTER)
    token = _cluster_wait(_cluster_arrive(rank, RELEASE=False))  # peers running before their memory is written
    for i in tl.range(0, ROUNDS, num_stages=STAGES):
        row = cluster + i * clusters
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (row < M),
                    other=-float("inf")).to(tl.float32)
        slice_max = tl.max(x, axis=0)
        shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
        e = tl.exp2((x - shift) * LOG2E)
        words = SLOTS + (i % 2) * (CLUSTER * 8) + token * 0
        done = _store_to_peers(words + rank * 8, peers, slice_max, tl.sum(e, axis=0))
        token = _cluster_wait(_cluster_arrive(tl.max(done, axis=0), RELEASE=True))
        maxes, sums = _load_local(words + peers * 8 + token * 0)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        if LOG:
            y = (x - row_max) - log2_total * LN2
        else:
            y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty),
                 mask=(cols < N) & (row < M))


def cluster_rounds_forward(x, block, warps, stages, log=False, fill=1.0):
    M, N = x.shape
    cluster = triton.cdiv(N, block)
    y = torch.empty_like(x)
    kw = dict(LOG=log, BLOCK=block, CLUSTER=cluster, STAGES=stages, num_warps=warps)
    key = ("rounds", x.dtype, block, warps, cluster, log, stages)
    if key not in _COMPILED:
        k = _forward_cluster_rounds_kernel.warmup(x, y, M, N, x.stride(0), y.stride(0), 0, 1,
                                                  grid=(cluster,), **kw)
        k = k.result() if hasattr(k, "result") else k
        k._init_handles()
        slots = -(-k.metadata.shared // 16) * 16
        fits = max_active_clusters(k, cluster, slots + 16 * cluster)
        print(f"    {block}/{warps}w/{stages} stages: {k.n_regs} registers, {slots} B shared, {fits} clusters of"
              f" {cluster} fit", flush=True)
        _COMPILED[key] = (k, slots, (k.metadata.num_warps, cluster, slots + 16 * cluster), fits)
    k, slots, packed, fits = _COMPILED[key]
    clusters = max(1, int(fits * fill))
    rounds = triton.cdiv(M, clusters)
    k.run(clusters, 1, 1, torch.cuda.current_stream().cuda_stream, k.function, packed, None, None, None,
          x, y, M, N, x.stride(0), y.stride(0), slots, rounds, log, block, cluster, stages)
    return y


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def max_active_clusters(k, cluster, shared):
    """cuOccupancyMaxActiveClusters: how many clusters of this kernel fit on the GPU at once."""
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), 8, shared) == 0  # max dynamic shared memory
    if cluster > 8:
        assert cuda.cuFuncSetAttribute(ctypes.c_void_p(k.function), 14, 1) == 0  # non-portable size allowed
    attr = _LaunchAttribute(id=4)
    attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
    cfg = _LaunchConfig(shared=shared, attrs=ctypes.pointer(attr), num_attrs=1)
    cfg.grid[0], cfg.grid[1], cfg.grid[2] = cluster, 1, 1
    cfg.block[0], cfg.block[1], cfg.block[2] = 32 * k.metadata.num_warps, 1, 1
    n = ctypes.c_int()
    err = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(k.function), ctypes.byref(cfg))
    assert err == 0, f"cuOccupancyMaxActiveClusters: error {err}"
    return n.value


_COMPILED = {}


# The exchange without fences: each CTA's words arrive by st.async, which counts its bytes
# on the receiver's mbarrier (complete_tx); the receiver expects CLUSTER * 8 bytes a row
# and waits on the barrier's phase. Region past Triton's shared memory: two mbarriers,
# then two buffers of CLUSTER words (rows alternate between them).


@triton.jit
def _init_barriers(base, token):
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
        "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\n"
        "@p mbarrier.init.shared::cta.b64 [b], 1;\n@p mbarrier.init.shared::cta.b64 [b+8], 1;\n"
        "@p fence.mbarrier_init.release.cluster;\nmov.b32 $0, $2;\n}",
        "=r,r,r", [base, token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _send_to_peers(slot, bar, hi, lo, cluster):
    # thread t < cluster sends (hi, lo) to peer t's `slot`, counted on peer t's `bar`
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t, s, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.lt.u32 p, t, $5;\n"
        "mov.u32 s, global_smem;\nadd.u32 s, s, $1;\nmov.u32 b, global_smem;\nadd.u32 b, b, $2;\n"
        "@p mapa.shared::cluster.u32 s, s, t;\n@p mapa.shared::cluster.u32 b, b, t;\n"
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [s], {$3, $4}, [b];\nmov.b32 $0, 0;\n}",
        "=r,r,r,f,f,r", [slot, bar, hi, lo, cluster], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["SLOTS", "ROUNDS"])
def _forward_cluster_mbar_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, SLOTS, ROUNDS, LOG: tl.constexpr,
                                 BLOCK: tl.constexpr, CLUSTER: tl.constexpr, STAGES: tl.constexpr):
    cta = tl.program_id(0)
    clusters = tl.num_programs(0) // CLUSTER
    cluster = cta // CLUSTER
    rank = cta % CLUSTER
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    peers = tl.arange(0, CLUSTER)
    token = _init_barriers(SLOTS, rank)
    token = _cluster_wait(_cluster_arrive(token, RELEASE=True))  # every barrier initialised before any is used
    for i in tl.range(0, ROUNDS, num_stages=STAGES):
        row = cluster + i * clusters
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (row < M),
                    other=-float("inf")).to(tl.float32)
        slice_max = tl.max(x, axis=0)
        shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
        e = tl.exp2((x - shift) * LOG2E)
        bar = SLOTS + (i % 2) * 8 + token * 0
        words = SLOTS + 16 + (i % 2) * (CLUSTER * 8)
        token = cluster_.arrive_expecting(bar, CLUSTER * 8, token)
        token = _send_to_peers(words + rank * 8 + token * 0, bar, slice_max, tl.sum(e, axis=0), CLUSTER)
        token = cluster_.wait_phase(bar, (i // 2) % 2, token)
        maxes, sums = _load_local(words + peers * 8 + token * 0)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        if LOG:
            y = (x - row_max) - log2_total * LN2
        else:
            y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty),
                 mask=(cols < N) & (row < M))


def cluster_mbar_forward(x, block, warps, stages, log=False):
    M, N = x.shape
    cluster = triton.cdiv(N, block)
    y = torch.empty_like(x)
    kw = dict(LOG=log, BLOCK=block, CLUSTER=cluster, STAGES=stages, num_warps=warps)
    key = ("mbar", x.dtype, block, warps, cluster, log, stages)
    if key not in _COMPILED:
        k = _forward_cluster_mbar_kernel.warmup(x, y, M, N, x.stride(0), y.stride(0), 0, 1, grid=(cluster,), **kw)
        k = k.result() if hasattr(k, "result") else k
        k._init_handles()
        slots = -(-k.metadata.shared // 16) * 16
        extra = 16 + 16 * cluster
        fits = max_active_clusters(k, cluster, slots + extra)
        print(f"    mbar {block}/{warps}w/{stages} stages: {k.n_regs} registers, {slots} B shared, {fits} clusters of"
              f" {cluster} fit", flush=True)
        _COMPILED[key] = (k, slots, (k.metadata.num_warps, cluster, slots + extra), fits)
    k, slots, packed, fits = _COMPILED[key]
    rounds = triton.cdiv(M, fits)
    k.run(fits, 1, 1, torch.cuda.current_stream().cuda_stream, k.function, packed, None, None, None,
          x, y, M, N, x.stride(0), y.stride(0), slots, rounds, log, block, cluster, stages)
    return y


launch_ = importlib.import_module("pintail._launch")


@triton.jit
def _packed_softmax_across_cluster(packed, zero, WORDS, i, token, BF16: tl.constexpr, CLUSTER: tl.constexpr,
                                   CLUSTER_POW2: tl.constexpr, WAIT: tl.constexpr = False):
    # softmax of this CTA's slice of row i, held as words of two 16-bit values and unpacked
    # for each pass (`zero & bits` keeps the compiler from holding the float32 values): y's words.
    # WAIT: finish cluster_.start's barrier after the slice's sum (the library's LATE_WAIT)
    low, high = launch_.unpack_pairs(packed, BF16)
    slice_max = tl.max(tl.maximum(low, high), axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    low, high = launch_.unpack_pairs(packed ^ (zero & slice_max.to(tl.int32, bitcast=True)), BF16)
    part = tl.sum(tl.exp2((low - shift) * LOG2E) + tl.exp2((high - shift) * LOG2E), axis=0)
    if WAIT:
        token = cluster_.wait(token + (part != part).to(tl.int32))
    maxes, sums, token = cluster_.exchange(WORDS, i, slice_max, part, token, CLUSTER, CLUSTER_POW2)
    row_max = tl.max(maxes, axis=0)
    log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
    low, high = launch_.unpack_pairs(packed ^ (zero & log2_total.to(tl.int32, bitcast=True)), BF16)
    return sm.packed_output(low, high, row_max, log2_total, False, BF16), token


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_packed_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, zero, WORDS, ROUNDS,
                                   BF16: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                                   CLUSTER_POW2: tl.constexpr, PERSISTENT: tl.constexpr,
                                   LATE_WAIT: tl.constexpr = False):
    # The library's cluster kernel with the slice held as words of two 16-bit values (half
    # the registers: more CTAs an SM), unpacked for each pass (two exps an element).
    # PERSISTENT (read by cluster_.launch): False gives a grid of M clusters, one round each.
    # LATE_WAIT (one row a cluster): the start's wait after the slice is loaded and summed.
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER, WAIT=not LATE_WAIT)
    words = rank * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        mask = (words < N // 2) & (row < M)
        packed = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * (x_row_stride // 2) + words,
                         mask=mask, other=launch_.NEG_INF_BF16_PAIR if BF16 else launch_.NEG_INF_FP16_PAIR)
        y, token = _packed_softmax_across_cluster(packed, zero, WORDS, i, token, BF16, CLUSTER, CLUSTER_POW2,
                                                  LATE_WAIT)  # one round: LATE_WAIT needs a grid of M clusters
        tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * (y_row_stride // 2) + words, y, mask=mask)


def cluster_packed_forward(x, block, warps, persistent=True, maxnreg=None, late_wait=False):
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    cluster_.launch(_forward_cluster_packed_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 0, 1,
                    BF16=x.dtype == torch.bfloat16, BLOCK=block, CLUSTER=ctas,
                    CLUSTER_POW2=triton.next_power_of_2(ctas), PERSISTENT=persistent, LATE_WAIT=late_wait,
                    num_warps=warps, **extra)
    return y


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_packed_ahead_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, zero, WORDS, ROUNDS,
                                 BF16: tl.constexpr, BLOCK: tl.constexpr, CLUSTER: tl.constexpr,
                                 CLUSTER_POW2: tl.constexpr):
    # Session 18: persistent clusters loading the next row ahead (the library's form at
    # 131073-262144), both slices held as words of two 16-bit values: the row ahead costs
    # 16 bits an element as in the library, the current row 16 more where the library holds
    # 32, so more CTAs an SM (more bytes in flight) at two exps an element.
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER)
    words = rank * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    in_row = words < N // 2
    other = launch_.NEG_INF_BF16_PAIR if BF16 else launch_.NEG_INF_FP16_PAIR
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    packed_next = tl.load(x_words + first_row.to(tl.int64) * (x_row_stride // 2) + words,
                          mask=in_row & (first_row < M), other=other)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        packed = packed_next
        next_row = row + clusters
        packed_next = tl.load(x_words + next_row.to(tl.int64) * (x_row_stride // 2) + words,
                              mask=in_row & (next_row < M), other=other)
        y, token = _packed_softmax_across_cluster(packed, zero, WORDS, i, token, BF16, CLUSTER, CLUSTER_POW2)
        tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + row.to(tl.int64) * (y_row_stride // 2) + words, y,
                 mask=in_row & (row < M))


def packed_ahead_forward(x, block, warps, maxnreg=None, rounds=None):
    """rounds None: as many clusters as fit, taking the rows in turn; else cdiv(M, rounds)
    clusters of `rounds` rows each (the GPU starting a cluster where one ended, as one row a
    cluster, with the start paid once every `rounds` rows and a row ahead in flight)."""
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    if rounds:
        return fixed_grid_forward(_forward_packed_ahead_kernel, x, block, rounds, (0,), BF16=x.dtype == torch.bfloat16,
                                  num_warps=warps, **extra)
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    cluster_.launch(_forward_packed_ahead_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 0, 1,
                    BF16=x.dtype == torch.bfloat16, BLOCK=block, CLUSTER=ctas,
                    CLUSTER_POW2=triton.next_power_of_2(ctas), num_warps=warps, **extra)
    return y


def cluster_forward(x, block, warps, log=False):
    M, N = x.shape
    cluster = triton.cdiv(N, block)
    y = torch.empty_like(x)
    args = (x, y, N, x.stride(0), y.stride(0), 0)
    kw = dict(LOG=log, BLOCK=block, CLUSTER=cluster, num_warps=warps)
    key = (x.dtype, block, warps, cluster, log)
    if key not in _COMPILED:
        k = _forward_cluster_kernel.warmup(*args, grid=(M * cluster,), **kw)
        k = k.result() if hasattr(k, "result") else k
        k._init_handles()
        slots = -(-k.metadata.shared // 16) * 16
        # the launcher multiplies grid x by the cluster size: pass M clusters
        _COMPILED[key] = (k, slots, (k.metadata.num_warps, cluster, slots + 8 * cluster))
    k, slots, packed = _COMPILED[key]
    k.run(M, 1, 1, torch.cuda.current_stream().cuda_stream, k.function, packed, None, None, None,
          x, y, N, x.stride(0), y.stride(0), slots, log, block, cluster)  # constexprs too, in order
    return y


def inspect():
    ik = importlib.import_module("inspect_kernel")
    sig = ik.signature(_forward_cluster_prefetch_kernel)
    sig["WORDS"] = sig["ROUNDS"] = "i32"
    for block, warps in ((8192, 4), (8192, 8), (4096, 4), (16384, 8)):
        ik.inspect(_forward_cluster_prefetch_kernel, sig, {"BLOCK": block, "CLUSTER": 16, "CLUSTER_POW2": 16}, warps)
    sig = ik.signature(_forward_cluster_packed_kernel)
    sig["WORDS"] = sig["ROUNDS"] = sig["zero"] = "i32"
    for block, warps, cluster in ((8192, 4, 16), (8192, 8, 16), (16384, 8, 16), (16384, 16, 16), (4096, 4, 16)):
        for late in (False, True):  # 8192 / 4 warps: 71 registers either way, 64 held without a spill
            ik.inspect(_forward_cluster_packed_kernel, sig,
                       {"BF16": True, "BLOCK": block, "CLUSTER": cluster, "CLUSTER_POW2": cluster, "PERSISTENT": False,
                        "LATE_WAIT": late}, warps)
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "x_row_stride": "i32", "y_row_stride": "i32",
           "SLOTS": "i32", "LOG": "constexpr", "BLOCK": "constexpr", "CLUSTER": "constexpr"}
    for block, warps, cluster in ((8192, 4, 16), (8192, 8, 16), (16384, 8, 8), (16384, 16, 16), (4096, 4, 8)):
        ik.inspect(_forward_cluster_kernel, sig, {"LOG": False, "BLOCK": block, "CLUSTER": cluster}, warps)
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32", "x_row_stride": "i32", "y_row_stride": "i32",
           "SLOTS": "i32", "ROUNDS": "i32", "LOG": "constexpr", "BLOCK": "constexpr", "CLUSTER": "constexpr",
           "STAGES": "constexpr"}
    for block, warps, cluster, stages in ((8192, 4, 16, 1), (8192, 4, 16, 2), (8192, 4, 16, 3), (4096, 4, 8, 3),
                                          (8192, 8, 16, 3), (16384, 8, 8, 3)):
        ik.inspect(_forward_cluster_rounds_kernel, sig,
                   {"LOG": False, "BLOCK": block, "CLUSTER": cluster, "STAGES": stages}, warps)
        ik.inspect(_forward_cluster_mbar_kernel, sig,
                   {"LOG": False, "BLOCK": block, "CLUSTER": cluster, "STAGES": stages}, warps)


@triton.jit
def _online_pair(m1, s1, m2, s2):
    # (max, sum of exp(x - max)) of two parts combined; all -inf parts have sum 0
    m = tl.maximum(m1, m2)
    shift = tl.where(m == -float("inf"), 0.0, m)
    return m, s1 * tl.exp2((m1 - shift) * LOG2E) + s2 * tl.exp2((m2 - shift) * LOG2E)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_two_level_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS,
                                      BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                                      PIECE: tl.constexpr):
    # The library's cluster forward with the slice seen as BLOCK / PIECE pieces of PIECE
    # elements: each piece's max and sum of exps reduce within a warp (shuffles, no barrier),
    # and one block-wide reduction combines the pieces' (max, sum) pairs, where the library
    # runs two (the slice's max, then its sum): half the barrier rounds a row.
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER)
    pieces = tl.arange(0, BLOCK // PIECE)
    cols = rank * BLOCK + pieces[:, None] * PIECE + tl.arange(0, PIECE)[None, :]
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        mask = (cols < N) & (row < M)
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        piece_max = tl.max(x, axis=1)
        piece_shift = tl.where(piece_max == -float("inf"), 0.0, piece_max)
        e = tl.exp2((x - piece_shift[:, None]) * LOG2E)
        slice_max, part = tl.reduce((piece_max, tl.sum(e, axis=1)), 0, _online_pair)
        maxes, sums, token = cluster_.exchange(WORDS, i, slice_max, part, token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        y = e * tl.exp2((piece_shift - row_max) * LOG2E - log2_total)[:, None]
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def two_level_forward(x, block, warps, piece=64, maxnreg=None):
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    cluster_.launch(_forward_cluster_two_level_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 1,
                    BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), PIECE=piece,
                    num_warps=warps, **extra)
    return y


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_prefetch_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS,
                                     BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    # The library's cluster forward with the next row's slice loaded before this row's
    # exchange: its bytes are in flight while the CTA waits on its peers and writes y, at the
    # cost of the raw slice in registers (16 bits an element).
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    x_next = tl.load(x_ptr + first_row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (first_row < M),
                     other=-float("inf"))
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        mask = (cols < N) & (row < M)
        x = x_next.to(tl.float32)
        next_row = row + clusters
        x_next = tl.load(x_ptr + next_row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (next_row < M),
                         other=-float("inf"))
        slice_max = tl.max(x, axis=0)
        shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
        e = tl.exp2((x - shift) * LOG2E)
        maxes, sums, token = cluster_.exchange(WORDS, i, slice_max, tl.sum(e, axis=0), token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def prefetch_forward(x, block, warps, maxnreg=None):
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    cluster_.launch(_forward_cluster_prefetch_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 1,
                    BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), PERSISTENT=True, num_warps=warps,
                    **extra)
    return y


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_cluster_lagged_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG: tl.constexpr,
                                   BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    # Rows in a pipeline of three: in round i the CTA sends row i + 1's (max, sum) before it
    # waits for row i's, so the exchange's wait is hidden behind a row of work, and loads row
    # i + 2. It holds three raw slices (rows i .. i + 2, 16 bits an element each) and writes
    # y from the raw slice: two exps an element for softmax.
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    x_held = tl.load(x_ptr + first_row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (first_row < M),
                     other=-float("inf"))
    row = first_row + clusters
    x_ahead = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (row < M),
                      other=-float("inf"))
    x = x_held.to(tl.float32)
    slice_max = tl.max(x, axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    token = cluster_.send(WORDS, 0, slice_max, tl.sum(tl.exp2((x - shift) * LOG2E), axis=0), token, CLUSTER)
    for i in range(0, ROUNDS):
        row = first_row + i * clusters
        x_next = x_ahead
        ahead = row + 2 * clusters
        x_ahead = tl.load(x_ptr + ahead.to(tl.int64) * x_row_stride + cols, mask=(cols < N) & (ahead < M),
                          other=-float("inf"))
        if i + 1 < ROUNDS:
            x = x_next.to(tl.float32)
            slice_max = tl.max(x, axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
            token = cluster_.send(WORDS, i + 1, slice_max, tl.sum(tl.exp2((x - shift) * LOG2E), axis=0), token,
                                  CLUSTER)
        maxes, sums, token = cluster_.receive(WORDS, i, token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        x = x_held.to(tl.float32)
        if LOG:
            y = (x - row_max) - log2_total * LN2
        else:
            y = tl.exp2((x - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty),
                 mask=(cols < N) & (row < M))
        x_held = x_next


def lagged_forward(x, block, warps, log=False, maxnreg=None):
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    cluster_.launch(_forward_cluster_lagged_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 1, LOG=log,
                    BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), PERSISTENT=True, num_warps=warps,
                    **extra)
    return y


_INIT_BARRIERS = cluster_._INIT_BARRIERS


@triton.jit
def _start_relaxed(WORDS, CLUSTER: tl.constexpr):
    # cluster_.start with a relaxed arrive: fence.mbarrier_init (in _INIT_BARRIERS) already
    # orders the mbarriers' initialisation before the peers' signals, and the release arrive
    # compiles to MEMBAR.ALL.GPU (session 15), once a row where a cluster takes one row
    cta = tl.program_id(0)
    token = tl.inline_asm_elementwise(_INIT_BARRIERS, "=r,r,r", [WORDS, cta], dtype=tl.int32, is_pure=False, pack=1)
    token = tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\nbarrier.cluster.wait;\nmov.b32 $0, $1;",
                                      "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)
    return cta % CLUSTER, cta // CLUSTER, token


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_one_shot_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, BLOCK: tl.constexpr,
                             CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, RELAXED: tl.constexpr):
    # One row a cluster, a grid of M clusters (quack's form): the GPU starts a cluster where
    # one finished, rather than a persistent cluster taking its next row. The exchange is the
    # library's (st.async + mbarrier).
    if RELAXED:
        rank, row, token = _start_relaxed(WORDS, CLUSTER)
    else:
        rank, row, _, token = cluster_.start(WORDS, CLUSTER)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    slice_max = tl.max(x, axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    e = tl.exp2((x - shift) * LOG2E)
    maxes, sums, token = cluster_.exchange(WORDS, 0, slice_max, tl.sum(e, axis=0), token, CLUSTER, CLUSTER_POW2)
    row_max = tl.max(maxes, axis=0)
    log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
    y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
    tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def fixed_grid_forward(kernel, x, block, rounds=1, extra=(), **kw):
    """y from `kernel` (arguments as _forward_one_shot_kernel's, with `extra` before WORDS,
    constexprs in kw) on a grid of cdiv(M, rounds) clusters, each taking `rounds` rows (1:
    one cluster a row): cluster_.launch's launch with the grid fixed by the rows rather than
    by the clusters that fit at once."""
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    args = (x, y, M, N, x.stride(0), y.stride(0), *extra, 0, rounds)
    kw = dict(kw, BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas))

    def prepare(compiled):  # as cluster_.launch's (the same entry: a kernel may be launched both ways)
        words = -(-compiled.metadata.shared // 16) * 16
        shared = words + cluster_.words_bytes(ctas)
        fits = cluster_._clusters_that_fit(compiled.function, compiled.metadata.num_warps, ctas, shared)
        return compiled, words, (compiled.metadata.num_warps, ctas, shared), fits

    bound, (compiled, words, packed, _) = launch_.compiled_for(kernel, x.device.index, (ctas,), args, kw, prepare)
    bound["WORDS"] = words
    compiled.run(triton.cdiv(M, rounds), 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, packed,
                 None, None, None, *bound.values())
    return y


def one_shot_forward(x, block, warps, relaxed):
    return fixed_grid_forward(_forward_one_shot_kernel, x, block, RELAXED=relaxed, num_warps=warps)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_early_wait_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, BLOCK: tl.constexpr,
                               CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr, EARLY: tl.constexpr):
    # The library's one row a cluster (8192 / 4 warps at 80 registers), with the start's
    # cluster barrier split as quack splits it: arrive (relaxed) right after the mbarriers'
    # initialisation, wait only before the first send, so the slice's loads and its max and
    # sum run while the peers arrive. EARLY False: arrive and wait together (the library's).
    cta = tl.program_id(0)
    token = tl.inline_asm_elementwise(_INIT_BARRIERS, "=r,r,r", [WORDS, cta], dtype=tl.int32, is_pure=False, pack=1)
    token = _cluster_arrive(token, False)
    if not EARLY:
        token = _cluster_wait(token)
    rank, row = cta % CLUSTER, (cta // CLUSTER).to(tl.int64)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
    slice_max = tl.max(x, axis=0)
    shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
    e = tl.exp2((x - shift) * LOG2E)
    part = tl.sum(e, axis=0)
    if EARLY:  # after the slice's sum (a data dependence keeps the wait behind the loads)
        token = _cluster_wait(token + (part != part).to(tl.int32))
    maxes, sums, token = cluster_.exchange(WORDS, 0, slice_max, part, token, CLUSTER, CLUSTER_POW2)
    row_max = tl.max(maxes, axis=0)
    log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
    y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def early_wait_forward(x, block, warps, early, maxnreg=None):
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    return fixed_grid_forward(_forward_early_wait_kernel, x, block, EARLY=early, num_warps=warps, **extra)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _forward_rounds_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, BLOCK: tl.constexpr,
                           CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    # Session 19 (lost: 0.91 / 0.92 / 0.89 / 0.84 at k = 1 / 2 / 4 / 8, 131072): the library's one-row forward (no row ahead, so 80 registers and
    # 6 CTAs an SM at 8192 / 4 warps) looping over ROUNDS rows on a fixed grid of M / ROUNDS
    # clusters. Where a cluster of 16 CTAs ends, its slots stay empty until 16 are free in
    # one GPC for the next cluster; k rows a cluster launch 1 / k as many clusters. The
    # first row waits for the peers late, as the library's.
    rank, first_row, clusters, token = cluster_.start(WORDS, CLUSTER, WAIT=False)
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    for i in tl.range(0, ROUNDS, num_stages=1):  # no software pipelining: its stages would take shared memory
        row = first_row + i * clusters  # rows past M join the exchange with -inf slices
        mask = (cols < N) & (row < M)
        x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        slice_max = tl.max(x, axis=0)
        shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
        e = tl.exp2((x - shift) * LOG2E)
        part = tl.sum(e, axis=0)
        if i == 0:
            token = cluster_.wait(token + (part != part).to(tl.int32))
        maxes, sums, token = cluster_.exchange(WORDS, i, slice_max, part, token, CLUSTER, CLUSTER_POW2)
        row_max = tl.max(maxes, axis=0)
        log2_total = tl.log2(tl.sum(sums * tl.exp2((maxes - row_max) * LOG2E), axis=0))
        y = e * tl.exp2((shift - row_max) * LOG2E - log2_total)
        tl.store(y_ptr + row.to(tl.int64) * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def library_forward(x, log, block, warps, maxnreg=None):
    """The library's cluster forward, launched directly (a register cap as an option)."""
    M, N = x.shape
    y = torch.empty_like(x)
    ctas = triton.cdiv(N, block)
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    cluster_.launch(sm._forward_cluster_kernel, M, ctas, x, y, M, N, x.stride(0), y.stride(0), 0, 1, LOG=log,
                    BLOCK=block, CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), PERSISTENT=True, num_warps=warps,
                    **extra)
    return y


# Forms, by --form: each a list of (label, function of x, log) for the sizes given.
FORMS = {
    # session 15, call 3: rows one cluster at a time (the first form)
    "one-shot": lambda N: [(f"cluster {triton.cdiv(N, b)} x {b}/{w}w one-shot", lambda x, b=b, w=w: cluster_forward(x, b, w),
                            False) for b, w in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16))],
    # calls 4-6: persistent clusters, fenced barrier or st.async + mbarrier, pipelined (STAGES)
    "stages": lambda N: [(f"{name} {triton.cdiv(N, b)} x {b}/{w}w/{st} stages", lambda x, f=f, b=b, w=w, st=st: f(x, b, w, st),
                          False)
                         for name, f in (("mbar", cluster_mbar_forward), ("fenced", cluster_rounds_forward))
                         for b, w, st in ((8192, 4, 1), (8192, 4, 3), (8192, 8, 3), (16384, 8, 1), (16384, 8, 3),
                                          (16384, 16, 3))],
    # call 9: slices held as packed words
    "packed": lambda N: [(f"packed {triton.cdiv(N, b)} x {b}/{w}w", lambda x, b=b, w=w: cluster_packed_forward(x, b, w),
                          False) for b, w in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16))],
    # next: one block-wide reduction a row instead of two (pieces reduced within a warp)
    # (registers on the CPU machine: 8192 / 4 warps 137, held to 96 without a spill; 8 warps 63)
    "two-level": lambda N: [(f"two-level {triton.cdiv(N, b)} x {b}/{w}w pieces of {p} maxnreg {r}",
                             lambda x, b=b, w=w, p=p, r=r: two_level_forward(x, b, w, p, r), False)
                            for b, w, p, r in ((8192, 4, 64, 96), (8192, 4, 64, None), (8192, 4, 128, 96),
                                               (8192, 8, 64, None), (4096, 4, 64, None))],
    # next: log_softmax's forward held to softmax's 96 registers (104 uncapped: 4 CTAs an SM, not
    # 5; ptxas spills nothing at 96 on the CPU machine)
    "log-maxnreg": lambda N: [(f"library log {triton.cdiv(N, 8192)} x 8192/4w maxnreg {r}",
                               lambda x, r=r: library_forward(x, True, 8192, 4, r), True) for r in (None, 96)],
    # session 16: the next row's slice loaded before this row's exchange (registers on the CPU
    # machine: see --inspect)
    "prefetch": lambda N: [(f"prefetch {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}",
                            lambda x, b=b, w=w, r=r: prefetch_forward(x, b, w, r), False)
                           for b, w, r in ((8192, 4, None), (8192, 4, 128), (8192, 8, None), (4096, 4, None),
                                           (4096, 8, None), (16384, 8, None), (16384, 16, None))],
    # session 16: rows in a pipeline of three, the exchange's wait behind a row of work
    "lagged": lambda N: [(f"lagged {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}" + (" log" if log else ""),
                          lambda x, b=b, w=w, r=r, log=log: lagged_forward(x, b, w, log, r), log)
                         for log in (False, True)
                         for b, w, r in ((8192, 4, None), (8192, 4, 128), (8192, 8, None), (4096, 4, None),
                                         (16384, 8, None), (16384, 16, None), (32768, 16, None))],
    # session 16, prepared: one row a cluster on a grid of M clusters, the library's exchange,
    # with the start's release arrive or a relaxed one
    # session 17: one row a cluster (the relaxed start) with the slice held as words of two
    # 16-bit values (registers on the CPU machine: see --inspect); held as 16-bit values of
    # their own (no words), ptxas kept 80 registers at 8192 / 4 warps, as the library's
    "one-row-packed": lambda N: [(f"one-row packed {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}",
                                  lambda x, b=b, w=w, r=r: cluster_packed_forward(x, b, w, False, r), False)
                                 for b, w, r in ((8192, 4, None), (8192, 4, 64), (8192, 8, None), (16384, 8, None),
                                                 (16384, 8, 64), (16384, 16, None))],
    # session 29, prepared: session 17's words (64 registers, 8 CTAs an SM: 0.92 at 131072
    # when the library read 0.90-0.91) with session 19's late wait (the library's +0.015 at
    # 131072), never combined; the library's one-row kernel timed beside it (`library`)
    "one-row-packed-late": lambda N: [(f"one-row packed {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}"
                                       + (" late wait" if late else ""),
                                       lambda x, b=b, w=w, r=r, late=late: cluster_packed_forward(x, b, w, False, r,
                                                                                                  late), False)
                                      for b, w, r in ((8192, 4, 64), (8192, 4, 72), (16384, 8, 64))
                                      for late in (False, True)],
    # session 35: slices of 32768 (the one-row pattern whose plain copy reads 0.934-0.941,
    # session 21) held as words: 16 warps held to 64 registers or 32 warps (32 registers
    # uncapped on sm_90), 2 CTAs an SM either way; clusters of 4 at 131072, 8 at 262144
    "one-row-packed-wide": lambda N: [(f"one-row packed {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}"
                                       + (" late wait" if late else ""),
                                       lambda x, b=b, w=w, r=r, late=late: cluster_packed_forward(x, b, w, False, r,
                                                                                                  late), False)
                                      for b, w, r in ((32768, 16, 64), (32768, 32, None), (16384, 8, 64))
                                      for late in (False, True)],
    # session 18: one row a cluster with the start's barrier split (arrive early, wait before
    # the first send), against the same kernel with both together
    "early-wait": lambda N: [(f"early-wait {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}{' early' if e else ''}",
                              lambda x, b=b, w=w, r=r, e=e: early_wait_forward(x, b, w, e, r), False)
                             for b, w, r in ((8192, 4, 80), (8192, 8, None), (16384, 8, 80)) for e in (False, True)],
    # session 18, prepared: persistent clusters loading the next row ahead, both slices as words
    # (registers on the CPU machine: 130 / 127 / 107 uncapped at 8192 / 4, 16384 / 8, 32768 / 16
    # warps; held to 80: no spill, 8 bytes, 8 bytes); `rounds` k: a grid of M / k clusters of k
    # rows each, rather than as many clusters as fit
    "packed-ahead": lambda N: [(f"packed-ahead {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r}"
                                + (f" {k} rows a cluster" if k else ""),
                                lambda x, b=b, w=w, r=r, k=k: packed_ahead_forward(x, b, w, r, k), False)
                               for b, w in ((8192, 4), (16384, 8), (32768, 16)) for r in (None, 80)
                               for k in ((None, 2, 4) if r else (None,))],
    # session 19: the library's persistent kernel (the next row loaded ahead) on a grid of
    # M / k clusters of k rows each: the start paid once every k rows, the GPU starting a
    # cluster where one ended as one row a cluster does
    "library-rounds": lambda N: [(f"library-rounds {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r} {k} rows a cluster",
                                  lambda x, b=b, w=w, r=r, k=k: fixed_grid_forward(
                                      sm._forward_cluster_kernel, x, b, k, LOG=False, PERSISTENT=True, num_warps=w,
                                      **({"maxnreg": r} if r else {})), False)
                                 for b, w, r in ((8192, 4, None), (8192, 4, 96), (8192, 8, None), (16384, 8, None),
                                                 (16384, 16, None))
                                 for k in (2, 4)],
    # session 19 (lost): the one-row kernel looping over k rows on a grid of M / k
    # clusters, no row ahead (80 registers), the first row's wait late
    "rounds": lambda N: [(f"rounds {triton.cdiv(N, b)} x {b}/{w}w maxnreg {r} {k} rows a cluster",
                          lambda x, b=b, w=w, r=r, k=k: fixed_grid_forward(
                              _forward_rounds_kernel, x, b, k, num_warps=w, maxnreg=r), False)
                         for b, w, r in ((8192, 4, 80), (16384, 8, 80)) for k in (1, 2, 4, 8)],
    "one-shot-mbar": lambda N: [(f"one-shot {triton.cdiv(N, b)} x {b}/{w}w{' relaxed' if r else ''}",
                                 lambda x, b=b, w=w, r=r: one_shot_forward(x, b, w, r), False)
                                for r in (False, True) for b, w in ((8192, 4), (8192, 8), (16384, 8), (32768, 16))],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--inspect", action="store_true")
    p.add_argument("--form", default="log-maxnreg", choices=sorted(FORMS))
    p.add_argument("--sizes", default="65536,98304,131072")
    args = p.parse_args()
    if args.inspect:
        return inspect()
    from measure import check_and_time_softmax, long_rows, print_fraction
    for N, M, copy_bw in long_rows(lambda device: None, sizes=tuple(map(int, args.sizes.split(",")))):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3
        nbytes = 2 * x.numel() * 2
        for log in (False, True):
            print_fraction(f"N={N} library log={log}", lambda: (sm.log_softmax if log else sm.softmax)(x), nbytes, copy_bw)
        for label, fn, log in FORMS[args.form](N):
            if 2 <= triton.cdiv(N, int(label.split(" x ")[1].split("/")[0])) <= 16:
                check_and_time_softmax(f"N={N} {label}", lambda: fn(x), log, x, nbytes, copy_bw)

if __name__ == "__main__":
    main()
