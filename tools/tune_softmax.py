"""Sweep the softmax launch configurations on a GPU (bf16, M*N = 2^27) and print, per
direction and N, each configuration's fraction of the copy bandwidth. Feeds the tables in
pintail/softmax/plans.py.

    python tools/tune_softmax.py [--out DIR] [--sizes 1024,4096] [--directions fwd,bwd] [--default-only]
                                   [--plans cluster,split] [--log] [--dtype fp16]
"""

import importlib

import torch
from op_modules import Op
from measure import sweep, tune_parser

sm = Op("softmax")
launch = importlib.import_module("pintail._core.launch")


def configs(N, direction):
    out = []
    block_n = 1 << (N - 1).bit_length()
    if N <= 32768:
        for tile in sorted({block_n, 2048, 4096, 8192, 16384, 32768}):
            if tile < block_n:
                continue
            for warps in (2, 4, 8, 16, 32):
                per_thread = tile // (32 * warps)
                if 4 <= per_thread <= 128:
                    out.append({"plan": "rows", "BLOCK_M": tile // block_n, "BLOCK_N": block_n, "num_warps": warps})
    head, tail = launch.rows_tail(N)
    if direction == "fwd" and tail and N > 2048:
        # the row as two tiles (10240 = 8192 + 2048: the rows kernel's TAIL),
        # one row a program, on N lanes rather than a tile of next_power_of_2(N)
        # at 2-16 warps; where the tail holds under 16 bytes a thread (8704 = 8192 + 512 at 4
        # warps: 8-byte loads, 27 barriers on sm_90) also as a tail of 16 bytes a thread, masked
        for warps in (2, 4, 8, 16):
            if 4 <= head // (32 * warps) <= 128:
                out += [{"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": t, "num_warps": warps}
                        for t in sorted({tail, launch.widened_tail(tail, warps)}) if t < head]
    if N < 16384 and N < block_n * 0.99 and direction == "fwd":
        # rows that fill their power-of-two tile less than 0.99 (2560, 3072, 5120, 6144, 12288):
        # the two-pass forward in chunks that fill the row (the second pass reads it from L2;
        # a lead from cross-entropy's backward, where a partly empty chunk cost a program)
        out += [{"plan": "two_pass", "BLOCK": block, "num_warps": warps}
                for block in (512, 1024, 2048, 4096) if N > block and N >= -(-N // block) * block * 0.99
                for warps in (2, 4, 8, 16) if 4 <= block // (32 * warps) <= 32]
    if N >= 16384 and direction == "bwd":
        # own-row backward: (BLOCK, warps, programs per SM); 4096 / 4 warps takes 138 registers
        # (3 per SM fit), 8192 / 8 warps 162 (1 per SM fits; the ticket order makes any grid safe)
        for block, warps, per_sm in ((2048, 4, 6), (4096, 4, 3), (4096, 4, 4), (4096, 8, 3), (4096, 8, 4),
                                     (8192, 8, 1), (8192, 8, 2), (8192, 16, 2), (16384, 16, 1)):
            if 2 <= -(-N // block) <= 64:
                out.append({"plan": "own_row", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm})
    if 16384 <= N <= 65536 and direction == "fwd":
        # 32 warps at 8192 / 16384 and 16 at 4096: 24-32 registers (sm_90), so 2-4 programs of
        # 16-32 warps an SM (RMSNorm gained from such a step)
        out += [{"plan": "two_pass", "BLOCK": block, "num_warps": warps} for block, warps in
                ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (8192, 32), (16384, 32), (4096, 16), (4096, 32))]
    if N >= 8192:
        # across a thread-block cluster (2-16 CTAs a row): (slice, warps), persistent clusters
        # loading the next row ahead, or one cluster a row
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "PERSISTENT": True} for block, warps in
                ((4096, 4), (8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16), (16384, 32), (32768, 16))
                if 2 <= -(-N // block) <= 16]
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "PERSISTENT": False} for block, warps in
                ((2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (8192, 16), (16384, 16), (16384, 32),
                 (32768, 32)) if 2 <= -(-N // block) <= 16]
        # held to fewer registers: softmax's 87 at 8192 / 4 warps fit 5 CTAs an SM, 80 fit 6 (no
        # spill), 72 fit 7 (40 bytes of spill); 16384 / 8 warps: 87 fit 2, 80 fit 3
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "PERSISTENT": False, "maxnreg": cap}
                for block, warps, cap in ((8192, 4, 80), (8192, 4, 72), (16384, 8, 80), (16384, 8, 72), (16384, 8, 64),
                                          (16384, 8, None))
                if 2 <= -(-N // block) <= 16]
    if N >= 16384:
        # (BLOCK, warps, programs per SM): per-SM counts the registers allow
        for block, warps, per_sm in ((8192, 4, 4), (4096, 4, 4), (4096, 4, 6), (8192, 8, 2)):
            for rounds in (0.5, 1, 2):
                out.append({"plan": "split", "BLOCK": block, "num_warps": warps, "LAG_ROUNDS": rounds,
                            "PROGRAMS_PER_SM": per_sm})
    return out


def main():
    p = tune_parser(__doc__)
    p.add_argument("--log", action="store_true", help="log_softmax instead of softmax")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]

    def shape(direction, N, M):
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        y, dy, dx = torch.empty_like(x), torch.randn_like(x), torch.empty_like(x)
        if direction == "fwd":  # the library's own choice for these tensors (the row-shift plan included)
            default, run = sm.planned_forward(x, y, args.log), lambda cfg: sm.launch_forward(x, y, args.log, cfg)
        else:
            default, run = (sm.planned_backward(y, dy, dx, args.log),
                               lambda cfg: sm.launch_backward(y, dy, dx, args.log, cfg))
        return default, configs(N, direction), run, (2 if direction == "fwd" else 3) * M * N * x.element_size()

    sweep(args, shape, "tune_softmax.json")


if __name__ == "__main__":
    main()
