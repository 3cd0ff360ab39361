"""Helpers shared by every op: where a tensor runs, which dtypes the kernels take,
and how a tensor is seen as a matrix of rows for a row-wise kernel."""

import functools
import math
import warnings

import torch
import triton
import triton.language as tl

# triton.jit picks the interpreter or the compiler when a kernel is decorated, so the
# choice is read once, at import, exactly as the kernels saw it.
INTERPRET = bool(triton.knobs.runtime.interpret)
if INTERPRET:  # it evaluates masked-off lanes too: NumPy warns of their inf - inf, which no result reads
    warnings.filterwarnings("ignore", r"(invalid value|overflow|divide by zero) encountered", RuntimeWarning,
                            r"triton\.runtime\.interpreter")

# The kernels load these dtypes and compute in float32.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. triton.cdiv is a constexpr function: ~5-10 us a call on the
    host, and a call of ours makes several."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 at least n (1 for n <= 1), on the host (see cdiv)."""
    return 1 << max(n - 1, 0).bit_length()


def row_alignment(*sizes: int) -> int:
    """The largest power of 2 up to 8 that divides every size (a row length and the row
    strides, in elements), or 1 where 16 does. Triton specialises an integer argument as
    divisible by 16 or not at all, so rows of 1000 or 3000 bf16 elements (8-divisible:
    16-byte aligned) got 2-byte loads and stores; a kernel told ALIGN = 8 rewrites them as
    (v // 8) * 8, which its alignment analysis reads, and gets 16-byte ones (tl.multiple_of
    on a scalar argument did not reach it). Where all are 16-divisible Triton knows already,
    and the rewrite only costs registers (RMSNorm's blocks backward: 128 -> 157, one program
    fewer per SM, 0.63 -> 0.50 of copy at N = 32768)."""
    align = 16
    while align > 1 and any(size % align for size in sizes):
        align //= 2
    return 1 if align == 16 else align


@triton.jit
def aligned(value, ALIGN: tl.constexpr):
    """value, a multiple of ALIGN (row_alignment), written as one so that the compiler's
    alignment analysis sees it (tl.multiple_of on a kernel's scalar argument does not reach
    it: the loads stayed 2-byte wide, sm_90); value itself where ALIGN is 1. Every kernel's
    prologue passes its row length and row strides through it."""
    if ALIGN > 1:
        value = (value // ALIGN) * ALIGN
    return value


@triton.jit
def in_row(cols, N, EVEN: tl.constexpr):
    """cols < N; all true, known at compile time, where the host knows the row is whole
    chunks (EVEN: N a multiple of the chunk), so that the loads and stores compile without
    masks. ptxas zeroes a masked load's registers first and keeps the predicated loads in
    order: the norms' long kernel issued pass 2's loads two at a time where unmasked ones go
    out four at a time, as torch.compile's kernel does (sm_90 SASS)."""
    if EVEN:
        return tl.full(cols.shape, 1, tl.int1)
    else:
        return cols < N


def rows_tail(N: int) -> tuple:
    """(BLOCK_N, TAIL) of a rows kernel that takes the row as two tiles (the norms', softmax's
    forward): next_power_of_2(N) / 2 columns and a power of two more, where those hold it in
    fewer lanes than one tile of next_power_of_2(N) (5120 = 4096 + 1024, 6144 = 4096 + 2048,
    12288 = 8192 + 4096); else (next_power_of_2(N), 0)."""
    block_n = next_power_of_2(N)
    head = block_n // 2
    tail = next_power_of_2(N - head) if N > head else 0
    return (head, tail) if 0 < tail < head else (block_n, 0)


def widened_tail(tail: int, num_warps: int, values: int = 8) -> int:
    """A rows kernel's TAIL (rows_tail's cut) widened, masked, to hold at least `values` a
    thread at num_warps; 8: a 16-byte vector of 16-bit values. A narrower tail tile took
    8-byte loads and a layout of its own, converted with 27-30 barriers a row against 11
    (sm_90); on the H200, bf16, LayerNorm's forward at 4608 = 4096 + 512 / 4 warps read 0.60
    of copy, with the tail widened to 1024 0.93."""
    return max(tail, values * 32 * num_warps)


def whole_tiles(M: int, N: int, cfg: dict) -> bool:
    """A rows plan's EVEN: rows of exactly BLOCK_N (+ TAIL, the second tile: rows_tail) and a
    multiple of BLOCK_M of them, so that every tile is whole and its loads and stores need
    no mask (in_row)."""
    return N == cfg["BLOCK_N"] + cfg.get("TAIL", 0) and M % cfg["BLOCK_M"] == 0


# Compiled kernels, prepared for launch, by (kernel, device, specialisation, launch
# options): see compiled_for().
_COMPILED = {}
TRITON_3_6 = triton.__version__.startswith("3.6.")


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), with less host time on a GPU.

    Triton's own launch re-reads its settings from the environment, checks the kernel's
    globals and looks up the device and stream through its driver on every call. On the
    H200 machine that took 29-36 us a launch, this function 23 us,
    and the compiled kernel's launcher alone 7-10 us. The rest is Triton's binder (see
    compiled_for). Launch hooks (knobs.runtime.launch_enter_hook) are not called. The
    interpreter takes the ordinary path, and so does a Triton other than 3.6, whose
    internals this is written against.

    The kernel runs on the GPU of its first argument (a tensor, for every kernel here), made
    the current device for the launch where it is not: Triton compiles and launches for the
    current device."""
    if INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    device = args[0].device.index
    if device != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch(kernel, grid, *args, **kwargs)
        return
    if not TRITON_3_6:
        kernel[grid](*args, **kwargs)
        return
    bound, compiled = compiled_for(kernel, device, grid, args, kwargs)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(grid[0], grid[1], grid[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *bound.values())


def compiled_for(kernel, device: int, grid: tuple, args: tuple, kwargs: dict, prepare=None):
    """(the call's bound arguments, the kernel compiled for its specialisation) on Triton
    3.6, for a launch through the compiled kernel's `run`. Triton's binder computes the
    specialisation (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), so
    a compiled kernel is reused only where Triton would reuse it. The first call of a
    specialisation compiles it (for `grid`), loads it onto the device and keeps
    prepare(compiled) (the compiled kernel where prepare is None), which later calls return."""
    bound, specialisation, options = kernel.device_caches[device][4](*args, **kwargs)
    key = (kernel, device, tuple(specialisation), tuple(options.items()))
    prepared = _COMPILED.get(key)
    if prepared is None:
        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        compiled._init_handles()
        prepared = _COMPILED[key] = prepare(compiled) if prepare else compiled
    return bound, prepared


def runs_kernels(t: torch.Tensor) -> bool:
    """CUDA tensors run the compiled kernels; CPU tensors run them in the Triton
    interpreter when TRITON_INTERPRET=1 was set before import, else the torch reference."""
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


@functools.cache
def multiprocessors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_slots(device: torch.device, programs_per_sm: int) -> int:
    """Grid size of a persistent kernel: programs_per_sm on each multiprocessor. The
    interpreter runs programs one after another, so a few do."""
    if device.type != "cuda":
        return programs_per_sm
    return programs_per_sm * multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def canonical_dim(dim: int, ndim: int) -> int:
    """`dim` wrapped into [0, ndim), raising what torch raises when it is out of range."""
    rank = max(ndim, 1)  # a 0-d tensor accepts dim 0 and -1, as in torch
    if not -rank <= dim < rank:
        raise IndexError(
            f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    return dim % rank


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim has unit stride, else a contiguous copy (e.g. of an
    expanded gradient, whose strides are 0)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` seen as an (M, N) matrix whose rows run along `dim` with unit stride.

    No copy when the layout allows one row stride (e.g. a contiguous tensor, or a slice
    of rows); a copy only when the elements of a row are not adjacent in memory."""
    if dim == t.dim() - 1:  # the common cases, without the general steps (each view costs host time)
        if t.dim() == 2 and t.stride(1) == 1:
            return t
        if t.is_contiguous():
            return t.view(math.prod(t.shape[:-1]), t.shape[-1])
    moved = t.movedim(dim, -1)
    if moved.dim() == 0:
        moved = moved.reshape(1)
    # the row count spelled out, not -1: a row may hold no elements
    return unit_stride(moved).reshape(math.prod(moved.shape[:-1]), moved.shape[-1])


def empty_like_rows(t: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An output of t's shape whose rows along `dim` are contiguous: the layout a row-wise
    kernel writes. The fake (meta) implementations call this too, so that compiled graphs
    see the strides the real op returns."""
    if dim == t.dim() - 1:
        return torch.empty(t.shape, dtype=dtype, device=t.device)
    moved_shape = t.movedim(dim, -1).shape
    return torch.empty(moved_shape, dtype=dtype, device=t.device).movedim(-1, dim)


class _NoSecondDerivative(torch.autograd.Function):
    """A gradient made by a kernel, tied to what it was computed from: differentiating it
    again raises (the backward kernels are not differentiable)."""

    @staticmethod
    def forward(ctx, grad, *sources):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("pintail: a second derivative through a pintail op is not supported (its backward "
                           "runs a kernel); use torch's op where create_graph=True must reach through it")


def no_second_derivative(grads: tuple, *sources) -> tuple:
    """The gradients an autograd.Function's backward returns. When autograd is recording the
    backward itself (create_graph=True) and a source (a saved tensor or an incoming
    gradient) requires grad, each gradient is routed through a node that raises if
    differentiated, instead of silently counting as a constant."""
    if not torch.is_grad_enabled():
        return grads
    sources = [s for s in sources if isinstance(s, torch.Tensor) and s.requires_grad]
    if not sources:
        return grads
    return tuple(_NoSecondDerivative.apply(g, *sources) if isinstance(g, torch.Tensor) else g for g in grads)


# 16-bit rows held as 32-bit words of two values (the packed plans: softmax, LayerNorm):
# half the registers of the row as float32, unpacked again where each pass needs it.


def packs_into_words(N: int, rows: tuple, vectors: tuple = ()) -> bool:
    """Whether rows of N elements (2-D tensors `rows`, and 1-D `vectors` beside them, e.g. a
    weight; None entries skipped) can be read as 32-bit words of two values: one 16-bit
    dtype, N and every row stride even, every tensor starting 4-byte aligned."""
    tensors = [t for t in (*rows, *vectors) if t is not None]
    return (tensors[0].element_size() == 2 and N % 2 == 0 and all(t.stride(0) % 2 == 0 for t in rows)
            and all(t.dtype == tensors[0].dtype and t.data_ptr() % 4 == 0 for t in tensors))

NEG_INF_BF16_PAIR: tl.constexpr = tl.constexpr(-8323200)  # 0xFF80FF80: a word of two bf16 -inf
NEG_INF_FP16_PAIR: tl.constexpr = tl.constexpr(-67044352)  # 0xFC00FC00: two fp16 -inf


@triton.jit
def unpack_pairs(words, BF16: tl.constexpr):
    # 32-bit words of two 16-bit floats (little-endian: a row's element 2i in the low half)
    # -> two float32 tensors. bf16 is float32's upper half, so bf16 needs only a shift.
    if BF16:
        return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)
    else:
        low = (words & 65535).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return low, high


@triton.jit
def pack_pairs(low, high, BF16: tl.constexpr):
    # two float32 tensors -> words of two 16-bit floats (rounded to nearest even, as torch)
    dtype: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    low16 = low.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 65535
    high16 = high.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return low16 | high16
