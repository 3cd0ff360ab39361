"""Sweep the rotary launch configuration on a GPU: q (8, 32, 4096, 128) and k (8, 8, 4096, 128)
bf16, (batch, heads, seq, dim), half-split pairs, the BENCHMARKS.md shape; forward and
backward kernels launched directly (no autograd), as fractions of the copy bandwidth; the
library's configuration first, marked "(default)".

    python scripts/tune_rotary.py [--default-only] [--interleaved]   # GPT-J pairs (2i, 2i + 1)
"""

import importlib
import itertools
import sys

import torch
from measure import copy_bandwidth, rotary_inputs, time_ms

rot = importlib.import_module("pintail.rotary")


def main():
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    interleaved = "--interleaved" in sys.argv
    q, k, cos, sin = rotary_inputs(interleaved)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    nbytes = 2 * 2 * (q.numel() + k.numel())
    default = (rot.TILE_FEATURES, rot.HEADS_PER_STEP, rot.NUM_WARPS)
    sweep = [default] + [c for c in itertools.product((1024, 2048, 4096), (1, 2, 4), (2, 4, 8))
                         if c != default and "--default-only" not in sys.argv]
    for tile, heads, warps in sweep:
        rot.TILE_FEATURES, rot.HEADS_PER_STEP, rot.NUM_WARPS = tile, heads, warps
        for backward in (False, True):
            fn = lambda: rot._launch([(q, q_out), (k, k_out)], cos, sin, None, 2, 0, 128, interleaved, backward)
            ms = time_ms(fn)
            mark = " (default)" if (tile, heads, warps) == default else ""
            print(f"{'bwd' if backward else 'fwd'} tile={tile} heads={heads} warps={warps}: {ms:.4f} ms "
                  f"{nbytes / (ms * 1e-3) / copy_bw:.3f}{mark}", flush=True)


if __name__ == "__main__":
    main()
