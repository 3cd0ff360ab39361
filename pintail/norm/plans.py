"""Launch plans of norm: which rows take which plan, with the measurement behind each table entry."""

import math

from .._core.launch import next_power_of_2, rows_tail, widened_tail

# ------------------------------------------------------------------ launch heuristics
# The forward's plans per kind, by row length: (row length up to, plan, size, warps), where
# size is the rows plan's elements a tile at least (whole rows, BLOCK_M of them) and the
# long plan's chunk. Past the last entry: the split plan. Measured on the H200 (kernel
# alone, bf16; tools/tune_norm.py.
# - RMSNorm from 513 to 16384: the long plan with the row as one chunk (pass 1 marks its
#   loads evict_last, pass 2 re-reads the row from L1 / L2), as torch.compile's kernel at
#   8192: 0.97 / 0.97 / 0.96 at 1024 / 4096 / 8192 against the rows plan's 0.95 / 0.95 /
#   0.93-0.94 (it holds the tile in registers: fewer warps in flight). Compiled as one known
#   trip (ONE_CHUNK, no loop branches): 0.953 at 8192 (0.927-0.930 as a loop), 0.963 at
#   16384 (the rows plan 0.927-0.931). At 8192 16 warps, as compile's kernel: 0.973-0.977
#   against 8 warps' 0.952 (two runs; the earlier sweeps had 8 ahead). One
#   chunk of 32768 at 32 warps (compile's kernel at 32768) gave ours 0.83-0.88 until held to
#   32 registers: RMS_ONE_CHUNK below. LayerNorm's rows of a power of two: LAYER_ONE_CHUNK.
# - Past 16384 rows do not fit in registers with enough programs per SM: the long plan, with
#   eviction hints: RMSNorm 0.86 / 0.90 / 0.90 at 20000 / 24576 / 32768 (0.83 / 0.86 without
#   hints at 24576 / 32768); LayerNorm 0.79 / 0.79 at 24576 / 32768 (0.70 / 0.67 with every
#   row flagged for the exact statistics), where its rows plan (a 32768-wide tile) gave
#   0.67 / 0.78 (0.65 at 32768 flagged). 16384-element chunks lose where the second is
#   mostly masked (RMSNorm 0.68 / 0.77 at 20000 / 24576). Past 32768 the second read misses
#   L2 and the split plan wins. 16384-element chunks at 8 warps, not 16, since the chunks
#   of whole rows are unmasked (EVEN): RMSNorm 0.87 / 0.87 / 0.85 / 0.90-0.92 at 26000 /
#   28672 / 30000 / 32768 against 0.82 / 0.82 / 0.88 / 0.90; LayerNorm gains at 32768 only
#   (0.83 against 0.81) and loses 0.11-0.17 at 26000-30000, so it keeps 16 warps.
# - RMSNorm with a residual keeps rows in registers to 32768: its long plan reads h back
#   (0.90 / 0.92 of copy at 24576 / 32768, the rows plan 0.96).
FORWARD_PLANS = {
    "rms": [(512, "rows", 2048, 4), (1024, "long", 1024, 2), (4096, "long", 4096, 8), (8192, "long", 8192, 16),
            (16384, "long", 16384, 8), (24576, "long", 8192, 16), (32768, "long", 16384, 8)],
    "rms+residual": [(1024, "rows", 2048, 4), (16384, "rows", 16384, 8), (32768, "rows", 32768, 32)],
    "layer": [(1024, "rows", 2048, 2), (8192, "rows", 8192, 4), (16384, "rows", 16384, 8), (24576, "long", 8192, 8),
              (32768, "long", 16384, 16)]}
# LayerNorm's rows of exactly 1024 / 2048 / 4096 / 8192: one whole chunk of the long plan
# (unmasked), at these warps. Kernel alone, H200, bf16, weight and bias, two runs a size,
# the rows plan above -> one chunk: storing mean / rstd (a training forward) 0.936 /
# 0.923-0.927 / 0.922-0.924 / 0.922-0.925 -> 0.959 / 0.955-0.965 / 0.950-0.954 / 0.951-0.957;
# without them (as the bench times it) 0.949-0.954 / 0.925-0.928 / 0.927 / 0.921 ->
# 0.973-0.975 / 0.973-0.974 / 0.954-0.958 / 0.962-0.968. A part-filled chunk
# (masked) lost to the rows plan at every length measured between (storing
# them): 896 / 1000 / 2000 / 3584 / 4000 / 7168 / 8000 0.92 / 0.93 / 0.94 / 0.92 / 0.94 /
# 0.90 / 0.93 against 0.80-0.92 (its warps halved, or not). Every row flagged (x[0] = 1000)
# costs the one chunk more than the rows plan, a third read from L2 against its registers:
# 0.79-0.80 / 0.79 / 0.90-0.91 / 0.85 against 0.93 / 0.93 / 0.91 / 0.90. 16384 since the
# long kernel stores mean / rstd after pass 2 (74 registers against 100, three programs an
# SM, storing them): 0.934-0.939 against the rows plan's 0.909-0.913 (the one
# chunk stored them first: 0.892-0.894). Every row flagged: not measured at 16384.
LAYER_ONE_CHUNK = {1024: 2, 2048: 4, 4096: 4, 8192: 8, 16384: 8}
# RMSNorm of 1025-8192: the row as one chunk of next_power_of_2(N) (not the table's BLOCK),
# its warps the table's scaled to that chunk, and halved where the row fills at most 3/4 of
# it (hidden sizes no power of two). Kernel alone, H200, bf16, the table's chunk
# and warps -> this: 1536 0.78 (2048 / 8) -> 0.96 (2048 / 2; 4 warps 0.97), 2560 0.87 ->
# 0.95, 3072 0.96 -> 0.96, 5120 0.83 -> 0.96, 6144 0.91 -> 0.96; 7168 keeps 16 warps (0.97,
# 8 warps 0.96); 2048 takes 4 warps (0.97), 4096 and 8192 keep theirs (0.97).
RMS_ONE_CHUNK_FILLED = (1024, 8192)
# LayerNorm of 1025-16384 where rows_tail cuts the row into two tiles (hidden sizes 1536,
# 2560, 3072, 5120, 6144, 10240, 12288): one row a program, BLOCK_N // 1024 warps (at least 2:
# 24-48 values a thread). Its loop computed on every lane of the next_power_of_2(N) tile
# (22 instructions a lane, ~36 a value at 5120: past the issue slots of a copy's pace).
# Kernel alone, H200, bf16, weight and bias, the table's tile -> this: 1536 /
# 2560 / 3072 / 5120 / 6144 / 10240 / 12288: 0.85 / 0.78 / 0.87 / 0.78 / 0.83 / 0.72 / 0.79
# -> 0.94 / 0.93 / 0.94 / 0.93 / 0.93 / 0.92 / 0.93 (best warps: these, or 3072 at 4 +0.007);
# two rows a program lost 0.03-0.4. RMSNorm (no residual) of 8193-10240 likewise (8192 +
# 2048 at 8 warps). Two runs: 10240 0.919 / 0.919 (the long plan's 16384 / 8) ->
# 0.936 / 0.948 (16 warps 0.90, two rows 0.77). The tail takes at least 16 bytes a thread
# (widened, masked: launch.widened_tail) and the head no column mask: kernel alone, the plan
# before -> this: LayerNorm 4352 / 4608 / 8704 / 9216 0.67 / 0.60 / 0.62 / 0.50 -> 0.91 / 0.93
# / 0.85 / 0.875 (9728 0.90 either way); RMSNorm 8704 / 9216 0.853 / 0.880 (long plan) ->
# 0.937 / 0.936 (an earlier 9216 loss was the 1024 tail at 8 warps: 8-byte loads).
ROWS_TAIL = {"layer": (1024, 16384), "rms": (8192, 10240)}
# RMSNorm from 24577 to 32768 with narrow rows (forward_config): the row as one chunk at 32
# warps, ptxas held to 32 registers so that two programs (2 x 1024 threads) fit an SM, as
# torch.compile's kernel at 32768 compiles (its N a constant, 32 registers; ours took 35,
# one program an SM: 0.86). Kernel alone, H200, bf16, against the 16384 / 8 chunks above:
# 0.94 / 0.86-0.94 / 0.956 at 28672 / 30000 /
# 32768 against 0.87 / 0.84 / 0.92; with a bias 0.91 / 0.86-0.88 but 0.64 at 32768 (against
# 0.79 / 0.74 / 0.87: it spills there), float32 0.50-0.53 (against 0.84), and rows of odd
# length (2-byte loads) 0.09 at 24577 (against 0.30): those keep the chunks.
RMS_ONE_CHUNK = (24576, 32768, {"plan": "long", "BLOCK": 32768, "num_warps": 32, "maxnreg": 32})
# LayerNorm of 16-bit rows of even length from 28672 to 32768: the row held as packed words
# (_forward_packed_kernel), 16 warps, the output in 4 parts. Kernel alone, H200, bf16:
# 0.845 at 32768 against the long plan's 0.796.
LAYER_PACKED = (28671, 32768, {"plan": "packed", "BLOCK": 32768, "num_warps": 16, "PARTS": 4})
# Rows past 32768, where the GPU has thread-block clusters: persistent
# clusters (_forward_cluster_kernel), by kind (row length up to, launch config). Kernel alone,
# H200, bf16, a weight (tune_norm.py): RMSNorm 0.89 / 0.88 / 0.83 at 65536 /
# 131072 / 262144 (4096 / 4, 8192 / 4, 16384 / 8 warps) against the split plan's 0.81 / 0.80
# / 0.79; 16 warps a CTA 0.50-0.60. In an experiment
# loading the next row ahead lost (0.84 / 0.80 at 131072 / 262144), and so did one row a
# cluster (0.77 / 0.70). LayerNorm (weight and bias): one exchange of the shifted
# sums a row, capped at 128 registers (159 uncapped: 3 CTAs an SM, 0.66) for 4 CTAs an SM,
# 0.74 / 0.73 at 65536 / 131072 against the split plan's 0.71 / 0.69; at 262144 (16384 / 8
# warps, capped) 0.68, a tie, so the split plan stays there. Each slice's mean and squared
# deviations combined by Chan's formula (two reductions before the exchange) read 0.60-0.68.
# bf16 rows take FORWARD_CLUSTER_BF16 (below) instead, clusters at 262144 too.
# RMSNorm's 16384 / 8 warps is capped at 128 registers: with 10-14 CTAs a
# cluster (rows of 131073-229376) it compiles to 137-142, one CTA an SM, and such clusters
# fit only one a GPC (7 clusters on 53-74 % of the SMs): 0.38-0.48
# kernel alone at 150000-229376, held + ahead 0.60-0.77, against the split plan's 0.79.
# Capped: 121-122 registers, no stack; held + ahead 0.83 / 0.79 / 0.88 there (bf16).
FORWARD_CLUSTER = {"rms": [(65536, {"BLOCK": 4096, "num_warps": 4}), (131072, {"BLOCK": 8192, "num_warps": 4}),
                           (262144, {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128})],
                   "layer": [(131072, {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128})],
                   # RMSNorm with a residual: h = x + residual stored before the
                   # exchange (held in bf16), the next row's x and residual loaded ahead.
                   # Kernel alone, bf16 / fp16 / fp32 against the split plan: 0.870 / - / -
                   # (0.81) at 40008, 0.904 / 0.891 / 0.871 (0.85 / 0.85 / 0.69) at 65536,
                   # 0.922 / 0.909 / - (0.83 / 0.83) at 131072, 0.914 / 0.905 / 0.904 (0.82 /
                   # 0.82 / 0.67) at 262144. Capped at 128 registers it spills (0.40-0.57).
                   "rms+residual": [(65536, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
                                    (262144, {"BLOCK": 16384, "num_warps": 8, "AHEAD": True, "HELD": True})]}
# bf16 rows: x held in its 16 bits across the exchange (HELD) leaves the registers to load
# the next row's x before this row's exchange (AHEAD), so its HBM latency hides under the
# exchange and the stores, where the stall samples put the waits. Kernel alone,
# H200, weight (LayerNorm: and bias), two runs a side, before -> this:
# LayerNorm 0.757 / 0.752 -> 0.780 / 0.787 at 65536 / 131072, 0.693 (split plan) -> 0.760 at
# 262144; RMSNorm 0.830 -> 0.886 at 262144 (at 65536 / 131072 ahead ties). LayerNorm's rows of
# 32769-49152: ahead tied at 40008 (0.746 / 0.744), then won by 0.006-0.063 at
# 34816-47104 (0.702 / 0.733 / 0.774 / 0.754 / 0.764 -> 0.765 / 0.777 / 0.780 /
# 0.773 / 0.771 at 34816 / 36864 / 40960 / 45056 / 47104).
# A sweep of the lengths between these powers of two
# 43": one run a size). LayerNorm takes slices of 32768 / 16 warps at 49153-65536, where
# 16384 / 8 left the last of 4 slices nearly empty (0.61-0.79 -> 0.73-0.82), and at
# 131073-245760, where capped 16384 / 8 makes clusters of 10-15 CTAs that fit few to a GPC
# (0.56-0.72 -> 0.62-0.76); 262144's 16 CTAs of 16384 fit well and keep it. RMSNorm's
# 65537-131072 load the next row ahead without holding x (168 registers, 3 CTAs an SM
# against 4): ahead ties at the powers of two but wins between them (0.81-0.85 -> 0.85-0.89).
# RMSNorm's 131073-245760 take slices of 32768 / 16 warps, x held and the row ahead, as
# LayerNorm's (one run a length: 0.829 / 0.845 / 0.811 / 0.875 -> 0.887 / 0.874
# / 0.819 / 0.877 at 139264 / 163840 / 196608 / 229376: 0.831 / 0.793 / 0.878 ->
# 0.842 / 0.824 / 0.880 at 150000 / 196608 / 229376); at 262144 they tie (0.884 / 0.887).
_LAYER_SLICES_8192_AHEAD = {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128, "AHEAD": True}
_SLICES_32768_AHEAD = {"BLOCK": 32768, "num_warps": 16, "AHEAD": True}
_SLICES_16384_CAPPED_AHEAD = {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128, "AHEAD": True}
FORWARD_CLUSTER_BF16 = {
    "rms": [FORWARD_CLUSTER["rms"][0], (131072, {"BLOCK": 8192, "num_warps": 4, "AHEAD": True}),
            (245760, {**_SLICES_32768_AHEAD, "HELD": True}), (262144, {**_SLICES_16384_CAPPED_AHEAD, "HELD": True})],
    "layer": [(49152, _LAYER_SLICES_8192_AHEAD), (65536, _SLICES_32768_AHEAD), (131072, _LAYER_SLICES_8192_AHEAD),
              (245760, _SLICES_32768_AHEAD), (262144, _SLICES_16384_CAPPED_AHEAD)],
    "rms+residual": FORWARD_CLUSTER["rms+residual"]}
# The backward's rows plans: (row length up to, elements a tile at least, warps, programs
# per SM); past the last entry the long or blocks plan (below).
BACKWARD_ROWS = {"rms": [(1024, 2048, 4, 4), (4096, 4096, 8, 2), (8192, 8192, 32, 1)],
                 "layer": [(1024, 2048, 4, 4), (4096, 4096, 8, 2), (8192, 8192, 16, 1)]}
# The backward as two tiles, one row a tile, where rows_tail cuts the row so, without a
# residual's gradient, by kind: (values a thread the tail holds at least: widened, masked,
# by launch.widened_tail, [(row length from, up to, warps, programs per SM)]). RMSNorm at
# 4097-6144 (4096 + a tail) and 8193-12288 (8192 + a tail). Kernel alone, H200,
# bf16, weight (tune_norm.py --tails), the default -> this: 5120 / 6144 0.70 / 0.78 (8192 /
# 32 warps) -> 0.87 / 0.87 (4 warps, 2 an SM; 8-32 warps 0.69-0.75); 10240 / 12288 0.82 /
# 0.81 (across a cluster) -> 0.835 / 0.86 (8 warps, 1 an SM). Lost at 1536 / 2560 / 3072.
# LayerNorm's tiles lost while the head kept its column mask (9728 0.673 ->
# 0.565); since the kernel's head has none, same table, kernel alone, bf16:
# LayerNorm (weight and bias) the cluster / rows plan -> two tiles 2560 0.675 -> 0.690,
# 3000 0.727 -> 0.740, 8704 0.625 -> 0.710, 9216 0.654 -> 0.731, 9728 0.675 -> 0.745; tails
# of 8 values a thread beat 4 (9000: 0.695 against 0.568). RMSNorm's tail of 4 values a
# thread beats 8 (4608 0.874 against 0.857, 9216 0.841 against 0.805) and the tail as cut
# (8704 0.831 against 0.756); the head unmasked alone took RMSNorm's 9000 from 0.670 to 0.845.
BACKWARD_TAIL = {"rms": (4, [(4096, 6144, 4, 2), (8192, 12288, 8, 1)]),
                 "layer": (8, [(2048, 3072, 4, 2), (8192, 10240, 8, 1)])}
# The split forward per kind; with a residual (twice the bytes per slice, 196 registers at
# 4 warps) RMSNorm takes 8 warps, 2 programs per SM. A lag under one round of the grid
# waits: 0.65 against 0.82 at N = 262144; LayerNorm's half-round lag measured 0.51 there
# once, a full round 0.67. LayerNorm at 4 warps takes 128 registers (4 per SM)
# now that slices stay in bf16 until used: 0.73-0.75 of copy alone, against 0.68-0.70 at its
# former 8 warps (80 registers: 3 per SM where 4 were counted).
FORWARD_SPLIT = {"rms": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1},
                 "rms+residual": {"plan": "split", "BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 2,
                                  "LAG_ROUNDS": 1},
                 "layer": {"plan": "split", "BLOCK": 8192, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}}
BACKWARD_LONG = {"plan": "long", "BLOCK": 4096, "num_warps": 16, "PROGRAMS_PER_SM": 2}
# RMSNorm past its rows plan: x and dy read once (0.60-0.64 of copy against the long plan's
# 0.56 at N = 32768-262144). LayerNorm keeps the long
# plan: its blocks kernel (two sums a row, the mean) measured 0.42-0.49 at 168-176 registers,
# and 0.40-0.52 with the two sums as one reduction at 96-162 (branch next/layer-blocks).
BACKWARD_BLOCKS = {"rms": {"plan": "blocks", "ROWS": 32, "BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 4}}
# With the residual's gradient dh (a third read; 166 registers at 2048 / 4 warps, so 3
# programs per SM where 4 are counted), longer slices on fewer programs past 65536 (kernel
# alone, H200, bf16): 0.70 at 131072 (4096 / 8 warps, 2 per SM; 0.39 at 262144) and 0.66 at
# 262144 (8192 / 16 warps, 1 per SM), against 0.53 for the config above; at 65536 that one
# stays best (0.73 against 0.71 / 0.66). (row length up to, slice, warps, programs per SM).
BACKWARD_BLOCKS_WITH_DH = [(65536, 2048, 4, 4), (131072, 4096, 8, 2), (math.inf, 8192, 16, 1)]
# Rows without a residual's gradient past a length by kind (RMSNorm 8192, LayerNorm 4096) go
# across a thread-block cluster where the GPU has clusters (_backward_cluster_kernel):
# (first length past which, [(row length up to, slice, warps, AHEAD)]). Kernel alone, H200,
# bf16 (tune_norm.py, the next row loaded ahead in every entry): RMSNorm 0.81 /
# 0.82 / 0.78 / 0.81 at 12288 / 16384 / 24576 / 32768 against the blocks plan's 0.63 at 16384
# (without loading ahead at most 0.77 / 0.70); LayerNorm 0.74 / 0.77 / 0.74 / 0.74 against
# the long plan's 0.56. Past 32768 (clusters of up to 16): RMSNorm 0.80 / 0.76 at
# 65536 / 131072 with 8192 / 16 warps against the blocks plan's 0.66 / 0.61; LayerNorm 0.72
# at 65536 (4096 / 8 warps) and 0.67 at 131072 (8192 / 16) against the long plan's 0.54. At
# 262144 (slices of 16384) both lose (0.55 against 0.60, 0.27 against 0.53), so the blocks
# and long plans stay there. LayerNorm at 4097-8192 (its rows plan holds such a
# row in one tile of 8192 / 16 warps, 5120 filling 62 % of it): slices of 1024 / 4 warps
# 0.751 / 0.749 / 0.761 at 5120 / 6144 / 8192 against 0.614 / 0.661 / 0.740 (A/B,
# two runs a side: 0.59 / 0.62 / 0.66 / 0.70 / 0.74 -> 0.70 / 0.75 / 0.75 / 0.76 / 0.76 at
# 4608 / 5120 / 6144 / 7168 / 8192); at 2560 / 3072
# / 4096 the rows plan stays (0.673 / 0.734 / 0.861 against 0.663 / 0.766 / 0.779), and so
# does RMSNorm's (its two tiles at 5120 / 6144 0.87 against 0.85). The residual's gradient is
# not measured. LayerNorm's clusters of 9-12 slices of 8192 (65537-98304, one
# run a length) read 0.44-0.53 against the long plan's 0.54-0.55, and 0.60 against 0.53 at
# 114688 (14): a slice of None means no cluster there. RMSNorm's blocks plan ties its
# cluster over 65537-98304 (0.58 on average, each point within 0.07 either way).
BACKWARD_CLUSTER = {"rms": (8192, [(16384, 2048, 4, True), (131072, 8192, 16, True)]),
                    "layer": (4096, [(8192, 1024, 4, True), (12288, 4096, 8, True), (16384, 8192, 16, True),
                                     (65536, 4096, 8, True), (98304, None, None, None), (131072, 8192, 16, True)])}
# dweight / dbias partial rows summed by columns (_sum_partials_config). Past 32 partials
# (short rows: a partial row a persistent program, up to 8 an SM) every partial in one step
# (PARTS_BLOCK, up to 1024), 16 columns a program, 8 warps past 128 partials (at most 64
# values a thread a gradient). Each step of the loop is a round trip to L2, and the step of
# 32 partials made LayerNorm's 528 at 1024 a chain of 17: 17 us of its 219 us backward
# (RMSNorm 8 of 204). H200, the sum alone (profiler), steps of 32 -> one step,
# 16 columns a program both: LayerNorm 528 x 1024 12.4 -> 3.0 us, 264 x 4096 7.8 -> 3.4,
# 107 x 8192 5.1 -> 2.8; RMSNorm 528 x 1024 6.9 -> 2.2, 132 x 8192 3.6 -> 2.8; the backward
# alone: LayerNorm 0.84 -> 0.895 at 1024. Up to 32 partials (long rows: a partial row a
# cluster) one step of next_power_of_2(parts) too, and TILE / step columns a program, about
# PROGRAMS of them or more: LayerNorm's 4 partials at 262144 go as 4 x 1024, where a step of
# 32 x 128 was 7 / 8 masked (13.4 us of its 350 us backward). The backward alone,
# two runs a side: LayerNorm 0.535 -> 0.547 / 0.666 -> 0.674 at 262144 / 131072, RMSNorm
# 0.598 -> 0.608 / 0.761 -> 0.770.
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
