"""Launch plans of rotary: which rows take which plan, with the measurement behind each table entry."""





# ------------------------------------------------------------------ launch heuristics
# Measured on the H200: BLOCK_S tokens per
# program, BLOCK_H heads per step, about TILE_FEATURES rotated features per head tile.
TILE_FEATURES = 2048
HEADS_PER_STEP = 2
NUM_WARPS = 4
