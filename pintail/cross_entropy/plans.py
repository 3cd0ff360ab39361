"""Launch plans of cross_entropy: which rows take which plan, with the measurement behind each table entry."""


from .._core import cluster
from .._core.launch import cdiv, next_power_of_2, row_alignment

# ------------------------------------------------------------------ launch heuristics
# Plain Triton probes on the H200: the online forward at BLOCK 8192 / 4 warps reached
# 0.84-1.02 of copy; the backward on a (rows x 8192-column chunks) grid 0.93. The forward's
# chunk: the first of FORWARD_BLOCKS for the class-index loss without smoothing, the second
# for the bodies that hold more a chunk (probability targets: 165-207 registers at 8192, two
# programs an SM; label smoothing). H200, bf16, M = 4096, kernel alone, one run
# each, 8192 -> 4096 (4 warps), V = 32768 / 50257 / 131072: probability targets 0.68 / 0.65
# / 0.75 -> 0.83 / 0.83 / 0.88 (262144: 0.75 -> 0.86; 2048 read 0.80-0.84, 8 warps below 4
# but at 8192), smoothing 0.70 / 0.68 / 0.80 -> 0.71 / 0.72 / 0.82, weights and smoothing
# 0.53 / 0.39 / 0.62 -> 0.54 / 0.41 / 0.64. A softcap alone stays at 8192 (0.55 there at
# 131072, 4096 no better at 32768).
FORWARD_BLOCKS, FORWARD_WARPS = (8192, 4096), 4
# One program each, a block of rows per step: in steps of 1024 (a load latency each) the
# reduction of 4096 rows took 6.8 us and the check of 4096 targets 2.8 us. The check in one
# step, with its count written into pinned memory (no copy after it): checked forward
# 0.87-0.89 -> 0.91-0.93 of copy at V = 128256-131072.
REDUCE_BLOCK, REDUCE_WARPS = 4096, 8
TARGET_CHECK_BLOCK = 4096
# The backward's chunks. A program takes about the same time however full its chunk is (one
# load round trip, one store), so a row's last, partly empty chunk costs a whole program:
# V = 50304 in chunks of 8192 fills them to 0.88, and read 0.83 against 0.89 at 32768. The
# largest of BACKWARD_BLOCKS whose chunks fill the row's sliced part to BACKWARD_FILL, else
# the smallest. H200, bf16, M = 4096, kernel alone, one run each, (8192, 8 warps)
# -> this: 50304 0.825 -> 0.910 (2048), 50257 0.790 -> 0.862 (2048), 128256 0.902 -> 0.921
# (2048), 151936 0.899 -> 0.913 (2048), 131072 0.914 -> 0.928 (8192), 262144 0.910 -> 0.926
# (8192), 32768 0.886 -> 0.885 (8192; 2048 read 0.913 there), 128257 0.876 -> 0.873 (2048).
# 4 warps: at 8192 4 read 0.000-0.016 above 8 at all eight sizes; at 2048 2 and 4 tied.
# Heavy bodies (softcap, or class weights with smoothing: 127-254 registers at 8192 / 4
# warps, 32-56 at 2048) take the smallest chunk whatever the fill. Kernel alone,
# V = 32768 / 50257 / 131072, 8192 -> 2048 (4 warps): softcap 0.59 / 0.73 / 0.61 -> 0.88 /
# 0.88 / 0.80, weights and smoothing 0.77 / 0.67 / 0.83 -> 0.84 / 0.82 / 0.88, every option
# 0.53 / 0.60 / 0.56 -> 0.78 / 0.73 / 0.72 (4096 / 8 warps: 0.84 and 0.77 at 131072, below
# 2048 at the other two).
BACKWARD_BLOCKS, BACKWARD_FILL, BACKWARD_WARPS = (8192, 4096, 2048), 0.99, 4


# Vocabularies no vector width divides (32001, 50257) go from each row's first 16-byte
# boundary, the classes outside its whole 16-byte pieces one at a time (SHIFT, as softmax's
# long rows); probability targets too (their rows from the same boundary as
# the logits', where their strides agree). Class indices, H200, bf16, M*V = 2^27, kernels
# alone, off / on alternating, forward / backward fraction of copy (2-byte loads -> SHIFT): 32001
# 0.66 / 0.57 -> 0.77 / 0.83, 50257 0.68 / 0.53 -> 0.80 / 0.77, 128257 0.78 / 0.57 -> 0.94 /
# 0.85, 151937 0.79 / 0.57 -> 0.95 / 0.84, 256001 0.80 / 0.57 -> 0.97 / 0.84 (4 runs each at
# 32001 and 50257, 2 elsewhere; two single readings of 0.37 and 0.52 in one run were not
# repeated). ODD_VOCAB_SHIFT False: the 2-byte loads (tune_cross_entropy.py --odd-vocab-shift
# compares the two).
ODD_VOCAB_SHIFT = True
# Where SHIFT starts the slices (cluster.window's `boundary`, bytes): 16 -> 128,
# backward 0.85 -> 0.88 at V = 128257, 0.77 -> 0.79 at 50257; forward 0.946 -> 0.943 and
# 0.80 -> 0.79 (two runs each, alternating).
VOCAB_BOUNDARY_BYTES = {"forward": 16, "backward": 128}


def _block(V, block):
    return min(block, max(16, next_power_of_2(V)))


def _forward_block(V, smoothing, prob_target):
    """The forward's chunk for rows of V classes (FORWARD_BLOCKS)."""
    return _block(V, FORWARD_BLOCKS[-1] if smoothing > 0 or prob_target else FORWARD_BLOCKS[0])


def _heavy_body(weight, smoothing, softcap):
    """Whether the backward's body is heavy (BACKWARD_BLOCKS): softcap, or class weights with
    smoothing."""
    return softcap > 0 or (weight is not None and smoothing > 0)


def _backward_chunks(V, shift, heavy=False):
    """(BLOCK, chunks a row) of the backward for rows of V > 0 classes whose chunks start
    SHIFT-aligned (0: at the row's start; the classes outside them go with chunk 0), for a
    plain or a `heavy` body: see BACKWARD_BLOCKS."""
    sliced = V // shift * shift if shift else V  # what the chunks cover (cluster.window)
    for block in BACKWARD_BLOCKS[-1:] if heavy else BACKWARD_BLOCKS:
        chunk = _block(V, block)
        if sliced >= cdiv(sliced, chunk) * chunk * BACKWARD_FILL or block == BACKWARD_BLOCKS[-1]:
            return chunk, cdiv(sliced, chunk)


def _vectors(V, direction, rows):
    """(ALIGN, SHIFT) of the `direction` kernel's accesses to the rows of `rows` (the row
    tensors it reads or writes): SHIFT where their rows start short of 16-byte alignment
    (ODD_VOCAB_SHIFT: cluster.vector_shift), else ALIGN from the row length and strides."""
    boundary = VOCAB_BOUNDARY_BYTES[direction]
    strides = [t.stride(0) for t in rows]
    shift = cluster.vector_shift(V, *rows, boundary=boundary) if ODD_VOCAB_SHIFT else 0
    return (1 if shift else row_alignment(V, *strides)), shift
