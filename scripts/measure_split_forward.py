"""The norms' split forward (rows past 32768), kernel alone: fraction of copy for RMSNorm
(weight) and LayerNorm (weight and bias), bf16, M*N = 2^27, the library's configs.

    python scripts/measure_split_forward.py     # GPU
"""

import importlib

import torch
from measure import long_rows, print_fraction

norm = importlib.import_module("pintail.norm")


def main():
    for N, M, copy_bw in long_rows(lambda device: None, sizes=(65536, 131072, 262144)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for name, rms, bias in (("rms", True, None), ("layer", False, b)):
            print_fraction(f"N={N} {name} split forward",
                           lambda: norm._forward(x, None, w, bias, 1e-5, 0.0, rms, x.dtype), 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    main()
