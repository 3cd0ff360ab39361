"""Sweep the cross-entropy launch configurations on a GPU: M = 4096 rows of bf16 logits,
class-index targets, reduction mean (the benchmark protocol's shapes); the forward kernel (the
loss) and the backward kernel (the gradient) launched directly, as fractions of the copy
bandwidth (forward: M*V*elem bytes; backward: read the logits, write the gradient,
2*M*V*elem). At V = 32768 the forward kernel alone measured ~0.85 (74 us in the profiler,
) against the 0.90 bar: one program a row, four chunks of 8192 in an online loop.

    python tools/tune_cross_entropy.py [--sizes 32768,131072] [--default-only]
    python tools/tune_cross_entropy.py --sizes 32001,50257 --odd-vocab-shift   # the default config with
        # ODD_VOCAB_SHIFT off and on, alternating, twice each (odd vocabularies from 16-byte boundaries)
    python tools/tune_cross_entropy.py --directions bwd --sizes 50304,50257,128256,151936 \
        --blocks 8192,4096,2048 --warps 2,4,8   # does the backward's last chunk's fill cost?
    python tools/tune_cross_entropy.py --options weight,softcap ...   # or all: weights, smoothing, z-loss, softcap
    python tools/tune_cross_entropy.py --probs ...   # probability targets (bf16, rows summing to 1): the
        # forward reads x and y (2 tensors), the backward x and y and writes the gradient (3)
"""

import argparse
import itertools

import torch
from op_modules import Op
from measure import copy_bandwidth, print_best, record

ce = Op("cross_entropy")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="32768,131072,262144")
    p.add_argument("--out", default=".", help="unused (accepted so that A/B runners can pass it)")
    p.add_argument("--default-only", action="store_true", help="time the library's default configuration alone")
    p.add_argument("--odd-vocab-shift", action="store_true",
                   help="the default configuration with ce.ODD_VOCAB_SHIFT off and on, alternating, twice each")
    p.add_argument("--directions", default="fwd,bwd")
    p.add_argument("--blocks", default="4096,8192,16384,32768", help="BLOCKs of the sweep")
    p.add_argument("--warps", default="4,8,16", help="warps of the sweep")
    p.add_argument("--options", default="",
                   help="comma list of weight, smoothing (0.1), z_loss (1e-4), softcap (30), or all")
    p.add_argument("--probs", action="store_true", help="probability targets instead of class indices")
    args = p.parse_args()
    sizes = list(map(int, args.sizes.split(",")))
    directions = args.directions.split(",")
    blocks, warps = (list(map(int, a.split(","))) for a in (args.blocks, args.warps))
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    results = []
    library_blocks, library_warps = ce.BACKWARD_BLOCKS, ce.BACKWARD_WARPS
    for V in sizes:
        M = 4096
        x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        if args.probs:
            target = torch.softmax(torch.randn(M, V, device="cuda"), dim=-1).to(x.dtype)
        else:
            target = torch.randint(0, V, (M,), device="cuda")
        tensors = 2 if args.probs else 1  # the row tensors the forward reads (the backward: one more)
        # (weight, ignore_index, smoothing, z_scale, softcap)
        picked = set(args.options.split(",")) if args.options != "all" else {"weight", "smoothing", "z_loss", "softcap"}
        options = ((torch.rand(V, device="cuda") + 0.5).to(x.dtype) if "weight" in picked else None, -100,
                   0.1 if "smoothing" in picked else 0.0, 1e-4 if "z_loss" in picked else 0.0,
                   30.0 if "softcap" in picked else 0.0)
        _, stats, mass, _, denominator = ce._launch_forward(x, target, *options, args.probs, None, "mean")
        grad = torch.ones((), device="cuda", dtype=torch.bfloat16)
        shift = ce._vectors(V, "backward", (x, x, target) if args.probs else (x, x))[1]
        block = ce.backward_chunks(V, shift, ce.heavy_body(options[0], options[2], options[4]))[0]
        default = {"fwd": (ce._forward_block(V, options[2], args.probs), ce.FORWARD_WARPS),
                   "bwd": (block, library_warps)}
        if args.odd_vocab_shift:
            for run, shift in ((1, False), (1, True), (2, False), (2, True)):
                ce.ODD_VOCAB_SHIFT = shift
                label = ("shift" if shift else "2-byte", run)
                _, stats, mass, _, denominator = ce._launch_forward(x, target, *options, args.probs, None, "mean")
                record(results, "fwd", V, label,
                       lambda: ce._launch_forward(x, target, *options, args.probs, None, "mean"),
                       M * V * 2, copy_bw, None)
                record(results, "bwd", V, label,
                       lambda: ce._backward(grad, x, target, options[0], stats, mass, *options[1:], args.probs, None, False,
                                            denominator),
                       2 * M * V * 2, copy_bw, None)
            ce.ODD_VOCAB_SHIFT = False
            sweep = []
        else:
            sweep = [None] if args.default_only else itertools.product(blocks, warps)
        for pair in sweep:  # (BLOCK, warps) for both kernels; None: each kernel's default
            if pair and pair[0] // (32 * pair[1]) > 64:  # more than 64 elements a thread: spills
                continue
            if "fwd" in directions:
                library_forward = ce.FORWARD_BLOCKS, ce.FORWARD_WARPS
                if pair:  # the one chunk, whatever the body
                    ce.FORWARD_BLOCKS, ce.FORWARD_WARPS = (pair[0],), pair[1]
                record(results, "fwd", V, pair or default["fwd"],
                       lambda: ce._launch_forward(x, target, *options, args.probs, None, "mean"),
                       tensors * M * V * 2, copy_bw, default["fwd"])
                ce.FORWARD_BLOCKS, ce.FORWARD_WARPS = library_forward
            if "bwd" in directions:
                if pair:  # the one block, whatever its fill
                    ce.BACKWARD_BLOCKS, ce.BACKWARD_WARPS = (pair[0],), pair[1]
                record(results, "bwd", V, pair or default["bwd"],
                       lambda: ce._backward(grad, x, target, options[0], stats, mass, *options[1:], args.probs, None, False,
                                            denominator),
                       (tensors + 1) * M * V * 2, copy_bw, default["bwd"])
                ce.BACKWARD_BLOCKS, ce.BACKWARD_WARPS = library_blocks, library_warps
        del x
        torch.cuda.empty_cache()
    print_best(results, directions, sizes)


if __name__ == "__main__":
    main()
