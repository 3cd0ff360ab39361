"""Experiment for the next GPU session: the norms' long forward (one program a row, two
passes; RMSNorm's plan at N = 16385-32768) with L2 eviction hints, and at more warp counts.

Why: at N = 32768 RMSNorm's long plan gives 0.86 of copy and torch.compile 0.94; LayerNorm's
rows plan 0.77 (compile 0.79). Session 7's two-pass softmax went from 0.66 to 0.85 at 32768
once its first pass loaded with evict_last and its second with evict_first (same kernel,
8192 / 8 warps), and reached 0.90 at 24576. The library's long kernel has no hints. Its
profile at 32768 (docs/profiles/ncu-rms_fwd-32768-2026-11-30.txt): 43 registers at 16 warps,
2 programs per SM, achieved occupancy 43 %, L2 hit 58 % (the second pass mostly hits), DRAM
77 %. Session 7's own two-pass RMSNorm probe (per-lane sums, a different kernel) with hints
reached only 0.78.

Kernels here: a copy of the library's _forward_long_kernel without the residual, with
HINTS (constexpr) putting evict_last on pass 1's loads and evict_first on pass 2's. Timed
(kernel alone, bf16, M*N = 2^27): the library's default plan, then the copy with and
without hints at (BLOCK, warps) in CONFIGS, for RMSNorm (weight) and LayerNorm (weight,
bias), N = 24576 and 32768. Predicted: hints +0.03-0.05 for RMSNorm at its library config
(its second pass already hits L2, so less than softmax gained); LayerNorm's long plan with
hints passes its rows plan's 0.77 at 32768. If so: the hints go into the library kernel and
LayerNorm's rows plan stops at 16384.

    TRITON_INTERPRET=1 python scripts/exp_norm_long_hints.py    # check against the library, CPU
    python scripts/exp_norm_long_hints.py                       # GPU
"""

import importlib

import torch
import triton
import triton.language as tl

norm = importlib.import_module("pintail.norm")


@triton.jit
def long_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, inv_n, x_row_stride, y_row_stride, eps,
                        RMS: tl.constexpr, HINTS: tl.constexpr, BLOCK: tl.constexpr):
    # The library's long forward (weight, LayerNorm's bias; no residual, no offset), the
    # pass-1 loads marked evict_last and the pass-2 loads evict_first when HINTS.
    row = tl.program_id(0).to(tl.int64)
    first: tl.constexpr = "evict_last" if HINTS else ""
    second: tl.constexpr = "evict_first" if HINTS else ""
    pilot = tl.load(x_ptr + row * x_row_stride).to(tl.float32)
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=first).to(tl.float32)
        if RMS:
            m2 += tl.sum(x * x, axis=0)
        else:  # chunk by chunk (Chan et al.) on x - pilot, as the library
            seen = start * 1.0
            count = tl.minimum(N - start, BLOCK) * 1.0
            shifted = tl.where(mask, x - pilot, 0.0)
            chunk_mean = tl.sum(shifted, axis=0) / count
            chunk_m2 = tl.sum(tl.where(mask, (shifted - chunk_mean) * (shifted - chunk_mean), 0.0), axis=0)
            delta = chunk_mean - mean
            mean += delta * count / (seen + count)
            m2 += chunk_m2 + delta * delta * seen * count / (seen + count)
    if not RMS:
        mean += pilot
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(m2 * inv_n + eps)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0, eviction_policy=second).to(tl.float32)
        y = (x - mean) * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if not RMS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def forward(x, w, b, rms, hints, block, warps, eps=1e-5):
    M, N = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    long_forward_kernel[(M,)](x, w, b if b is not None else w, y, mean, rstd, N, 1.0 / N, x.stride(0), y.stride(0),
                              eps, RMS=rms, HINTS=hints, BLOCK=block, num_warps=warps)
    return y, mean, rstd


def check(device):
    """Both kinds, hints on and off, several chunks a row and a ragged last chunk: the
    library's long plan's outputs and statistics."""
    for M, N, block in ((3, 1000, 256), (2, 4097, 1024), (4, 64, 64)):
        x = torch.randn(M, N, device=device) * 0.5 + 3.0
        w, b = torch.randn(N, device=device), torch.randn(N, device=device)
        cfg = {"plan": "long", "BLOCK": block, "num_warps": 4}
        for rms in (True, False):
            bias = None if rms else b
            want, _, want_mean, want_rstd = norm._forward(x, None, w, bias, 1e-5, 0.0, rms, x.dtype, cfg)
            for hints in (False, True):
                y, mean, rstd = forward(x, w, bias, rms, hints, block, 4)
                torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(rstd, want_rstd, rtol=1e-6, atol=1e-6)
                if not rms:
                    torch.testing.assert_close(mean, want_mean, rtol=1e-6, atol=1e-6)
    print(f"long forward copies match the library ({device})", flush=True)


CONFIGS = ((16384, 16), (8192, 8), (8192, 16), (4096, 8))


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check, sizes=(24576, 32768)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for rms in (True, False):
            kind, bias = ("rms", None) if rms else ("layer", b)
            print_fraction(f"N={N} {kind} library ({norm.forward_config(N, rms, False)['plan']})",
                           lambda: norm._forward(x, None, w, bias, 1e-5, 0.0, rms, x.dtype), 4 * x.numel(), copy_bw)
            for block, warps in CONFIGS:
                for hints in (False, True):
                    print_fraction(f"N={N} {kind} long {block}/{warps} {'hints' if hints else 'none'}",
                                   lambda: forward(x, w, bias, rms, hints, block, warps), 4 * x.numel(), copy_bw)


if __name__ == "__main__":
    main()
