"""Sweep the rms_norm / layer_norm launch configurations on a GPU (bf16 unless --dtype, M*N =
2^27, with a weight; LayerNorm with a bias too) and print each one's fraction of the copy bandwidth.
Feeds the tables in pintail/norm/plans.py.

    python tools/tune_norm.py [--out DIR] [--sizes 1024,4096] [--directions fwd,bwd] [--layer | --residual]
                                [--default-only] [--first-stands-out] [--plans cluster,split] [--dtype float16]
                                [--configs JSON list of configs] [--no-stats]
"""

import importlib
import json

import torch
from op_modules import Op
from measure import sweep, tune_parser

norm = Op("norm")
launch = importlib.import_module("pintail._core.launch")


def configs(direction, N, rms):
    out = []
    block_n = 1 << (N - 1).bit_length()
    rows_limit = 32768 if direction == "fwd" else 16384
    if N <= rows_limit:
        for tile in sorted({block_n, 2048, 4096, 8192, 16384}):
            if tile < block_n:
                continue
            for warps in (1, 2, 4, 8, 16, 32):
                per_thread = tile // (32 * warps)
                # up to 128 a thread for one row a tile that the row leaves part empty
                if not 4 <= per_thread <= (128 if tile == block_n > N else 64):
                    continue
                cfg = {"plan": "rows", "BLOCK_M": tile // block_n, "BLOCK_N": block_n, "num_warps": warps}
                if direction == "fwd":
                    out.append(cfg)
                elif tile <= 8192:
                    out += [{**cfg, "PROGRAMS_PER_SM": per_sm} for per_sm in (1, 2, 4)]
    head, tail = norm.rows_tail(N)
    if direction == "fwd" and N <= 32768 and tail:  # the rows plan's row as two tiles
        # one row a program up to 96 values a thread: 9216 at 4 warps (120 registers, 16-byte
        # tail loads, 5 barriers on sm_90) against 8 warps' 8-byte tail and 9 barriers
        for rows in (1, 2, 4):
            for warps in (1, 2, 4, 8, 16):
                if 4 <= rows * (head + tail) // (32 * warps) <= (96 if rows == 1 else 64):
                    # and a tail of 16 bytes a thread, masked, where the row's holds less
                    out += [{"plan": "rows", "BLOCK_M": rows, "BLOCK_N": head, "TAIL": t, "num_warps": warps}
                            for t in sorted({tail, launch.widened_tail(tail, warps)}) if t < head]
    if direction == "bwd" and N <= 16384 and tail:
        for warps in (4, 8, 16, 32):
            if 2 <= (head + tail) // (32 * warps) <= 64:
                out += [{"plan": "rows", "BLOCK_M": 1, "BLOCK_N": head, "TAIL": t, "num_warps": warps,
                         "PROGRAMS_PER_SM": per_sm} for per_sm in (1, 2)
                        # the tail as cut, or widened to 8 or 16 bytes a thread
                        for t in sorted({tail, launch.widened_tail(tail, warps, 4), launch.widened_tail(tail, warps)})
                        if t < head]
    if direction == "fwd" and N <= 32768:  # the long plan with one chunk: pass 2 re-reads the row from L1 / L2
        # (compile's RMSNorm at 32768: one 32768 chunk, 32 warps, 0.94)
        for warps in (1, 2, 4, 8, 16, 32):
            if 4 <= block_n // (32 * warps) <= 64:
                out.append({"plan": "long", "BLOCK": block_n, "num_warps": warps})
    if N < 16384 and N < block_n * 0.99:
        # rows that fill their power-of-two tile less than 0.99 (hidden sizes 1536, 2560,
        # 3072, 5120, 6144, 12288): the long plan in chunks that fill the row (
        # lead from cross-entropy's backward, where a partly empty chunk cost a whole program)
        for block in (512, 1024, 2048, 4096):
            if N >= -(-N // block) * block * 0.99 and N > block:
                for warps in (2, 4, 8, 16):
                    if 4 <= block // (32 * warps) <= 32:
                        out += ([{"plan": "long", "BLOCK": block, "num_warps": warps}] if direction == "fwd" else
                                [{"plan": "long", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
                                 for per_sm in (2, 4)])
    if N >= 16384:
        for block in (4096, 8192, 16384):
            for warps in (8, 16, 32):  # 32: 32 registers at 8192-16384 (2-byte rows), two programs an SM
                if direction == "fwd":
                    out.append({"plan": "long", "BLOCK": block, "num_warps": warps})
                elif block <= 8192:
                    out += [{"plan": "long", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
                            for per_sm in (2, 4)]
    if direction == "bwd" and rms and N >= 16384:
        # registers: 128 at 2048 / 4 warps (166 with the residual's
        # gradient and a bias: 3 per SM), ~64-80 at 1024 / 4 warps; 80 at 2048 / 8 (3 an SM: 24
        # warps against 16) and 64 at 2048 / 16 (2 an SM: 32 warps)
        out += [{"plan": "blocks", "ROWS": rows, "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm}
                for block, warps, per_sm in ((2048, 4, 4), (2048, 4, 3), (1024, 4, 6), (4096, 8, 2), (8192, 16, 1),
                                             (2048, 8, 3), (2048, 16, 2))
                for rows in (16, 32)]
    if direction == "bwd" and N > 1024:
        # across a thread-block cluster (2-16 CTAs a row), with and without the next row ahead
        # (the library's past 8192; 1025-8192 for the hidden sizes' backward:
        # 512 / 2 warps, 8 values a thread as at 1024 / 4, for 1536 / 2560 = 3 / 5 slices)
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": ahead}
                for block, warps in ((512, 2), (1024, 4), (2048, 4), (4096, 8), (8192, 16), (16384, 16), (16384, 32))
                if 2 <= -(-N // block) <= 16
                for ahead in (False, True)]
    if direction == "fwd" and N > 32768:  # across persistent clusters (2-16 CTAs a row; with --residual too)
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps}
                for block, warps in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16))
                if 2 <= -(-N // block) <= 16]
        # capped at the registers that fit one more CTA an SM (LayerNorm's take 159 at 8192 / 4
        # warps: 3 an SM; 128 fits 4, no stack, sm_90 on the CPU); clusters of 10-14 CTAs at
        # one CTA an SM fit one a GPC
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "maxnreg": cap}
                for block, warps, cap in ((8192, 4, 128), (16384, 8, 128), (8192, 8, 64), (4096, 4, 64))
                if 2 <= -(-N // block) <= 16]
    if direction == "fwd" and N > 32768:  # the next row's x loaded ahead, x held in 16 bits
        out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": True, "HELD": True, **cap}
                for block, warps, cap in ((4096, 4, {}), (8192, 4, {"maxnreg": 128}), (8192, 4, {}),
                                          (16384, 8, {"maxnreg": 128}), (16384, 8, {}), (32768, 16, {}))
                if 2 <= -(-N // block) <= 16]
        if rms:  # RMSNorm: ahead without holding x (168 registers uncapped at 8192 / 4 warps)
            out += [{"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": True}
                    for block, warps in ((4096, 4), (8192, 4)) if 2 <= -(-N // block) <= 16]
    if direction == "fwd" and N >= 32768:
        for block, warps in ((4096, 4), (8192, 4), (8192, 8), (16384, 8)):
            out += [{"plan": "split", "BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm,
                     "LAG_ROUNDS": lag} for per_sm in (2, 4) for lag in (0.5, 1)]
    return out


def forward_plan(N, rms, residual, bf16):
    """The forward's plan on a GPU with clusters, from whichever arguments the library takes
    (an A/B's other side may be older: `bf16` and `clusters` came late)."""
    for kwargs in ({"clusters": True, "bf16": bf16}, {"clusters": True}, {}):
        try:
            return norm.forward_config(N, rms, residual, packable=not residual, **kwargs)
        except TypeError:
            continue


def main():
    p = tune_parser(__doc__)
    p.add_argument("--layer", action="store_true", help="layer_norm (weight and bias) instead of rms_norm")
    p.add_argument("--residual", action="store_true",
                   help="rms_norm with a fused residual (the backward: with the residual's gradient dh)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tails", action="store_true", help="the rows plan's two-tile configs alone, and the default")
    p.add_argument("--no-stats", action="store_true",
                   help="forward without storing mean / rstd (as the bench times it: no input requires grad)")
    p.add_argument("--configs", default="",
                   help='only these configs (and the default), a JSON list: \'[{"plan": "cluster", "BLOCK": 32768, ...}]\'')
    p.add_argument("--first-stands-out", action="store_true",
                   help="every row's first value 1000 (LayerNorm's worst case: every row flagged, norm._moments)")
    args = p.parse_args()
    rms = not args.layer
    dtype = getattr(torch, args.dtype)

    def shape(direction, N, M):
        x = torch.randn(M, N, device="cuda", dtype=dtype)
        if args.first_stands_out:
            x[:, 0] = 1000.0
        w = torch.randn(N, device="cuda", dtype=dtype)
        b = None if rms else torch.randn(N, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        _, _, mean, rstd = norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype)
        residual = torch.randn_like(x) if args.residual else None
        dh = residual  # the backward's extra read (any values do)
        candidates = configs(direction, N, rms)
        if args.tails:
            candidates = [cfg for cfg in candidates if "TAIL" in cfg]
        if args.configs:
            candidates = json.loads(args.configs)
        # fwd: x (and residual) in, y (and h) out; bwd: x, dy (and dh) in, dx out
        tensors = (4 if args.residual else 2) if direction == "fwd" else (4 if args.residual else 3)
        if direction == "fwd":
            default = forward_plan(N, rms, args.residual, dtype == torch.bfloat16)
            run = lambda cfg: norm._forward(x, residual, w, b, 1e-6, 0.0, rms, x.dtype, cfg, stats=not args.no_stats)
        else:
            default = norm.backward_config(N, rms, args.residual, clusters=True)
            run = lambda cfg: norm._backward(dy, dh, x, w, not rms, mean, rstd, 0.0, rms, x.dtype, cfg)
        return default, candidates, run, M * N * x.element_size() * tensors

    name = "tune_layer_norm.json" if args.layer else "tune_rms_norm_residual.json" if args.residual else \
        "tune_rms_norm.json"
    sweep(args, shape, name if dtype == torch.bfloat16 else name.replace(".json", f"_{args.dtype}.json"))


if __name__ == "__main__":
    main()
