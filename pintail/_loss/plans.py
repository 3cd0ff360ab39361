"""Launch tables the losses share: the chunks of a row's classes the gradient kernels take
(cross_entropy's backward and the fused heads' chunk gradient), the chunk kernels' blocks,
the target check's, and the layout of a chunk buffer that a GEMM writes."""

from .._core.launch import cdiv, next_power_of_2

# The backward's chunks. A program takes about the same time however full its chunk is (one
# load round trip, one store), so a row's last, partly empty chunk costs a whole program:
# V = 50304 in chunks of 8192 fills them to 0.88, and read 0.83 against 0.89 at 32768. The
# largest of BACKWARD_BLOCKS whose chunks fill the row's sliced part to BACKWARD_FILL, else
# the smallest. H200, bf16, M = 4096, cross_entropy's backward kernel alone, one run each,
# (8192, 8 warps) -> this: 50304 0.825 -> 0.910 (2048), 50257 0.790 -> 0.862 (2048), 128256
# 0.902 -> 0.921 (2048), 151936 0.899 -> 0.913 (2048), 131072 0.914 -> 0.928 (8192), 262144
# 0.910 -> 0.926 (8192), 32768 0.886 -> 0.885 (8192; 2048 read 0.913 there), 128257 0.876 ->
# 0.873 (2048). 4 warps: at 8192 4 read 0.000-0.016 above 8 at all eight sizes; at 2048 2
# and 4 tied. Heavy bodies (softcap, or class weights with smoothing: 127-254 registers at
# 8192 / 4 warps, 32-56 at 2048) take the smallest chunk whatever the fill. Kernel alone,
# V = 32768 / 50257 / 131072, 8192 -> 2048 (4 warps): softcap 0.59 / 0.73 / 0.61 -> 0.88 /
# 0.88 / 0.80, weights and smoothing 0.77 / 0.67 / 0.83 -> 0.84 / 0.82 / 0.88, every option
# 0.53 / 0.60 / 0.56 -> 0.78 / 0.73 / 0.72 (4096 / 8 warps: 0.84 and 0.77 at 131072, below
# 2048 at the other two).
BACKWARD_BLOCKS, BACKWARD_FILL, BACKWARD_WARPS = (8192, 4096, 2048), 0.99, 4
# The eager target check: one program, its count written into pinned memory (no copy after
# it), all rows in one step (in steps of 1024, a load latency each, 4096 targets took 2.8
# us): checked forward 0.87-0.89 -> 0.91-0.93 of copy at V = 128256-131072.
TARGET_CHECK_BLOCK = 4096
# The fold kernel: one program a row of a chunk, BLOCK columns a step.
FOLD_BLOCK, FOLD_WARPS = 4096, 4
GRADIENT_WARPS = 4
# A chunk buffer's rows start on 128-byte boundaries whatever the chunk's width (cuBLAS
# writes rows of an odd leading dimension at a fraction of its rate).
BUFFER_ROW_MULTIPLE = 64
# The CPU sums a product in float32 from float32 copies of this many columns of its 16-bit
# operand at a time (it has no mixed-precision GEMM).
CPU_ACCUMULATE_COLUMNS = 16


def buffer_columns(width: int) -> int:
    """The row stride, in elements, of a buffer for chunks of `width` columns."""
    return cdiv(width, BUFFER_ROW_MULTIPLE) * BUFFER_ROW_MULTIPLE


def class_block(V, block):
    """A chunk of `block` classes, or the power of two that holds a row of V (16 at least)."""
    return min(block, max(16, next_power_of_2(V)))


def heavy_body(weight, smoothing, softcap):
    """Whether the gradient's body is heavy (BACKWARD_BLOCKS): softcap, or class weights with
    smoothing."""
    return softcap > 0 or (weight is not None and smoothing > 0)


def backward_chunks(V, shift, heavy=False):
    """(BLOCK, chunks a row) of a gradient kernel for rows of V > 0 classes whose chunks start
    SHIFT-aligned (0: at the row's start; the classes outside them go with chunk 0), for a
    plain or a `heavy` body: see BACKWARD_BLOCKS."""
    sliced = V // shift * shift if shift else V  # what the chunks cover (cluster.window)
    for block in BACKWARD_BLOCKS[-1:] if heavy else BACKWARD_BLOCKS:
        chunk = class_block(V, block)
        if sliced >= cdiv(sliced, chunk) * chunk * BACKWARD_FILL or block == BACKWARD_BLOCKS[-1]:
            return chunk, cdiv(sliced, chunk)


# Token chunks of the fused heads without a uniform row gradient (log-probs, distillation):
# rows a chunk by default, and the fewest a budget may ask for.
TOKEN_ROWS = 1024
MIN_TOKEN_ROWS = 16


def token_rows(M: int, V: int, K: int, element_size: int, budget: int | None, buffers: int, sums_dW: bool) -> int:
    """Rows a chunk for `buffers` (rows, V) logits buffers of `element_size` bytes (a fraction
    where one holds smaller elements) and, where
    sums_dW, the float32 (V, K) sum of the head's gradient: TOKEN_ROWS without a budget, else
    as many as fit; 0 where not even MIN_TOKEN_ROWS (or M) rows fit."""
    if budget is None:
        return max(1, min(M, TOKEN_ROWS))
    room = budget - (buffer_columns(V) * K * 4 if sums_dW else 0)
    rows = int(room // max(buffers * buffer_columns(V) * element_size, 1))
    return max(1, min(M, rows)) if rows >= min(M, MIN_TOKEN_ROWS) else 0


def token_budget(M: int, V: int, K: int, element_size: int, buffers: int, sums_dW: bool) -> int:
    """The least budget token_rows takes (for the error that names it)."""
    return int(min(M, MIN_TOKEN_ROWS) * buffers * buffer_columns(V) * element_size) + (
        buffer_columns(V) * K * 4 if sums_dW else 0)
