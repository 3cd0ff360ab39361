"""Experiment (prepared in session 13 for the next GPU session): softmax's forward with the
whole row held in registers as 32-bit words of two 16-bit values, read once from HBM.

Why: softmax at 16385-32768 runs two passes over each row (the second from L2: 0.85 of
copy at 32768, bar 0.94), because a 32768-element row held as float32 takes 64 registers a
thread at 32 warps: one program an SM (0.68, session 13). A bf16 row is 16 registers a
thread as packed words, and bf16 -> float32 is a 16-bit shift, so the kernel can unpack a
word again wherever it needs its values. What keeps the float32 values alive is the
compiler: it unpacks once and holds the results across the block reductions (52-58
registers). Here each pass unpacks the words again through `words ^ (zero & bits of the
previous reduction)`, with `zero` a runtime 0 the compiler cannot fold, so only the words
live across a reduction: 35 registers at 32768 / 32 warps (32 under maxnreg, no spill),
32 at 16384 / 16 warps (sm_90, compiled on the CPU machine). Two programs of 32 warps an
SM then hold two rows: one read of x, one write of y, no second pass.

Predicted: 0.93-0.96 at 24576-32768 with maxnreg 32 (RMSNorm's forward in the same
occupancy measured 0.96, session 13, with its second read from L1), above the two-pass
plan's 0.85-0.90; without the cap (35 registers: one program an SM) ~0.7.

Got (session 13, H200, fraction of copy): at 32768 the library's two-pass 0.84-0.85,
packed 0.87-0.89 at 32 warps / 32 registers, 0.90 at 16 warps uncapped (58 registers, two
programs an SM); log_softmax 0.92 (both) against 0.86. At 28672 / 30000 packed 16 warps
0.86 / 0.86 against 0.82 / 0.79. Below that the masked quarter costs more than it saves:
0.75 against 0.91 at 24576, 0.63 against 0.81 at 20000; at 16384 0.95 against the rows
plan's 0.95, at 8192 0.89 against 0.96. Taken for 28672-32768 at 16 warps.

    TRITON_INTERPRET=1 python scripts/exp_softmax_packed.py --check
    python scripts/exp_softmax_packed.py [--sizes 28672,32768] [--log]
"""

import importlib

import torch
import triton
from measure import copy_bandwidth, experiment, print_fraction

softmax = importlib.import_module("pintail.softmax")


def launch_packed(x, y, log, warps, max_registers=None):
    """The library's packed kernel (pintail/softmax.py, _forward_packed_kernel; written in this
    script first, moved into the library once measured) at the given warps and register cap."""
    M, N = x.shape
    cap = {"maxnreg": max_registers} if max_registers else {}
    softmax._forward_packed_kernel[(M,)](x, y, N, x.stride(0), y.stride(0), 0, LOG=log,
                                         BF16=x.dtype == torch.bfloat16, BLOCK=triton.next_power_of_2(N),
                                         num_warps=warps, **cap)


def check(device):
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for N in (64, 1000, 4096):
            x = torch.randn(5, N, device=device, dtype=dtype) * 4
            x[1, 3] = float("-inf")
            x[2, :] = float("-inf")  # a row of -inf: NaN, as torch
            x[3, 7] = 1e4 if dtype == torch.bfloat16 else 6e4
            for log in (False, True):
                y = torch.empty_like(x)
                launch_packed(x, y, log, warps=4)
                want = (torch.log_softmax if log else torch.softmax)(x.float(), -1).to(dtype)
                assert torch.allclose(y.float(), want.float(), atol=2e-2, rtol=2e-2, equal_nan=True), (dtype, N, log)
                assert torch.isnan(y[2]).all()
    print(f"packed softmax matches torch ({device.type})", flush=True)


def main():
    import sys
    sizes = [int(v) for v in sys.argv[sys.argv.index("--sizes") + 1].split(",")] if "--sizes" in sys.argv else \
        (8192, 16384, 20000, 24576, 32768)
    log = "--log" in sys.argv
    check(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in sizes:
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        nbytes = 2 * x.numel() * 2
        print_fraction(f"N={N} log={log} library {softmax.forward_config(N, log)}",
                       lambda: softmax.launch_forward(x, y, log), nbytes, copy_bw)
        for warps, cap in ((32, 32), (32, None), (16, 32), (16, None)):
            if triton.next_power_of_2(N) // (32 * warps) // 2 < 4:  # fewer than 4 words a thread
                continue
            print_fraction(f"N={N} log={log} packed, {warps} warps, maxnreg {cap}",
                           lambda: launch_packed(x, y, log, warps, cap), nbytes, copy_bw)


if __name__ == "__main__":
    experiment(check, lambda: None, main)
