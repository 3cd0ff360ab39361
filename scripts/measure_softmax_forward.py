"""softmax / log_softmax forward at N = 32768, kernel alone: the library's plan (two passes)
against the split plan, bf16, M*N = 2^27, fraction of copy.

    python scripts/measure_softmax_forward.py     # GPU
"""

import importlib

import torch
from measure import long_rows, print_fraction

softmax = importlib.import_module("pintail.softmax")


def main():
    for N, M, copy_bw in long_rows(lambda device: None, sizes=(24576, 32768)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        for log in (False, True):
            for name, cfg in (("library", None), ("split", softmax.FORWARD_SPLIT)):
                print_fraction(f"N={N} {'log_softmax' if log else 'softmax'} {name}",
                               lambda: softmax.launch_forward(x, y, log, cfg), 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    main()
