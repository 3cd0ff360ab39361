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

Also LayerNorm at 32768 in softmax's packed form (the row read once and held as words of two
bf16, `layer_packed_kernel` below: 64 registers at 16 warps with the output in 4 parts).

Predicted: LayerNorm +0.04-0.08 at 24577-32768 with 16384 / 32 warps, the packed form
about the same (one HBM read instead of an L1 / L2 re-read; more barriers); RMSNorm at 16384 /
32 warps within 0.01 of the capped one chunk (0.96 at 32768), and with a bias above its
0.87; float32 no better than the library. If so the capped plan and its narrow-row rule go.

Got (session 14, H200, fraction of copy): every 32-warp form lost (RMSNorm 32768: 16384 /
32 warps 0.857 against the library's 0.953; LayerNorm 32768 0.760 against 0.796; float32
level, 0.849 against 0.841). LayerNorm packed, 16 warps, 4 parts: 0.845 against 0.796 (1
part 0.655, 32 warps 0.637): taken into the library for 28672-32768.

    TRITON_INTERPRET=1 python scripts/exp_norm_long_warps.py --check
    python scripts/exp_norm_long_warps.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import copy_bandwidth, experiment, print_fraction

norm = importlib.import_module("pintail.norm")
launch_helpers = importlib.import_module("pintail._launch")


@triton.jit
def layer_packed_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, eps, zero, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    # LayerNorm's forward in softmax's packed form (pintail/softmax.py, _forward_packed_kernel):
    # bf16 rows of N == BLOCK held as words of two values, the exact two-pass statistics from
    # them, then the output in PARTS parts whose weight / bias loads are tied to the previous
    # part's stores (through the runtime zero), so that the words and one part's w and b are
    # all that live at once: 64 registers at 32768 / 16 warps with 4 parts (two programs an
    # SM), 70 with one part (sm_90).
    row = tl.program_id(0).to(tl.int64)
    WORDS: tl.constexpr = BLOCK // 2
    PART: tl.constexpr = WORDS // PARTS
    packed = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (N // 2) + tl.arange(0, WORDS))
    low, high = launch_helpers.unpack_pairs(packed, True)
    mean = tl.sum(low + high, axis=0) / N
    low, high = launch_helpers.unpack_pairs(packed ^ (zero & mean.to(tl.int32, bitcast=True)), True)
    rstd = 1.0 / tl.sqrt(tl.sum((low - mean) * (low - mean) + (high - mean) * (high - mean), axis=0) / N + eps)
    tie = zero & rstd.to(tl.int32, bitcast=True)
    parts = tl.reshape(packed, [PARTS, PART])
    offs = tl.arange(0, PART)
    for p in tl.static_range(PARTS):
        part = tl.sum(tl.where(tl.arange(0, PARTS)[:, None] == p, parts, 0), axis=0)  # row p of the tile
        low, high = launch_helpers.unpack_pairs(part ^ tie, True)
        base = p * PART + tie * 16  # tie * 16: still 64-byte aligned, so the loads stay 16 bytes wide
        w_low, w_high = launch_helpers.unpack_pairs(tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + base + offs), True)
        b_low, b_high = launch_helpers.unpack_pairs(tl.load(b_ptr.to(tl.pointer_type(tl.int32)) + base + offs), True)
        y = launch_helpers.pack_pairs((low - mean) * rstd * w_low + b_low, (high - mean) * rstd * w_high + b_high, True)
        tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + row * (N // 2) + p * PART + offs, y)
        tie = zero & tl.max(y, axis=0)


def layer_packed(x, w, b, warps, parts):
    y = torch.empty_like(x)
    layer_packed_kernel[(x.shape[0],)](x, w, b, y, x.shape[1], 1e-6, 0, BLOCK=x.shape[1], PARTS=parts,
                                       num_warps=warps)
    return y


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
            if label == "layer bfloat16" and N % 2048 == 0:
                for parts in (1, 4):
                    error = (layer_packed(x, w, b, 16, parts).float() - want).abs().max().item()
                    assert error < 0.1, ("layer packed", N, parts, error)
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
            if label == "layer bfloat16" and N == 32768:
                for warps, parts in ((16, 4), (16, 1), (32, 4)):
                    print_fraction(f"N={N} {label}: packed, {warps} warps, {parts} parts",
                                   lambda: layer_packed(x, w, b, warps, parts), 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    experiment(check, lambda: None, main)
