"""Launch plans of softmax: which rows take which plan, with the measurement behind each table entry."""


from .._core import cluster
from .._core.launch import cdiv, next_power_of_2, rows_tail, widened_tail

# ------------------------------------------------------------------ launch heuristics
# Measured on the H200, bf16, M*N = 2^27.
# Rows plan: (row length up to, elements per program at least, warps). Past the last
# entry a row does not fit on chip and takes the split plan.
FORWARD_ROWS = [(1024, 2048, 4), (2048, 2048, 4), (4096, 8192, 16), (8192, 8192, 16), (16384, 16384, 8)]
# Backward rows of 1025-4096 go two a program at 16 warps (two runs each at 4096:
# log_softmax 1.003 / 1.002 against one a program's 0.962 / 0.962, softmax 1.001 / 1.003
# against 1.002 / 1.006).
BACKWARD_ROWS = [(1024, 2048, 4), (4096, 8192, 16), (8192, 8192, 16), (16384, 16384, 4), (32768, 32768, 16)]
# Rows plan, rows whose starts no vector width divides (cluster.vector_shift: an odd length,
# or a stride), past ROWS_SHIFT_PAST: one row a program from the row's first 16-byte
# boundary, its whole 16-byte pieces one slice of BLOCK = next_power_of_2(N // SHIFT * SHIFT),
# its ends a 1-D tensor (_forward_row_shift_kernel), at the warps of the tables (BLOCK up to,
# warps): about 64 elements a thread forward, 32-128 backward. Kernel alone,
# bf16, softmax forward / backward, the rows plan's 2-byte loads -> this plan:
# 385 0.62 / 0.82 -> 0.59 / 0.88, 513 0.61 / 0.81 -> 0.77 / 0.99, 769 0.74 / 0.85 -> 0.95 /
# 0.99, 1001 0.82 / 0.86 -> 0.94 / 0.99, 4097 0.41 / 0.62 -> 0.94 / 0.99, 7001 0.62 / 0.83 ->
# 0.94 / 0.95, 12289 0.42 / 0.59 -> 0.80 / 0.90, 16383 0.46 / 0.62 -> 0.88 / 0.91; 257 lost
# (0.46 / 0.65 -> 0.40 / 0.59). log_softmax alike (backward 0.93-1.00). Slices of 2048 at
# 1 warp and backward past 16384 (GPUs without clusters only) not measured. The slices start
# on 16-byte boundaries (cluster.window's `boundary`). 16 -> 128, alternating,
# two runs each: forward at 12289 0.80 -> 0.78; backward softmax 769-4097 +0.003, 12289
# 0.91 -> 0.92, 16383 0.91 -> 0.88; log_softmax 769 0.99 -> 0.96, 4097 0.99 -> 0.98, 12289
# 0.93 -> 0.88, 16383 0.95 -> 0.945.
# Rows of 1025-8191 that leave their tile part empty (hidden sizes no power of two: 1536,
# 2560, 3072, 5120, 6144, ...) go one a program at 4 warps, either direction, either op: the
# tables above were tuned on full tiles, where their many warps a row won by 0.01; on part
# empty tiles those warps lost up to 0.2. Kernel alone, H200, bf16, softmax
# forward table -> this at 1536 / 2560 / 3072 / 3584 / 5120 / 6144 / 7168: 0.74 / 0.80 / 0.87
# / 0.92 / 0.80 / 0.88 / 0.93 -> 0.97 / 0.96 / 0.96 / 0.95 / 0.96 / 0.95 / 0.94 (the full
# tiles' tables: 4096 0.95, 8192 0.955; this at 4096 / 8192 0.94); backward 0.93 / 0.87 / 0.93
# / 0.99 / 0.88 / 0.94 / 0.99 -> 1.00 at each; log_softmax forward 2560 / 5120 / 6144 0.76 /
# 0.80 / 0.89 -> 0.96 / 0.96 / 0.95, backward 0.94 / 0.90 / 0.96 -> 0.97 / 0.96 / 1.00.
# Full rows of 2048 take the forward table's 4 warps a row (0.97 against two-row tiles' 0.88).
PART_FILLED_ROWS = (1024, 8192, {"BLOCK_M": 1, "num_warps": 4})
# 16-bit rows that leave a tile of 16384 part empty (8193-16383), where the GPU has
# clusters: forward one row a cluster of 8192-element slices (_ONE_ROW_8192 below), 0.944 at
# 12288 against the rows plan's 0.80-0.81 at 4-32 warps (64-128 floats a thread leave few
# rows in flight); backward one row a cluster of 4096 (BACKWARD_CLUSTER's first entry).
# Kernel alone, bf16, rows plan -> this: forward 12288 0.81 -> 0.944, 14336 ->
# 0.952; backward 10240 / 12288 / 14336 0.900 / 0.961 / 0.987 -> 0.994 / 0.989 / 0.995,
# log_softmax's 0.844 / 0.879 / 0.917 -> 0.961 / 0.991 / 0.993. Rows whose starts no vector
# width divides (12289 / 14337, row-shift plan -> this): softmax forward 0.805 /
# 0.847 -> 0.899 / 0.945, backward 0.910 / 0.914 -> 0.993 / 0.993; log_softmax forward
# 0.822 / 0.868 -> ~0.87 / 0.922; log_softmax's backward keeps the row-shift plan (its 8
# warps: 0.975 / 0.983 against the cluster's 0.964 / 0.923).
PART_FILLED_CLUSTER_TILE = 16384
# 16-bit rows of 8193-10240 that are whole 16-byte vectors (length, strides, starts) go
# forward as two tiles (launch.rows_tail: 10240 = 8192 + 2048) one a program at 4 warps,
# the tail at least 1024 (launch.widened_tail), where the cluster of 8192-element slices
# above leaves its second CTA mostly idle. Kernel alone, bf16, 10240, cluster ->
# two tiles: softmax 0.871 -> 0.933, log_softmax 0.825 -> 0.923 (8 warps 0.84 / 0.83: 58
# registers and 11 barriers a row keep fewer bytes in flight). Softmax /
# log_softmax, cluster -> this: 8704 0.80 / 0.74 -> 0.87 / 0.87 (the tail as 512: 0.83 /
# 0.84), 9216 0.82 / 0.77 -> 0.89 / 0.88, 9224 0.78 / 0.72 -> 0.86 / 0.79 (a masked tail;
# 0.76 while the head was masked too: 107 registers, 4 programs an SM where 96 fit 5), 9728
# -> 0.89 / 0.88 (cluster 0.85 / 0.80). Rows whose starts no vector width divides keep the
# cluster's SHIFT.
FORWARD_TWO_TILES = (8192, 10240, {"plan": "rows", "BLOCK_M": 1, "num_warps": 4})
# log_softmax's 16-bit rows of 10241-12288 forward across a cluster of 4096-element slices
# (three fill 12288; two of 8192 fill it 0.75): 12288, 0.894 -> 0.934 (softmax
# 0.925 -> 0.931, kept on 8192).
LOG_FORWARD_CLUSTER_4096 = (10240, 12288, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False})
ROWS_SHIFT_PAST = 512
FORWARD_ROW_SHIFT = [(2048, 1), (4096, 2), (8192, 4), (16384, 8)]
# log_softmax's backward takes 8 warps at slices of 16384 (4 -> 8 warps: 12289
# 0.93 -> 0.97, 16383 0.95 -> 0.98; softmax's 0.90 -> 0.84 and 0.904 -> 0.910, so 4).
BACKWARD_ROW_SHIFT = {False: [(1024, 1), (16384, 4), (32768, 16)],
                      True: [(1024, 1), (8192, 4), (16384, 8), (32768, 16)]}
ROW_SHIFT_BOUNDARY_BYTES = {"forward": 16, "backward": 16}
# Split plan: slice length, warps, persistent programs per SM, and the lag in rounds of
# the persistent grid (one round: the writes trail the reads by as many tickets as there
# are programs, so a row's readers have finished when its writers come, and the lagged
# slices are still in L2; two rounds fell out of L2, half a round waited).
FORWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}
# Two passes over each row, its second read from L2 (eviction hints), between the rows plan
# and the split plan (kernel alone, H200, bf16; split plan 0.80 / 0.81 for softmax /
# log_softmax): softmax 0.78 / 0.90 / 0.85 at N = 16400 / 24576 / 32768 at 8 warps;
# log_softmax 0.91 / 0.86 at 24576 / 32768 at 16 warps, where its 8 warps (48 registers,
# 5 programs per SM where softmax's 54 fit 4) fell to 0.79 at 32768: likely more rows in
# flight than L2 keeps (5 x 132 x 64 KB = 43 MB). Past 32768, two passes of 16384 / 16 warps
# beat the split plan only where the row is whole chunks (softmax / log_softmax 0.83 / 0.85
# against 0.79 / 0.81 at 49152, 0.80-0.81 / 0.82-0.83 against 0.79-0.80 / 0.81 at 65536) and
# lose where it is not (0.73 / 0.77 against 0.78 / 0.80 at 40000); at 131072 they fall to 0.65.
# The gain needs the rows in flight to stay in L2 between the passes, so the limit is in
# bytes a row: float32 rows past the rows plan (16385+ elements, 64 KB+) take the split plan
# (not measured in float32).
FORWARD_TWO_PASS_ROW_BYTES = 65536
# 16-bit rows of even length from 28672 to 32768: the row in registers as packed words
# (_forward_packed_kernel), 16 warps. Kernel alone, H200, bf16,
# against the two-pass plan: softmax 0.86 / 0.86 / 0.90 at 28672 / 30000 / 32768 against
# 0.82 / 0.79 / 0.84-0.85; log_softmax 0.92 at 32768 against 0.86. At 32 warps held to 32
# registers (two programs an SM) 0.83 / 0.83 / 0.87-0.89 (log_softmax 0.92). Shorter rows
# lose to the two-pass plan: 0.75 against 0.91 at 24576, 0.63 against 0.81 at 20000.
FORWARD_PACKED = (28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16})
FORWARD_TWO_PASS = {False: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 8},
                    True: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 16}}  # by log
# Past CLUSTER_PAST elements, where the GPU has thread-block clusters, rows go across a
# cluster as the tables below say (row length up to, the cluster plan's config).
# PERSISTENT: as many clusters as fit at once take the rows in turn, loading the next
# row's slice ahead; else one cluster a row (_forward_cluster_kernel).
CLUSTER_PAST = 16384
# Forward, kernel alone, H200, bf16 (tune_softmax.py --plans cluster,two_pass,rows): one row a cluster of 8192-element slices, 4 warps held to 80 registers (softmax's 87
# fit 5 CTAs an SM, 80 fit 6; log_softmax's take 80 anyway): softmax 0.93 / 0.94-0.95 /
# 0.95 / 0.95 / 0.91 at 20000 / 24576-32768 / 65536 / 131072, against the two-pass plan's
# 0.81-0.91, the packed plan's 0.92 and persistent clusters' 0.87-0.88; log_softmax
# 0.90-0.94. One row a cluster needs no registers for the next row, and the GPU starts a
# cluster where one ended, so the other clusters on an SM hide the exchange. At 262144 it
# falls to 0.60-0.64 (16 x 16384), so persistent clusters of 8 x 32768 / 16 warps (0.87-0.88)
# stay there. Past 65536 (clusters of 9-16 CTAs) each CTA waits for its peers to start only
# once its slice is loaded and summed (LATE_WAIT, two runs each: 0.928 / 0.928
# against 0.910 / 0.919 at 131072); at 32768 the late wait lost 0.007, at 65536 nothing.
# The exps as one FFMA and bf16 widened in one instruction (12.8 -> 11.2 an
# element): 131072 0.923-0.936 -> 0.929-0.942 (log_softmax +0.011), elsewhere unchanged.
_ONE_ROW_8192 = {"BLOCK": 8192, "num_warps": 4, "PERSISTENT": False, "maxnreg": 80}
FORWARD_CLUSTER = [(65536, _ONE_ROW_8192), (131072, {**_ONE_ROW_8192, "LATE_WAIT": True}),
                   (262144, {"BLOCK": 32768, "num_warps": 16, "PERSISTENT": True, "SIDE_ROWS": True})]
# SIDE_ROWS: a CTA of 32768 / 16 warps fills an SM's registers, and the GPCs fit 15 clusters of
# 8 (262144): 12 of 132 SMs idle, and 512 rows take 35 rounds where 34.1 would do. The last
# `side_rows` rows go to the two-pass kernel, launched behind the clusters by programmatic
# dependent launch: each cluster CTA signals at its start, so the side rows' CTAs start while
# the clusters run and find room only on the idle SMs (kernel alone: 0.887 ->
# 0.912 at 262144 with 17 side rows, log_softmax 0.881 -> 0.908; an earlier second stream
# 0.90). Beside the clusters a side row took 69-96 us at 262144 (17-23 rounds of ~4.2 us;
# alone 48-50 us): it must start within SIDE_ROUNDS_A_SLICE rounds a slice of the clusters'
# last; 17-20 side rows on 12 idle SMs gained, 24 lost (SIDE_ROWS_AN_IDLE_SM).
SIDE_ROWS = {"BLOCK": 8192, "num_warps": 8}
SIDE_ROUNDS_A_SLICE = 3
SIDE_ROWS_AN_IDLE_SM = 1.5
# Past 131072 a row whose slices of 32768 it fills less than FORWARD_FILL_BELOW (its last
# slice mostly masked, the CTAs that hold it idle) goes in slices of 16384 / 8 warps, softmax
# only (kernel alone: 0.713 / 0.797 / 0.730 / 0.790 -> 0.802 / 0.851 / 0.773 /
# 0.849 at 135000 / 140000 / 200003 / 200064, fills 0.82-0.87; 170000 0.759 -> 0.751; where
# rows fill 0.92-1.0 the smaller slices won three times and lost four, by up to 0.03).
# log_softmax's 16384 / 8 warps take 176 registers (0.46-0.63), so it keeps 32768.
FORWARD_FILL_BELOW = 0.9
FORWARD_LOW_FILL = {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "PERSISTENT": True}
# float32 (tune_softmax.py --dtype fp32): one row a cluster of 8192 / 8 warps,
# 0.95 at 32768 and 0.96 at 131072, against persistent clusters' 0.89 / 0.91; at 262144
# persistent clusters of 16384 / 32 warps, 0.90 (16 warps 0.89; 32768-element slices spill).
FORWARD_CLUSTER_FP32 = [(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False}),
                        (262144, {"BLOCK": 16384, "num_warps": 32, "PERSISTENT": True})]
# Backward of long rows (H200 sweeps, tools/tune_softmax.py --directions bwd [--log]):
# - softmax: own row, (row length up to, slice, warps, programs per SM); 16-32 slices a row
#   did best (0.83-0.84 at 65536-262144; 64 slices 0.69). Past the last entry a row would
#   need more than 64 slices (_split.py: the own-row plan needs more programs running than
#   half a row's slices) and the lagged plan takes it (0.81 at 262144 with this config).
# - log_softmax: the lagged plan. Its new slice needs dy alone (the partial is sum(dy)), so
#   only dy is re-read from L2: 0.90-0.91 at 131072-262144, against own row's 0.81-0.84.
BACKWARD_OWN_ROW = [(131072, 4096, 4, 4), (524288, 8192, 8, 2)]
# - where the GPU has clusters (CLUSTER_PAST), either op, kernel alone, bf16:
#   one row a cluster of 4096-element slices / 4 warps, 0.99 from 20000 to 32768 and 0.99
#   at 65536 (log_softmax 0.99), against the rows plan's 0.94-0.97 and persistent clusters'
#   0.94-0.95; past 65536 persistent clusters of 16384 / 16 warps loading ahead, 0.96-0.97 at
#   131072 and 262144 (one row a cluster 0.96 at 131072, 0.72-0.79 at 262144), against own
#   row's 0.82 and the lagged plan's 0.90-0.91.
BACKWARD_CLUSTER = [(65536, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False}),
                    (262144, {"BLOCK": 16384, "num_warps": 16, "PERSISTENT": True})]
# float32 rows: one row a cluster of 8192 / 8 warps, 1.01 at 32768 and 131072 (persistent
# clusters of 8192 / 16 warps 0.99; the rows plan not timed in float32); past 131072 the
# own-row plan of 4096 / 4 warps (0.97 at 262144, against 8192 / 8 warps' 0.81 and clusters'
# 0.94): its slices of 16 KB do as well as bf16's 8192-element ones.
BACKWARD_CLUSTER_FP32 = [(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False})]
BACKWARD_OWN_ROW_FP32 = [(262144, 4096, 4, 4), (524288, 8192, 8, 2)]
BACKWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2, "LAG_ROUNDS": 1}
LOG_BACKWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 0.5}


def _config(N, rows_table, split):
    block_n = next_power_of_2(N)
    low, high, part_filled = PART_FILLED_ROWS
    if low < N < block_n <= high:
        return {"plan": "rows", "BLOCK_N": block_n, **part_filled}
    for limit, tile, warps in rows_table:
        if N <= limit:
            return {"plan": "rows", "BLOCK_M": max(1, tile // block_n), "BLOCK_N": block_n, "num_warps": warps}
    return split


def _across_cluster(N, cfg, table, clusters):
    """The cluster plan from `table` (row length up to, config) for rows past CLUSTER_PAST,
    where the GPU runs clusters; else `cfg`."""
    for limit, cluster_cfg in table if clusters and N > CLUSTER_PAST else ():
        if N <= limit:
            return {"plan": "cluster", **cluster_cfg}
    return cfg


def _part_filled_across_cluster(N, cfg, item_size, clusters, cluster_cfg):
    """cluster_cfg for 16-bit rows whose rows plan leaves a tile of PART_FILLED_CLUSTER_TILE
    part empty, where the GPU runs clusters; else cfg."""
    if clusters and item_size == 2 and cfg["plan"] == "rows" and N < cfg["BLOCK_N"] == PART_FILLED_CLUSTER_TILE:
        return {"plan": "cluster", **cluster_cfg}
    return cfg


def forward_config(N, log=False, item_size=2, packable=False, clusters=False, vectors=False):
    """The forward's plan for rows of N elements of item_size bytes; packable: 16-bit rows of
    even length whose rows start 4-byte aligned (the packed plan's words); clusters: the GPU
    runs thread-block clusters (_cluster.available); vectors: the rows are whole 16-byte
    vectors (_whole_vectors)."""
    low, high, two_tiles = FORWARD_TWO_TILES
    if vectors and item_size == 2 and low < N <= high:
        head, tail = rows_tail(N)
        return {**two_tiles, "BLOCK_N": head, "TAIL": widened_tail(tail, two_tiles["num_warps"])}
    low, high, packed = FORWARD_PACKED
    two_pass = N * item_size <= FORWARD_TWO_PASS_ROW_BYTES
    cfg = _config(N, FORWARD_ROWS, FORWARD_TWO_PASS[log] if two_pass else FORWARD_SPLIT)
    if packable and low < N <= high:
        cfg = packed
    cfg = _across_cluster(N, cfg, FORWARD_CLUSTER_FP32 if item_size == 4 else FORWARD_CLUSTER, clusters)
    low, high, log_slices_4096 = LOG_FORWARD_CLUSTER_4096
    cfg = _part_filled_across_cluster(N, cfg, item_size, clusters,
                                      log_slices_4096 if log and low < N <= high else _ONE_ROW_8192)
    if cfg["plan"] == "cluster" and cfg["PERSISTENT"] and item_size == 2 and not log:
        block, unit = cfg["BLOCK"], 16 // item_size  # the slices `cluster.window` cuts
        if N / (cdiv(N // unit * unit, block) * block) < FORWARD_FILL_BELOW:
            return FORWARD_LOW_FILL
    return cfg


def side_rows(M: int, clusters: int, cluster_size: int, sms: int) -> int:
    """Rows of M for the SMs that `clusters` persistent clusters of `cluster_size` CTAs (one
    an SM) leave idle: the most that take rounds off the clusters while no more than
    SIDE_ROWS_AN_IDLE_SM an idle SM run at once and the clusters keep rounds enough for a side
    row (SIDE_ROUNDS_A_SLICE); 0 where none do."""
    most = int((sms - clusters * cluster_size) * SIDE_ROWS_AN_IDLE_SM)
    side = 0
    for rounds in range(cdiv(M, clusters) - 1, SIDE_ROUNDS_A_SLICE * cluster_size - 1, -1):
        rest = M - clusters * rounds
        if rest > most:
            break
        side = rest
    return side


def backward_config(N, log, item_size=2, clusters=False):
    cfg = _across_cluster(N, _config(N, BACKWARD_ROWS, LOG_BACKWARD_SPLIT if log else BACKWARD_SPLIT),
                          BACKWARD_CLUSTER_FP32 if item_size == 4 else BACKWARD_CLUSTER, clusters)
    cfg = _part_filled_across_cluster(N, cfg, item_size, clusters, BACKWARD_CLUSTER[0][1])
    own_row = BACKWARD_OWN_ROW_FP32 if item_size == 4 else BACKWARD_OWN_ROW
    for limit, block, warps, per_sm in own_row if cfg["plan"] == "split" and not log else ():
        if N <= limit:
            return {"plan": "own_row", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    return cfg


def _row_shift_config(N, direction, log, *rows):
    """The row-shift plan of `direction` (forward, backward) for rows of N elements of `rows`
    (the tensors a kernel reads and writes) where the rows plan would move them through
    narrower than 16-byte loads and stores (cluster.vector_shift), past ROWS_SHIFT_PAST; else
    None. Its slice (BLOCK) holds the row's whole pieces between boundaries: at most
    N // SHIFT * SHIFT elements."""
    shift = cluster.vector_shift(N, *rows, boundary=ROW_SHIFT_BOUNDARY_BYTES[direction])
    if N <= ROWS_SHIFT_PAST or not shift:
        return None
    block = next_power_of_2(N // shift * shift)
    table = FORWARD_ROW_SHIFT if direction == "forward" else BACKWARD_ROW_SHIFT[log]
    return {"plan": "row_shift", "BLOCK": block, "SHIFT": shift,
            "num_warps": next(warps for limit, warps in table if block <= limit)}
