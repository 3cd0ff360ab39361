"""Experiment (prepared in session 13 for the next GPU session): the norms' long forward
(two passes over each row, the second from L1 / L2) at 32 warps with chunks of 8192 or
16384, from 16385 to 32768.

Why: RMSNorm's forward at 32768 went from 0.91-0.92 to 0.96 of copy when its programs went
from 3 x 8 warps an SM (16384 chunks, 76 registers) to 2 x 32 (one 32768 chunk held to 32
registers by maxnreg). The tuning sweeps never tried the chunked long plan at 32 warps
(scripts/tune_norm.py: 8 and 16). Compiled for sm_90 on the CPU machine it takes 32
registers there without a cap (2-byte rows; LayerNorm with its bias, RMSNorm with or
without one), so two programs of 1024 threads fit an SM, with no spill and no narrow-row
rule. LayerNorm's long plan runs 16384 chunks at 16 warps (60 registers, 2 programs: 32
warps an SM) for 0.81-0.83 at 32768, bar 0.90; its one-chunk form spilled under the cap.
float32 takes 32-35 registers at 8192 / 32 warps, 46-48 at 16384 / 32.

Predicted: LayerNorm +0.04-0.08 at 24577-32768 with 16384 / 32 warps; RMSNorm at 16384 /
32 warps within 0.01 of the capped one chunk (0.96 at 32768), and with a bias above its
0.87; float32 no better than the library. If so the capped plan and its narrow-row rule go.

    TRITON_INTERPRET=1 python scripts/exp_norm_long_warps.py --check
    python scripts/exp_norm_long_warps.py
"""

import importlib

import torch
from measure import copy_bandwidth, experiment, print_fraction

norm = importlib.import_module("pintail.norm")


def configs(small=False):
    blocks = (1024, 512) if small else (16384, 8192)
    out = [("library", None)]
    for block in blocks:
        for warps in (32, 16):
            out.append((f"long {block} / {warps} warps", {"plan": "long", "BLOCK": block, "num_warps": warps}))
    return out


def cases(N, device, dtypes):
    """(label, rms, x, weight, bias) at rows of N, M*N = 2^27 (float32: 2^26)."""
    for dtype in dtypes:
        M = max(2, 2**27 // N // (2 if dtype == torch.float32 else 1)) if device.type == "cuda" else 3
        x = torch.randn(M, N, device=device, dtype=dtype)
        w = torch.randn(N, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype)
        name = str(dtype)[6:]
        yield f"rms {name}", True, x, w, None
        yield f"rms {name} bias", True, x, w, b
        yield f"layer {name}", False, x, w, b


def reference(rms, x, w, b):
    xf, wf = x.float(), w.float()
    if rms:
        y = torch.nn.functional.rms_norm(xf, (x.shape[1],), wf, 1e-6)
        return y + b.float() if b is not None else y
    return torch.nn.functional.layer_norm(xf, (x.shape[1],), wf, b.float(), 1e-6)


def run(rms, x, w, b, cfg):
    return norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype, config=cfg)[0]


def check(device):
    small = device.type == "cpu"
    for N in ((2500, 2048) if small else (24577, 32768)):
        for label, rms, x, w, b in cases(N, device, (torch.bfloat16, torch.float32)):
            want = reference(rms, x, w, b)
            for name, cfg in configs(small):
                error = (run(rms, x, w, b, cfg).float() - want).abs().max().item()
                assert error < 0.1, (label, N, name, error)
    print(f"every plan matches torch ({device.type})", flush=True)


def main():
    check(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in (20000, 24576, 28672, 32768):
        dtypes = (torch.bfloat16, torch.float32) if N == 32768 else (torch.bfloat16,)
        for label, rms, x, w, b in cases(N, torch.device("cuda"), dtypes):
            for name, cfg in configs():
                print_fraction(f"N={N} {label}: {name}", lambda: run(rms, x, w, b, cfg),
                               2 * x.numel() * x.element_size(), copy_bw)


if __name__ == "__main__":
    experiment(check, lambda: None, main)
