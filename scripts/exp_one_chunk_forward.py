"""Experiment: torch.compile's form of RMSNorm's forward at N = 32768, and the same form for
softmax and LayerNorm (GPU; --check in the interpreter).

Why: compile's RMSNorm at 32768 measured 0.941 of copy (session 13, exp_compile_kernels.py)
against ours 0.911 (the long plan, two 16384 chunks at 8 warps). Its kernel: one program a
row, the row as one 32768 chunk at 32 warps, pass 1 evict_last, pass 2 re-reads x
evict_first (from L1 / L2). Session 9 put our long kernel in that form and got 0.83-0.88.
The first run of this script wrote compile's kernel out with a runtime N (masked loads):
0.56-0.60 at 32768, 0.73-0.87 at 16384. Compiled for sm_90 on the CPU machine, compile's
kernel (N a constant: the masks fold away) takes 32 registers at 32 warps, so two programs
(2 x 1024 threads) fit an SM; ours in that form 35 (one program an SM), the masked ones 56.
Here ptxas is held to the register count that fits two programs (maxnreg: 32 at 32 warps,
64 at 16; 40 at 16 warps for three), for our long kernel (RMSNorm, LayerNorm) and for the
same one-chunk form of softmax and of LayerNorm with its variance from the deviations in
registers (exact: no flagged rows). Spills: none for RMSNorm at 32, LayerNorm's stack
80-336 bytes.

Predicted: RMSNorm's one chunk at 32 warps / 32 registers ~0.94 (compile's); softmax 0.90+
at 32768 (library 0.85, bar 0.94) if its registers fit as well; LayerNorm gains less (its
spills).

    TRITON_INTERPRET=1 python scripts/exp_one_chunk_forward.py --check
    python scripts/exp_one_chunk_forward.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import experiment, long_rows, print_fraction

from pintail._launch import in_row

norm = importlib.import_module("pintail.norm")
softmax = importlib.import_module("pintail.softmax")

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def softmax_one_chunk(x_ptr, y_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    # The row as one chunk (N <= BLOCK): pass 1 its max and sum of exps from registers,
    # pass 2 the row again (from L1 / L2) and one exp an element. EVEN: N == BLOCK, no masks.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = in_row(cols, N, EVEN)
    x = tl.load(x_ptr + (row * N + cols), mask=mask, other=-float("inf"), eviction_policy="evict_last")
    x = x.to(tl.float32)
    row_max = tl.max(x, axis=0)
    total = tl.sum(tl.exp2((x - row_max) * LOG2E), axis=0)
    shift = row_max + tl.log2(total) / LOG2E
    x = tl.load(x_ptr + (row * N + cols), mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(y_ptr + (row * N + cols), tl.exp2((x - shift) * LOG2E).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_one_chunk(x_ptr, w_ptr, b_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    # The row as one chunk: mean, then the variance from the deviations in registers (exact,
    # no flagged rows), pass 2 the row again.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = in_row(cols, N, EVEN)
    x = tl.load(x_ptr + (row * N + cols), mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / N + eps)
    x = tl.load(x_ptr + (row * N + cols), mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_ptr + (row * N + cols), ((x - mean) * rstd * w + b).to(y_ptr.dtype.element_ty), mask=mask)


def variants(x, w, b, y):
    """(label, function) of every form, for x[M, N] bf16."""
    M, N = x.shape
    block = triton.next_power_of_2(N)
    even = N == block
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)

    def long_kernel(rms, warps, regs):
        cap = {"maxnreg": regs} if regs else {}
        norm._forward_long_kernel[(M,)](x, x, x, w, b, y, mean, rstd, N, 1.0 / N, N, 0, 0, N, 1e-6, 0.0, RMS=rms,
                                        HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=not rms, BLOCK=block,
                                        ONE_CHUNK=True, EVEN=even, ALIGN=1, num_warps=warps, **cap)

    out = []
    for warps, regs in ((32, None), (32, 32), (16, None), (16, 64), (16, 40)):
        tag = f"one chunk, {warps} warps, maxnreg {regs}"
        cap = {"maxnreg": regs} if regs else {}
        out.append((f"rms library's long kernel, {tag}", lambda warps=warps, regs=regs: long_kernel(True, warps, regs)))
        out.append((f"layer library's long kernel, {tag}", lambda warps=warps, regs=regs: long_kernel(False, warps, regs)))
        out.append((f"softmax {tag}", lambda warps=warps, cap=cap: softmax_one_chunk[(M,)](
            x, y, N, BLOCK=block, EVEN=even, num_warps=warps, **cap)))
        out.append((f"layer exact {tag}", lambda warps=warps, cap=cap: layer_one_chunk[(M,)](
            x, w, b, y, N, 1e-6, BLOCK=block, EVEN=even, num_warps=warps, **cap)))
    out.append(("rms library", lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)))
    out.append(("softmax library", lambda: softmax.launch_forward(x, y, False)))
    out.append(("layer library", lambda: norm._forward(x, None, w, b, 1e-6, 0.0, False, x.dtype)))
    return out


def references(x, w, b):
    xf, wf, bf = x.float(), w.float(), b.float()
    N = x.shape[1]
    return {"rms": torch.nn.functional.rms_norm(xf, (N,), wf, 1e-6),
            "softmax": torch.softmax(xf, -1),
            "layer": torch.nn.functional.layer_norm(xf, (N,), wf, bf, 1e-6)}


def check(device):
    for N in (1000, 4096, 2048):
        torch.manual_seed(0)
        x = torch.randn(3, N, device=device, dtype=torch.bfloat16)
        w, b = torch.randn(N, device=device, dtype=torch.bfloat16), torch.randn(N, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        want = references(x, w, b)
        for label, fn in variants(x, w, b, y):
            if label.endswith("library") or (device.type == "cpu" and "maxnreg None" not in label):
                continue
            y.fill_(float("nan"))
            fn()
            error = (y.float() - want[label.split()[0]]).abs().max().item()
            assert error < 0.05, (label, N, error)
    print(f"every form matches torch ({device.type})", flush=True)


def inspect():
    raise SystemExit("no --inspect here")


def main():
    for N, M, copy_bw in long_rows(check, sizes=(16384, 32768)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(N, device="cuda", dtype=torch.bfloat16), torch.randn(N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        for label, fn in variants(x, w, b, y):
            print_fraction(f"N={N} {label}", fn, 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    experiment(check, inspect, main)
