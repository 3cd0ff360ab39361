"""Launch plans of softmax: which rows take which plan (docs/design.md: the measurement behind each entry)."""

from typing import NamedTuple

from .._core import cluster
from .._core.launch import cdiv, next_power_of_2, rows_tail, widened_tail
from .._core.tables import Slices, Span, UpTo


class RowTiles(NamedTuple):
    """Rows of up to `limit` in tiles of at least `tile` elements (whole rows), at `warps`."""
    limit: int
    tile: int
    warps: int


class Warps(NamedTuple):
    """Slices of up to `limit` elements at `warps`."""
    limit: int
    warps: int

# ------------------------------------------------------------------ launch heuristics
# Measured on the H200, bf16, M*N = 2^27.
# Rows plan: (row length up to, elements per program at least, warps). Past the last
# entry a row does not fit on chip and takes the split plan.
FORWARD_ROWS = [RowTiles(1024, 2048, 4), RowTiles(2048, 2048, 4), RowTiles(4096, 8192, 16), RowTiles(8192, 8192, 16),
                RowTiles(16384, 16384, 8)]
# Backward rows of 1025-4096 go two a program at 16 warps.
BACKWARD_ROWS = [RowTiles(1024, 2048, 4), RowTiles(4096, 8192, 16), RowTiles(8192, 8192, 16), RowTiles(16384, 16384, 4),
                 RowTiles(32768, 32768, 16)]
# Rows whose starts no vector width divides (cluster.vector_shift), past ROWS_SHIFT_PAST: one
# row a program from its first 16-byte boundary, its whole pieces one slice, its ends apart
# (_forward_row_shift_kernel), at the warps of FORWARD_ROW_SHIFT / BACKWARD_ROW_SHIFT.
# Rows in this span that leave their tile part empty: one a program at 4 warps, either
# direction, either op.
PART_FILLED_ROWS = Span(1024, 8192, {"BLOCK_M": 1, "num_warps": 4})
# 16-bit rows that leave a tile of this size part empty, where the GPU has clusters: one row
# a cluster (forward: _ONE_ROW_8192; backward: BACKWARD_CLUSTER's first entry).
PART_FILLED_CLUSTER_TILE = 16384
# 16-bit rows in this span that are whole 16-byte vectors: two tiles (launch.rows_tail), one
# row a program, where a cluster of 8192-element slices leaves its second CTA mostly idle.
FORWARD_TWO_TILES = Span(8192, 10240, {"plan": "rows", "BLOCK_M": 1, "num_warps": 4})
# log_softmax's 16-bit rows of 10241-12288 forward across a cluster of 4096-element slices
# (three fill 12288; two of 8192 fill it 0.75): 12288, 0.894 -> 0.934 (softmax
# 0.925 -> 0.931, kept on 8192).
LOG_FORWARD_CLUSTER_4096 = Span(10240, 12288, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False})
ROWS_SHIFT_PAST = 512
FORWARD_ROW_SHIFT = [Warps(2048, 1), Warps(4096, 2), Warps(8192, 4), Warps(16384, 8)]
# log_softmax's backward takes 8 warps at slices of 16384 (4 -> 8 warps: 12289
# 0.93 -> 0.97, 16383 0.95 -> 0.98; softmax's 0.90 -> 0.84 and 0.904 -> 0.910, so 4).
BACKWARD_ROW_SHIFT = {False: [Warps(1024, 1), Warps(16384, 4), Warps(32768, 16)],
                      True: [Warps(1024, 1), Warps(8192, 4), Warps(16384, 8), Warps(32768, 16)]}
ROW_SHIFT_BOUNDARY_BYTES = {"forward": 16, "backward": 16}
# Split plan: slice length, warps, persistent programs per SM, and the lag in rounds of
# the persistent grid (one round: the writes trail the reads by as many tickets as there
# are programs, so a row's readers have finished when its writers come, and the lagged
# slices are still in L2; two rounds fell out of L2, half a round waited).
FORWARD_SPLIT = {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}
# Two passes over each row, the second read from L2, for rows of up to this many bytes past
# the rows plan: the rows in flight must stay in L2 between the passes.
FORWARD_TWO_PASS_ROW_BYTES = 65536
# 16-bit rows of even length in this span: the row in registers as packed words.
FORWARD_PACKED = Span(28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16})
FORWARD_TWO_PASS = {False: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 8},
                    True: {"plan": "two_pass", "BLOCK": 8192, "num_warps": 16}}  # by log
# Past CLUSTER_PAST elements, where the GPU has thread-block clusters, rows go across a
# cluster as the tables below say (row length up to, the cluster plan's config).
# PERSISTENT: as many clusters as fit at once take the rows in turn, loading the next
# row's slice ahead; else one cluster a row (_forward_cluster_kernel).
CLUSTER_PAST = 16384
# Forward, where the GPU has clusters: one row a cluster of 8192-element slices to 131072
# (late wait past 65536), persistent clusters of 8 x 32768 at 262144.
_ONE_ROW_8192 = {"BLOCK": 8192, "num_warps": 4, "PERSISTENT": False, "maxnreg": 80}
FORWARD_CLUSTER = [UpTo(65536, _ONE_ROW_8192), UpTo(131072, {**_ONE_ROW_8192, "LATE_WAIT": True}),
                   UpTo(262144, {"BLOCK": 32768, "num_warps": 16, "PERSISTENT": True, "SIDE_ROWS": True})]
# SIDE_ROWS: the last `side_rows` rows go to the two-pass kernel on the SMs that persistent
# clusters of 8 leave idle, launched behind them by programmatic dependent launch.
SIDE_ROWS = {"BLOCK": 8192, "num_warps": 8}
SIDE_ROUNDS_A_SLICE = 3
SIDE_ROWS_AN_IDLE_SM = 1.5
# Softmax rows past 131072 that fill their slices of 32768 less than this: slices of 16384.
FORWARD_FILL_BELOW = 0.9
FORWARD_LOW_FILL = {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "PERSISTENT": True}
# float32 (tune_softmax.py --dtype fp32): one row a cluster of 8192 / 8 warps,
# 0.95 at 32768 and 0.96 at 131072, against persistent clusters' 0.89 / 0.91; at 262144
# persistent clusters of 16384 / 32 warps, 0.90 (16 warps 0.89; 32768-element slices spill).
FORWARD_CLUSTER_FP32 = [UpTo(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False}),
                        UpTo(262144, {"BLOCK": 16384, "num_warps": 32, "PERSISTENT": True})]
# Softmax's backward of long rows without clusters: own row, (row length up to, slice,
# warps, programs per SM); past the last entry the lagged plan. log_softmax: the lagged plan.
BACKWARD_OWN_ROW = [Slices(131072, 4096, 4, 4), Slices(524288, 8192, 8, 2)]
# The backward where the GPU has clusters: one row a cluster to 65536, persistent clusters
# loading ahead past it.
BACKWARD_CLUSTER = [UpTo(65536, {"BLOCK": 4096, "num_warps": 4, "PERSISTENT": False}),
                    UpTo(262144, {"BLOCK": 16384, "num_warps": 16, "PERSISTENT": True})]
# float32 rows: one row a cluster of 8192 / 8 warps, 1.01 at 32768 and 131072 (persistent
# clusters of 8192 / 16 warps 0.99; the rows plan not timed in float32); past 131072 the
# own-row plan of 4096 / 4 warps (0.97 at 262144, against 8192 / 8 warps' 0.81 and clusters'
# 0.94): its slices of 16 KB do as well as bf16's 8192-element ones.
BACKWARD_CLUSTER_FP32 = [UpTo(131072, {"BLOCK": 8192, "num_warps": 8, "PERSISTENT": False})]
BACKWARD_OWN_ROW_FP32 = [Slices(262144, 4096, 4, 4), Slices(524288, 8192, 8, 2)]
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
