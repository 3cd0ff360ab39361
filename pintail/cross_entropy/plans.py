"""Launch plans of cross_entropy: which rows take which plan, with the measurement behind each table entry."""

from .._core import cluster
from .._core.launch import row_alignment
from .._loss.plans import class_block

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
# One program, a block of rows per step: in steps of 1024 (a load latency each) the
# reduction of 4096 rows took 6.8 us.
REDUCE_BLOCK, REDUCE_WARPS = 4096, 8
# The backward's chunks (BACKWARD_BLOCKS, backward_chunks) are the shared class-chunk table
# of _loss/plans.py, which the fused heads' gradient kernel also takes.


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


def _forward_block(V, smoothing, prob_target):
    """The forward's chunk for rows of V classes (FORWARD_BLOCKS)."""
    return class_block(V, FORWARD_BLOCKS[-1] if smoothing > 0 or prob_target else FORWARD_BLOCKS[0])


def _vectors(V, direction, rows):
    """(ALIGN, SHIFT) of the `direction` kernel's accesses to the rows of `rows` (the row
    tensors it reads or writes): SHIFT where their rows start short of 16-byte alignment
    (ODD_VOCAB_SHIFT: cluster.vector_shift), else ALIGN from the row length and strides."""
    boundary = VOCAB_BOUNDARY_BYTES[direction]
    strides = [t.stride(0) for t in rows]
    shift = cluster.vector_shift(V, *rows, boundary=boundary) if ODD_VOCAB_SHIFT else 0
    return (1 if shift else row_alignment(V, *strides)), shift
