"""What LayerNorm's cluster forward pays against RMSNorm's (session 37: 0.74 against 0.88 at
131072, both at 4 CTAs an SM): the library's cluster kernel for each kind with no affine, a
weight, and a weight and a bias, at the same slices and register cap, kernel alone (H200,
bf16, M * N = 2^27). The bias is a second re-read of the slice's parameters each row
(L1 / L2); LayerNorm's shifted sums are ~2x RMSNorm's instructions an element.

    python scripts/exp_norm_cluster_affine.py   # on the GPU
"""

import torch

from measure import copy_bandwidth, time_ms
from pintail import norm


def main():
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s")
    for N in (65536, 131072):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for rms in (True, False):
            for affine in ("none", "weight", "weight+bias"):
                weight = w if affine != "none" else None
                bias = b if affine == "weight+bias" else None
                for cap in (None, 128):
                    cfg = {"plan": "cluster", "BLOCK": 8192, "num_warps": 4, **({"maxnreg": cap} if cap else {})}
                    ms = time_ms(lambda: norm._forward(x, None, weight, bias, 1e-6, 0.0, rms, x.dtype, cfg))
                    frac = 2 * x.numel() * 2 / (ms * 1e-3) / copy_bw
                    print(f"N={N} {'rms' if rms else 'layer'} {affine} cap={cap}: {ms:.4f} ms {frac:.3f}", flush=True)


if __name__ == "__main__":
    main()
