"""The library's RMSNorm / LayerNorm forward as it would run (its default plan), at a few row
lengths, dtypes and with or without a bias, as fractions of copy (GPU, kernel alone, M*N =
2^27). Lines end "(default)" so that `device_run.sh ab` prints them: for A/B of a plan-table
change across dtypes and options that tune_norm.py (bf16, one option set) does not cover.

    python scripts/ab_norm_forward.py [--sizes 26000,32768] [--layer]
"""

import argparse
import importlib

import torch
from measure import copy_bandwidth, time_ms

norm = importlib.import_module("pintail.norm")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="24577,28672,30000,32768")
    p.add_argument("--layer", action="store_true")
    p.add_argument("--out", default=".")  # taken for device_run.sh's ab mode; nothing is written
    args = p.parse_args()
    rms = not args.layer
    copy_bw = copy_bandwidth()
    for N in (int(s) for s in args.sizes.split(",")):
        for dtype, bias in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False),
                            (torch.float32, False)):
            M = 2**27 // N // (2 if dtype == torch.float32 else 1)
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            w = torch.randn(N, device="cuda", dtype=dtype)
            b = torch.randn(N, device="cuda", dtype=dtype) if bias else None
            ms = time_ms(lambda: norm._forward(x, None, w, b, 1e-6, 0.0, rms, dtype))
            nbytes = 2 * x.numel() * x.element_size()
            print(f"{'rms' if rms else 'layer'} N={N} {str(dtype)[6:]}{' bias' if bias else ''}: {ms:.4f} ms "
                  f"{nbytes / (ms * 1e-3) / copy_bw:.3f} (default)", flush=True)


if __name__ == "__main__":
    main()
