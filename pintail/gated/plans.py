"""Launch plans of the gated activations: a (rows x column blocks) grid."""

from .._core.launch import next_power_of_2

# Columns a program: whole 16-byte vectors for every lane at 4 warps (bf16: 8 a lane).
BLOCK, NUM_WARPS = 1024, 4


def block(N: int) -> int:
    return min(BLOCK, max(16, next_power_of_2(N)))
