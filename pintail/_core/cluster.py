"""Rows cut across the CTAs of a thread-block cluster (sm_90): each CTA holds one slice of a
row in registers, and the CTAs of a cluster trade the slices' partial statistics through
distributed shared memory. The row is read once and written once, with no wait on L2.

Triton 3.6 cannot compile a kernel for clusters (num_ctas > 1 fails in its PlanCTA pass,
and Gluon's cluster layouts cannot reduce across CTAs), so a kernel here is compiled for
one CTA and launched with a cluster dimension: the launcher takes the cluster size from the
compiled kernel's packed metadata (num_warps, num_ctas, shared bytes), which `launch`
rewrites. A CTA's rank in its cluster is then its program id modulo the cluster size. The
exchange is inline PTX on a few words past the shared memory Triton allocated (its base is
the module's `global_smem`): BUFFERS mbarriers and BUFFERS buffers of one 8-byte word per
CTA, rows taking them in turn. Each CTA sends its word to every peer with st.async, whose
bytes count on the peer's mbarrier (complete_tx), and waits until its own mbarrier has
counted CLUSTER words: no fences, no polling of L2. A kernel may send row i + 1 before it
receives row i (`send`, then `receive`). A peer's send of row j then waits only on this
CTA's send of row j - 1, after which this CTA may still hold rows j - 2 and j - 1 unread:
three rows in flight at most, so four buffers never overwrite a word before it is read.

The grid is persistent (as many clusters as fit at once, from cuOccupancyMaxActiveClusters:
cluster c takes rows c, c + clusters, ...) or has one cluster a row, where the GPU starts a
cluster as one ends. Nothing waits across clusters, and the CTAs of a cluster run together
by construction, so no order of dispatch can deadlock.

The interpreter has no inline PTX: there the split plans (_split.py) take these rows.
"""

import ctypes
import functools

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, TRITON_3_6, cdiv, compiled_for

MAX_CLUSTER = 16  # 8 is the portable limit; the H100 / H200 allow 16 on request
BUFFERS: tl.constexpr = tl.constexpr(4)  # buffers of words, and mbarriers: rows in flight (the module's docstring)
# thread 0 initialises every mbarrier (one arrival a phase) at $1 past global_smem
_INIT_BARRIERS: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
    "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\n"
    + "".join(f"@p mbarrier.init.shared::cta.b64 [b+{8 * k}], 1;\n" for k in range(BUFFERS.value))
    + "@p fence.mbarrier_init.release.cluster;\nmov.b32 $0, $2;\n}")


def available(device: torch.device) -> bool:
    """Whether cluster kernels can run on `device`: a GPU of compute capability 9.0 or
    newer, and the Triton 3.6 launcher whose metadata `launch` rewrites."""
    return not INTERPRET and TRITON_3_6 and device.type == "cuda" and _has_clusters(device.index)


@functools.cache
def _has_clusters(device_index) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def words_bytes(cluster: int) -> int:
    """Shared memory the exchange needs past Triton's: the mbarriers and buffers of words."""
    return BUFFERS.value * 8 * (1 + cluster)


def window(N: int, block: int, *rows: torch.Tensor, boundary: int = 16) -> tuple:
    """(CTAs a row, SHIFT) for rows of N elements of `rows` (tensors, rows along dim 0, read at
    the same classes: cross-entropy's logits and probability targets may differ in dtype)
    cut into slices of `block`. Triton knows a row is 16-byte aligned only where the
    row length and strides are multiples of 16 (else every load is 2 bytes wide: 0.04-0.69
    of copy). SHIFT (elements in a boundary of 16 to `boundary` bytes) starts each row's
    slices at the first boundary in the row: the row's whole pieces between boundaries then
    go as 16-byte vector loads and stores, and the at most SHIFT - 1 elements at either end
    one at a time (`row_ends`). The whole pieces span at most N // SHIFT * SHIFT elements,
    and the CTAs cover just those: a row of 32769 takes 4 slices of 8192, not 5 (its last
    element goes with the last slice). SHIFT is the largest boundary (at most N elements)
    that every tensor starts on and that their row strides agree modulo (every row of each
    then starts the same distance before a boundary); SHIFT 0: the slices start at the row's
    start, where not even 16 bytes qualify. `boundary` 128 starts the slices on whole L2
    lines: from 16-byte boundaries each warp's 512-byte access straddles 5 lines and 17
    sectors, two warps fetching the sectors at its ends (Nsight Compute). Only
    cross-entropy's backward takes it (H200, bf16, 16 -> 128: 0.85 -> 0.88 at
    V = 128257). Where up to 2 x 63 end elements must reduce across warps first it lost:
    softmax's cluster forward 0.90 -> 0.83 at 131065, the row-shift forward 0.80 -> 0.78 at
    12289, log_softmax's row-shift backward 0.93 -> 0.88 at 12289 (softmax's there gained
    0.91 -> 0.92, and lost 0.91 -> 0.88 at 16383).
    """
    # SHIFT in elements: a boundary of SHIFT elements is one of 16 bytes or more in every tensor
    size = min(t.element_size() for t in rows)
    vec = 16 // size

    def unaligned(shift):  # some tensor's element 0, or some row, off a boundary of `shift` elements
        return (any(t.data_ptr() % (shift * t.element_size()) for t in rows)
                or len({t.stride(0) % shift for t in rows}) > 1)

    plain = cdiv(N, block), 0
    if N < vec or unaligned(vec):
        return plain  # no 16-byte boundary that every row of every tensor starts the same distance from
    if N % 16 == 0 and all(t.stride(0) % 16 == 0 for t in rows):
        return plain  # Triton specialises these as 16-divisible: vector loads already
    shift = boundary // size
    while shift > N or unaligned(shift):
        shift //= 2  # stops at vec at the latest: it qualifies (above)
    return cdiv(N // shift * shift, block), shift


def vector_shift(N: int, *rows: torch.Tensor, boundary: int = 16) -> int:
    """SHIFT (`window`) for a row kernel that otherwise takes ALIGN (launch.row_alignment):
    where the row length or a row stride leaves the rows' starts short of 16-byte alignment,
    the rows from their first boundary as `window` allows; else 0 (ALIGN's vectors, or
    Triton's own 16-divisibility, are 16 bytes already)."""
    vec = 16 // min(t.element_size() for t in rows)
    if N < vec or all(size % vec == 0 for size in (N, *(t.stride(0) for t in rows))):
        return 0  # no whole 16-byte piece (an empty row too), or vectors already
    return window(N, N, *rows, boundary=boundary)[1]


# ------------------------------------------------------------------------ device side


@triton.jit
def start(WORDS, CLUSTER: tl.constexpr, WAIT: tl.constexpr = True):
    """(rank in the cluster, cluster index, clusters in the grid, a token for ordering):
    thread 0 initialises the mbarriers (one arrival a phase: its own expect_tx), then the
    whole cluster syncs, so no word is sent to a barrier not yet initialised. The arrive is
    relaxed: fence.mbarrier_init already releases the initialisation to the cluster, and a
    release arrive costs a fence of the whole GPU (MEMBAR.ALL.GPU), once a row where a
    cluster takes one row (one-shot forward at 32768: 0.81 against 0.95 relaxed). WAIT False:
    only arrive here; the kernel must call `wait` before its first send, and may load and
    reduce its slice in between while its peers start (the cluster's round trip hidden)."""
    cta = tl.program_id(0)
    token = tl.inline_asm_elementwise(_INIT_BARRIERS, "=r,r,r", [WORDS, cta], dtype=tl.int32, is_pure=False, pack=1)
    token = tl.inline_asm_elementwise("barrier.cluster.arrive.relaxed;\nmov.b32 $0, $1;",
                                      "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)
    if WAIT:
        token = wait(token)
    return cta % CLUSTER, cta // CLUSTER, tl.num_programs(0) // CLUSTER, token


@triton.jit
def slice_columns(rank, N, BLOCK: tl.constexpr):
    """The columns of CTA `rank`'s slice of a row of N, and which of them are in the row."""
    cols = rank * BLOCK + tl.arange(0, BLOCK)
    return cols, cols < N


@triton.jit
def round_row(first_row, i, clusters, M, col_mask):
    """A persistent cluster's row in round i, whether it is one of the M rows, the slice's
    mask for it and the row as int64: every CTA runs every round, rows past M join with zeros."""
    row = first_row + i * clusters
    in_rows = row < M
    return row, in_rows, col_mask & in_rows, row.to(tl.int64)


@triton.jit
def wait(token):
    """The wait of `start`'s cluster barrier: every CTA of the cluster has initialised its
    mbarriers. A new token."""
    return tl.inline_asm_elementwise("barrier.cluster.wait.acquire;\nmov.b32 $0, $1;", "=r,r", [token],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exchange(WORDS, i, hi, lo, token, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    """Row i of this cluster: send (hi, lo) (two float32) to every CTA of the cluster and
    return every CTA's pair (`receive`) once all have arrived."""
    token = send(WORDS, i, hi, lo, token, CLUSTER)
    return receive(WORDS, i, token, CLUSTER, CLUSTER_POW2)


@triton.jit
def exchange_sums(WORDS, i, a, b, token, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    """Row i of this cluster, for two sums: send (a, b) (float32) to every CTA of the cluster
    and return the sums of every CTA's a and of every CTA's b, in rank order (every CTA adds
    the same words in the same order: the same bits), and a new token."""
    all_a, all_b, token = exchange(WORDS, i, a, b, token, CLUSTER, CLUSTER_POW2)
    real = tl.arange(0, CLUSTER_POW2) < CLUSTER  # the padding's first values are -inf
    return tl.sum(tl.where(real, all_a, 0.0), axis=0), tl.sum(all_b, axis=0), token


@triton.jit
def send(WORDS, i, hi, lo, token, CLUSTER: tl.constexpr):
    """Send row i's (hi, lo) (two float32) to every CTA of the cluster; a new token."""
    bar = WORDS + (i % BUFFERS) * 8 + token * 0
    words = WORDS + BUFFERS * 8 + (i % BUFFERS) * (CLUSTER * 8)
    rank = tl.program_id(0) % CLUSTER
    token = arrive_expecting(bar, CLUSTER * 8, token)  # CLUSTER words (they may land before it)
    # thread t < CLUSTER sends this CTA's word to slot `rank` of peer t, counted on peer t's barrier
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t, s, b;\n.reg .pred p;\nmov.u32 t, %tid.x;\nsetp.lt.u32 p, t, $5;\n"
        "mov.u32 s, global_smem;\nadd.u32 s, s, $1;\nmov.u32 b, global_smem;\nadd.u32 b, b, $2;\n"
        "@p mapa.shared::cluster.u32 s, s, t;\n@p mapa.shared::cluster.u32 b, b, t;\n"
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [s], {$3, $4}, [b];\n"
        "mov.b32 $0, $6;\n}",
        "=r,r,r,f,f,r,r", [words + rank * 8 + token * 0, bar, hi, lo, CLUSTER, token],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def arrive_expecting(bar, nbytes, token):
    """Thread 0 arrives on the mbarrier `bar` bytes past global_smem, expecting `nbytes` to
    land on it (st.async's complete_tx; they may land before the arrive: the phase waits for
    both). A new token."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 t, b;\n.reg .pred p;\n.reg .b64 s;\nmov.u32 t, %tid.x;\nsetp.eq.u32 p, t, 0;\n"
        "mov.u32 b, global_smem;\nadd.u32 b, b, $1;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 s, [b], $2;\nmov.b32 $0, $3;\n}",
        "=r,r,r,r", [bar, nbytes, token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_phase(bar, parity, token):
    """Wait until the mbarrier `bar` bytes past global_smem completes the phase of `parity`; a
    new token. The spin stays inside the asm, as a Triton loop around it would keep Triton's
    pipeliner off."""
    return tl.inline_asm_elementwise(
        "{\n.reg .b32 b;\n.reg .pred p;\nmov.u32 b, global_smem;\nadd.u32 b, b, $1;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [b], $2;\n@!p bra WAIT;\nmov.b32 $0, $3;\n}",
        "=r,r,r,r", [bar, parity, token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def receive(WORDS, i, token, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr):
    """Every CTA's pair of row i, in rank order, once all have arrived, with a new token. The
    pairs come as CLUSTER_POW2 (a power of 2, at least CLUSTER) entries, the last ones
    (-inf, 0)."""
    bar = WORDS + (i % BUFFERS) * 8 + token * 0
    words = WORDS + BUFFERS * 8 + (i % BUFFERS) * (CLUSTER * 8)
    token = wait_phase(bar, (i // BUFFERS) % 2, token)  # rows i and i + BUFFERS share a barrier
    peers = tl.arange(0, CLUSTER_POW2)
    his, los = tl.inline_asm_elementwise(
        "{\n.reg .b32 a;\nmov.u32 a, global_smem;\nadd.u32 a, a, $2;\nld.shared.v2.f32 {$0, $1}, [a];\n}",
        "=f,=f,r", [words + tl.minimum(peers, CLUSTER - 1) * 8 + token * 0], dtype=(tl.float32, tl.float32),
        is_pure=False, pack=1)
    return tl.where(peers < CLUSTER, his, -float("inf")), tl.where(peers < CLUSTER, los, 0.0), token


@triton.jit
def slice_start(row, row_stride, SHIFT: tl.constexpr):
    """Where the slices of `row` start, in elements from the tensor's start (`window`): the
    row's start, or where SHIFT the first boundary (of SHIFT elements: `window`) at or after it."""
    start = row.to(tl.int64) * row_stride
    if SHIFT:
        start = (start + SHIFT - 1) // SHIFT * SHIFT  # the compiler reads the product: aligned
    return start


@triton.jit
def row_head(row, row_stride, SHIFT: tl.constexpr):
    """How many of `row`'s elements lie before its slices' start (`slice_start`)."""
    return ((SHIFT - row.to(tl.int64) * row_stride % SHIFT) % SHIFT).to(tl.int32)


@triton.jit
def whole_end(row, row_stride, N, SHIFT: tl.constexpr):
    """Where `row`'s whole pieces between boundaries end, from `slice_start`: N without SHIFT."""
    end = N
    if SHIFT:
        end = (N - row_head(row, row_stride, SHIFT)) // SHIFT * SHIFT
    return end


@triton.jit
def slice_mask(row, row_stride, N, rank, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    """The row's elements in CTA `rank`'s slice (from `slice_start`); where SHIFT, those of
    the row's whole pieces between boundaries only, so the mask changes only at multiples of SHIFT and
    the loads and stores are vectors (the row's other elements: `row_ends`)."""
    at = rank * BLOCK + tl.arange(0, BLOCK)
    return at < whole_end(row, row_stride, N, SHIFT)  # `row` may be a column of rows (a tile's)


@triton.jit
def row_ends(row, row_stride, N, rank, BLOCK: tl.constexpr, SHIFT: tl.constexpr, CLUSTER: tl.constexpr):
    """(positions from `slice_start`, mask) of the row's elements outside its whole
    pieces that CTA `rank` takes: the up to SHIFT - 1 before the slices' start (rank 0) and
    the up to SHIFT - 1 after the last whole piece (the CTA whose slice holds them, or the
    last CTA where they lie past every slice: `window`), as one small tensor of 2 x SHIFT
    entries, loaded and stored an element at a time."""
    head = row_head(row, row_stride, SHIFT)
    end_whole = whole_end(row, row_stride, N, SHIFT)
    j = tl.arange(0, 2 * SHIFT)
    at = tl.where(j < SHIFT, j - SHIFT, end_whole + j - SHIFT)
    in_row = tl.where(j < SHIFT, at >= -head, at < N - head)
    owner = tl.minimum(tl.maximum(at, 0) // BLOCK, CLUSTER - 1)
    return at, in_row & (owner == rank)


# -------------------------------------------------------------------------- host side


class _Attribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED = 8
_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(result, what):
    if result != 0:
        raise RuntimeError(f"pintail: {what} failed with CUDA driver error {result}")


def _clusters_that_fit(function: int, num_warps: int, cluster: int, shared: int) -> int:
    """How many clusters of `cluster` CTAs of this kernel the GPU runs at once (it depends
    on the registers, the shared memory and how the GPCs' SMs divide by the cluster)."""
    cuda = _driver()
    _check(cuda.cuFuncSetAttribute(ctypes.c_void_p(function), _FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED, shared),
           "cuFuncSetAttribute(max dynamic shared memory)")
    if cluster > 8:
        _check(cuda.cuFuncSetAttribute(ctypes.c_void_p(function), _FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
               "cuFuncSetAttribute(non-portable cluster size)")
    attribute = _Attribute(id=_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attribute.value[0], attribute.value[1], attribute.value[2] = cluster, 1, 1
    config = _Config(shared=shared, attrs=ctypes.pointer(attribute), num_attrs=1)
    config.grid[0], config.grid[1], config.grid[2] = cluster, 1, 1
    config.block[0], config.block[1], config.block[2] = 32 * num_warps, 1, 1
    fits = ctypes.c_int()
    _check(cuda.cuOccupancyMaxActiveClusters(ctypes.byref(fits), ctypes.c_void_p(function), ctypes.byref(config)),
           "cuOccupancyMaxActiveClusters")
    return fits.value


def launch(kernel, rows: int, cluster: int, *args, **kwargs) -> int:
    """Launch `kernel`, whose last two runtime arguments are named WORDS (the exchange's
    offset in shared memory) and ROUNDS (rows per cluster; neither specialised), on clusters
    of `cluster` CTAs covering `rows` rows: as many clusters as fit at once, each taking
    ROUNDS rows, or, where the kernel has a constexpr PERSISTENT set False, one cluster a
    row. Pass WORDS=0, ROUNDS=1: they are set here. Returns the clusters launched
    (`clusters_for`)."""
    _check_size(cluster)
    device = args[0].device.index
    if device != torch.cuda.current_device():
        with torch.cuda.device(device):
            return launch(kernel, rows, cluster, *args, **kwargs)
    bound, (compiled, words, packed, fits) = _prepared(kernel, device, cluster, args, kwargs)
    clusters = _grid(fits, rows, kwargs)
    bound["WORDS"], bound["ROUNDS"] = words, -(-rows // clusters)
    # the launcher launches clusters x cluster CTAs, in clusters of packed[1]
    compiled.run(clusters, 1, 1, torch._C._cuda_getCurrentRawStream(device), compiled.function, packed,
                 None, None, None, *bound.values())
    return clusters


def clusters_for(kernel, rows: int, cluster: int, *args, **kwargs) -> int:
    """The clusters `launch` runs with these arguments (compiling the kernel the first time),
    for a kernel that writes a result per cluster into a buffer the caller sizes first; the
    buffer's own argument may be any tensor of its dtype and alignment."""
    _check_size(cluster)
    device = args[0].device.index
    with torch.cuda.device(device):
        fits = _prepared(kernel, device, cluster, args, kwargs)[1][3]
    return _grid(fits, rows, kwargs)


def _grid(fits, rows, kwargs):
    """The clusters of a launch: as many as fit at once (at most one a row), or one a row
    where the kernel's constexpr PERSISTENT is False."""
    return min(fits, rows) if kwargs.get("PERSISTENT", True) else rows


def _prepared(kernel, device, cluster, args, kwargs):
    """(bound arguments, (compiled kernel, the words' offset, packed metadata, clusters that
    fit)) for this specialisation, compiled and measured once."""

    def prepare(compiled):
        # the exchange's words go past Triton's shared memory, 16-byte aligned
        words = -(-compiled.metadata.shared // 16) * 16
        shared = words + words_bytes(cluster)
        fits = _clusters_that_fit(compiled.function, compiled.metadata.num_warps, cluster, shared)
        if fits < 1:
            raise RuntimeError(f"pintail: no cluster of {cluster} CTAs of {kernel.__name__} fits on this GPU")
        return compiled, words, (compiled.metadata.num_warps, cluster, shared), fits

    return compiled_for(kernel, device, (cluster,), args, kwargs, prepare)


def _check_size(cluster):
    if not 2 <= cluster <= MAX_CLUSTER:
        raise ValueError(f"pintail: a cluster of {cluster} CTAs; expected 2 to {MAX_CLUSTER}")
