"""Launch plans of norm: which rows take which plan (docs/design.md: the measurement behind each entry)."""

import math
from typing import NamedTuple

from .._core.launch import next_power_of_2, rows_tail, widened_tail
from .._core.tables import Slices, Span, Tiles, UpTo


class Plan(NamedTuple):
    """Rows of up to `limit`: the rows plan (tiles of at least `size` elements, whole rows) or
    the long plan (chunks of `size`), at `warps`."""
    limit: int
    plan: str
    size: int
    warps: int


class TailSpan(NamedTuple):
    """Rows of low < N <= high as a head tile and a tail, at `warps`, `per_sm` an SM."""
    low: int
    high: int
    warps: int
    per_sm: int


class ClusterSlices(NamedTuple):
    """Rows of up to `limit` across a cluster in slices of `block` (None: no cluster there),
    at `warps`; `ahead`: the next row loaded before this row's exchange."""
    limit: int
    block: int
    warps: int
    ahead: bool

# ------------------------------------------------------------------ launch heuristics
# The forward's rows and long plans by kind: (row length up to, plan, size, warps), size the
# rows plan's elements a tile at least (whole rows) or the long plan's chunk. Past the last
# entry: clusters where the GPU has them, else the split plan.
FORWARD_PLANS = {
    "rms": [Plan(512, "rows", 2048, 4), Plan(1024, "long", 1024, 2), Plan(4096, "long", 4096, 8),
            Plan(8192, "long", 8192, 16), Plan(16384, "long", 16384, 8), Plan(24576, "long", 8192, 16),
            Plan(32768, "long", 16384, 8)],
    "rms+residual": [Plan(1024, "rows", 2048, 4), Plan(16384, "rows", 16384, 8), Plan(32768, "rows", 32768, 32)],
    "layer": [Plan(1024, "rows", 2048, 2), Plan(8192, "rows", 8192, 4), Plan(16384, "rows", 16384, 8),
              Plan(24576, "long", 8192, 8), Plan(32768, "long", 16384, 16)]}
# LayerNorm's rows of exactly these lengths: one unmasked chunk of the long plan, at these warps.
LAYER_ONE_CHUNK = {1024: 2, 2048: 4, 4096: 4, 8192: 8, 16384: 8}
# RMSNorm's rows in this span: the row as one chunk of next_power_of_2(N), the table's warps
# scaled to it and halved where the row fills at most 3/4 of it.
RMS_ONE_CHUNK_FILLED = (1024, 8192)
# Rows in these spans by kind, where rows_tail cuts the row in two: one row a program, a head
# tile without a column mask and a widened tail (launch.widened_tail).
ROWS_TAIL = {"layer": (1024, 16384), "rms": (8192, 10240)}
# RMSNorm's narrow rows in this span: one chunk at 32 warps held to 32 registers, so that two
# programs fit an SM.
RMS_ONE_CHUNK = Span(24576, 32768, {"plan": "long", "BLOCK": 32768, "num_warps": 32, "maxnreg": 32})
# LayerNorm's 16-bit rows of even length in this span: the row held as packed words
# (_forward_packed_kernel), the output in 4 parts.
LAYER_PACKED = Span(28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16, "PARTS": 4})
# Past the rows and long plans, where the GPU has clusters: persistent clusters by kind,
# (row length up to, config).
FORWARD_CLUSTER = {"rms": [UpTo(65536, {"BLOCK": 4096, "num_warps": 4}),
                           UpTo(131072, {"BLOCK": 8192, "num_warps": 4}),
                           UpTo(262144, {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128})],
                   "layer": [UpTo(131072, {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128})],
                   # h = x + residual stored before the exchange, the next row loaded ahead
                   "rms+residual": [UpTo(65536, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
                                    UpTo(262144, {"BLOCK": 16384, "num_warps": 8, "AHEAD": True, "HELD": True})]}
# bf16 rows: x held in its 16 bits across the exchange (HELD) frees the registers that load
# the next row's x before this row's exchange (AHEAD).
_LAYER_SLICES_8192_AHEAD = {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128, "AHEAD": True}
_SLICES_32768_AHEAD = {"BLOCK": 32768, "num_warps": 16, "AHEAD": True}
_SLICES_16384_CAPPED_AHEAD = {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128, "AHEAD": True}
FORWARD_CLUSTER_BF16 = {
    "rms": [FORWARD_CLUSTER["rms"][0], UpTo(131072, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
            UpTo(245760, {**_SLICES_32768_AHEAD, "HELD": True}),
            UpTo(262144, {**_SLICES_16384_CAPPED_AHEAD, "HELD": True})],
    "layer": [UpTo(49152, _LAYER_SLICES_8192_AHEAD), UpTo(65536, _SLICES_32768_AHEAD),
              UpTo(131072, _LAYER_SLICES_8192_AHEAD), UpTo(245760, _SLICES_32768_AHEAD),
              UpTo(262144, _SLICES_16384_CAPPED_AHEAD)],
    "rms+residual": FORWARD_CLUSTER["rms+residual"]}
# The backward's rows plans: (row length up to, elements a tile at least, warps, programs
# per SM); past the last entry the long or blocks plan (below).
BACKWARD_ROWS = {"rms": [Tiles(1024, 2048, 4, 4), Tiles(4096, 4096, 8, 2), Tiles(8192, 8192, 32, 1)],
                 "layer": [Tiles(1024, 2048, 4, 4), Tiles(4096, 4096, 8, 2), Tiles(8192, 8192, 16, 1)]}
# The backward as two tiles where rows_tail cuts the row so, without a residual's gradient,
# by kind: (values a thread the tail holds at least, [(row length from, up to, warps,
# programs per SM)]).
BACKWARD_TAIL = {"rms": (4, [TailSpan(4096, 6144, 4, 2), TailSpan(8192, 12288, 8, 1)]),
                 "layer": (8, [TailSpan(2048, 3072, 4, 2), TailSpan(8192, 10240, 8, 1)])}
# The split forward per kind: the writes lag the reads by one round of the persistent grid.
FORWARD_SPLIT = {"rms": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1},
                 "rms+residual": {"plan": "split", "BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2,
                                  "LAG_ROUNDS": 1},
                 "layer": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}}
BACKWARD_LONG = {"plan": "long", "BLOCK": 4096, "num_warps": 16, "PROGRAMS_PER_SM": 2}
# RMSNorm's backward past its rows plan reads x and dy once; LayerNorm keeps the long plan.
BACKWARD_BLOCKS = {"rms": {"plan": "blocks", "ROWS": 32, "BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 4}}
# With the residual's gradient: longer slices on fewer programs past 65536, (row length up
# to, slice, warps, programs per SM).
BACKWARD_BLOCKS_WITH_DH = [Slices(65536, 2048, 4, 4), Slices(131072, 4096, 8, 2), Slices(math.inf, 8192, 16, 1)]
# The backward across a cluster where the GPU has clusters, without a residual's gradient,
# by kind: (first length past which, [(row length up to, slice, warps, AHEAD)]); a slice of
# None: no cluster there.
BACKWARD_CLUSTER = {
    "rms": (8192, [ClusterSlices(16384, 2048, 4, True), ClusterSlices(131072, 8192, 16, True)]),
    "layer": (4096, [ClusterSlices(8192, 1024, 4, True), ClusterSlices(12288, 4096, 8, True),
                     ClusterSlices(16384, 8192, 16, True), ClusterSlices(65536, 4096, 8, True),
                     ClusterSlices(98304, None, None, None), ClusterSlices(131072, 8192, 16, True)])}
# dweight / dbias partial rows summed by columns (_sum_partials_config): every partial in
# one step (PARTS_BLOCK up to MAX_PARTS_BLOCK), at least MIN_BLOCK_N columns a program, and
# for a few long partials TILE / step columns, about PROGRAMS programs.
SUM_PARTIALS = {"PARTS_BLOCK": 32, "MIN_BLOCK_N": 16, "TILE": 4096, "PROGRAMS": 128, "MAX_PARTS_BLOCK": 1024}


def _kind(rms):
    return "rms" if rms else "layer"


def forward_config(N, rms, residual=False, narrow=True, packable=False, clusters=False, bf16=False):
    """The forward's plan for rows of N. narrow: 2-byte x, weight and y, no bias, rows and
    strides multiples of 8 elements (16-byte loads), where RMSNorm's one-chunk plan fits its
    register cap. packable: x, y, weight and bias of one 16-bit dtype, rows of even length
    starting 4-byte aligned (LayerNorm's packed plan). clusters: the GPU runs thread-block
    clusters (_cluster.available). bf16: the row normalised (x, or h = x + residual) is
    bfloat16 (FORWARD_CLUSTER_BF16)."""
    kind = _kind(rms) + ("+residual" if residual else "")
    low, high, one_chunk = RMS_ONE_CHUNK
    if kind == "rms" and narrow and low < N <= high:
        return one_chunk
    low, high, packed = LAYER_PACKED
    if kind == "layer" and packable and low < N <= high:
        return packed
    if kind == "layer" and N in LAYER_ONE_CHUNK:
        return {"plan": "long", "BLOCK": N, "num_warps": LAYER_ONE_CHUNK[N]}
    low, high = ROWS_TAIL.get(kind, (0, 0))
    if low < N <= high:  # the row as two tiles where rows_tail cuts it so
        head, tail = rows_tail(N)
        if tail:
            warps = max(2, head // 1024)
            return {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": widened_tail(tail, warps),
                    "num_warps": warps}
    for limit, plan, size, warps in FORWARD_PLANS[kind]:
        if N > limit:
            continue
        if plan == "long":
            low, high = RMS_ONE_CHUNK_FILLED
            if kind == "rms" and low < N <= min(high, size):  # the row one chunk: warps by the elements in it
                block = next_power_of_2(N)
                size, warps = block, max(1, warps * block // size // (2 if 4 * N <= 3 * block else 1))
            return {"plan": "long", "BLOCK": size, "num_warps": warps}
        block_n = next_power_of_2(N)
        return {"plan": "rows", "BLOCK_M": max(1, size // block_n), "BLOCK_N": block_n, "num_warps": warps}
    for limit, cfg in (FORWARD_CLUSTER_BF16 if bf16 else FORWARD_CLUSTER).get(kind, ()) if clusters else ():
        if N <= limit:
            return {"plan": "cluster", **cfg}
    return FORWARD_SPLIT[kind]


def backward_config(N, rms, dh=False, clusters=False):
    """The backward's plan for rows of N; dh: with a residual's gradient; clusters: the GPU
    runs thread-block clusters (_cluster.available)."""
    values, ranges = BACKWARD_TAIL[_kind(rms)]
    head, tail = rows_tail(N)
    for low, high, warps, per_sm in ranges if tail and not dh else ():
        if low < N <= high:
            return {"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": widened_tail(tail, warps, values),
                    "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    past, across = BACKWARD_CLUSTER[_kind(rms)]
    for limit, block, warps, ahead in across if clusters and not dh and N > past else ():
        if N <= limit:
            if block is None:
                break
            return {"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": ahead}
    for limit, tile, warps, per_sm in BACKWARD_ROWS[_kind(rms)]:
        if N <= limit:
            block_n = next_power_of_2(N)
            return {"plan": "rows", "BLOCK_M": max(1, tile // block_n), "BLOCK_N": block_n, "num_warps": warps,
                    "PROGRAMS_PER_SM": per_sm}
    cfg = BACKWARD_BLOCKS.get(_kind(rms), BACKWARD_LONG)
    if cfg["plan"] == "blocks" and dh:
        block, warps, per_sm = next(entry[1:] for entry in BACKWARD_BLOCKS_WITH_DH if N <= entry[0])
        cfg = {**cfg, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
    return cfg
