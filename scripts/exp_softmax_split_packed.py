"""Experiment (session 14): softmax's split forward (rows past 32768) with both slices it holds
kept as 32-bit words of two 16-bit values, for more programs an SM.

Why: the split forward holds two float32 slices a ticket (the new one from HBM, the lagged
one from L2): at 8192 / 4 warps that is 64 + 64 registers a thread, 4 programs an SM, and it
reaches 0.79-0.80 of copy at 131072 / 262144 (bar 0.94). Occupancy moves it: a variant that
took 149 registers (3 programs an SM) lost 0.09 (session 4), and the per-iteration chain
(ticket, loads, block reductions, publish, poll) is what the programs in flight must cover
(session 12's stall sampling: 32 % at the reductions' barriers, 13 % on memory). As words,
each slice is 32 registers a thread at 8192 / 4 warps; each pass unpacks them again
(`words ^ (zero & bits of the last reduction)`, as the packed plan at 32768), so no float32
copy of a slice lives across a reduction. Then 5-6 programs an SM fit, or 16384-element
slices at 8 warps (half the tickets and waits a row) at 3 programs an SM.

As compiled (sm_90, CPU machine) the words save less than predicted (116 registers against
128: the addresses and loop state take the rest), but a cap of 96 no longer spills (the
float32 form spills 96 bytes there): 5 programs an SM.

Predicted: +0.03-0.06 at 131072 / 262144 with 5-6 programs an SM at 8192 / 4 warps (cap 96 /
80); uncapped 4 an SM equal to the library; 4096 / 4 warps at 6-8 an SM (64 registers) about
the same as 8192 at 5; log_softmax likewise. Registers and spills are printed per config.

Got (session 14, H200, fraction of copy; registers as compiled there, for the real
SLICES_POW2 and specialisations): every packed form lost. softmax at 131072: library 0.791;
packed 8192 / 4 warps 0.633 (139 registers), capped 96 0.535 (40 spilled), capped 80 0.369;
16384 / 8 warps 0.437; 4096 / 4 warps at 8 / 6 an SM 0.758 / 0.724 (64 registers). At
262144: library 0.800; packed 0.745 (116), 0.766 capped 96 with no spill (5 an SM), 0.712
capped 80; 4096 / 4 warps 0.727 / 0.674. log_softmax at 262144 0.804 capped 96 against the
library's 0.815. So a fifth program an SM without a spill gained 0.02 over the same kernel
at four, and the unpacking cost more than that: occupancy is not what holds this plan.

    TRITON_INTERPRET=1 python scripts/exp_softmax_split_packed.py --check
    python scripts/exp_softmax_split_packed.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import copy_bandwidth, experiment, print_fraction

from pintail import _split as split
from pintail._launch import (NEG_INF_BF16_PAIR, NEG_INF_FP16_PAIR, next_power_of_2, pack_pairs,
                             unpack_pairs)

softmax = importlib.import_module("pintail.softmax")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def split_packed_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG, zero,
                        LOG: tl.constexpr, BF16: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # The library's _forward_split_kernel (pintail/softmax.py) with its slices as words.
    WORDS: tl.constexpr = BLOCK // 2
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row = ticket // SLICES
        done = row - LAG
        words = (ticket % SLICES) * WORDS + tl.arange(0, WORDS)
        inside = words < N // 2
        new = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + row * (x_row_stride // 2) + words,
                      mask=inside & (row < M), other=NEG_INF_BF16_PAIR if BF16 else NEG_INF_FP16_PAIR)
        old = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + done * (x_row_stride // 2) + words,
                      mask=inside & (done >= 0), other=0)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            low, high = unpack_pairs(new, BF16)
            slice_max = tl.max(tl.maximum(low, high), axis=0)
            shift = tl.where(slice_max == -float("inf"), 0.0, slice_max)
            low, high = unpack_pairs(new ^ (zero & slice_max.to(tl.int32, bitcast=True)), BF16)
            total = tl.sum(tl.exp2((low - shift) * LOG2E) + tl.exp2((high - shift) * LOG2E), axis=0)
            split.publish(slots_ptr, ticket, slice_max, total)
        if done >= 0:
            maxes, sums, valid = split.wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            row_max = tl.max(tl.where(valid, maxes, -float("inf")), axis=0)
            log2_total = tl.log2(tl.sum(tl.where(valid, sums * tl.exp2((maxes - row_max) * LOG2E), 0.0), axis=0))
            low, high = unpack_pairs(old ^ (zero & log2_total.to(tl.int32, bitcast=True)), BF16)
            y = softmax.packed_output(low, high, row_max, log2_total, LOG, BF16)
            tl.store(y_ptr.to(tl.pointer_type(tl.int32)) + done * (y_row_stride // 2) + words, y, mask=inside)
        ticket = next_ticket


def run_packed(x, log, block, warps, per_sm, cap=None, info=None):
    M, N = x.shape
    y = torch.empty_like(x)
    cfg = {"BLOCK": block, "PROGRAMS_PER_SM": per_sm, "LAG_ROUNDS": 1}
    slices, lag, grid, slots = split.split_plan(M, N, cfg, x.device)
    kernel = split_packed_kernel[grid](x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, 0, LOG=log,
                                       BF16=x.dtype == torch.bfloat16, BLOCK=block,
                                       SLICES_POW2=next_power_of_2(slices), num_warps=warps,
                                       **({"maxnreg": cap} if cap else {}))
    if info is not None and hasattr(kernel, "n_regs"):
        info.append(f"{kernel.n_regs} registers, {kernel.n_spills} spills")
    return y


def library(x, log):
    y = torch.empty_like(x)
    softmax.launch_forward(x, y, log)
    return y


# (slice, warps, programs an SM, register cap). sm_90, compiled on the CPU machine: 116
# registers at 8192 / 4 warps uncapped (the library's float32 form: 128), 96 under a cap of 96
# with no spill (the library's spills 96 bytes there), 80 with a 24-byte spill; 16384 / 8
# warps 128 uncapped, 96 capped; 4096 / 4 warps 64.
CONFIGS = [(8192, 4, 4, None), (8192, 4, 5, 96), (8192, 4, 6, 80), (16384, 8, 2, None), (4096, 4, 8, None),
           (4096, 4, 6, None)]


def check(device):
    cpu = device.type == "cpu"
    configs = [(512, 4, 1, None), (1024, 4, 1, None)] if cpu else CONFIGS
    for dtype in (torch.bfloat16, torch.float16):
        for N in ((2048, 3000) if cpu else (65536, 131072)):
            x = torch.randn(5 if cpu else 64, N, device=device, dtype=dtype) * 4
            x[1, 7] = float("-inf")
            for log in (False, True):
                want = (torch.log_softmax if log else torch.softmax)(x.float(), -1)
                for block, warps, per_sm, cap in configs:
                    got = run_packed(x, log, block, warps, per_sm, cap).float()
                    error = (got - want).abs().nan_to_num(0.0).max().item()
                    scale = want.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).max().item()
                    assert error < 0.01 * scale + 0.01, (dtype, N, log, block, error)
    print(f"every config matches torch ({device.type})", flush=True)


def main():
    check(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for log in (False, True):
        for N in (131072, 262144, 65536):
            x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16)
            nbytes = 2 * x.numel() * 2
            name = "log_softmax" if log else "softmax"
            print_fraction(f"{name} N={N}: library", lambda: library(x, log), nbytes, copy_bw)
            for block, warps, per_sm, cap in CONFIGS if not log else CONFIGS[:3]:
                info = []
                run_packed(x, log, block, warps, per_sm, cap, info)
                print_fraction(f"{name} N={N}: packed {block} / {warps} warps / {per_sm} an SM, cap {cap} "
                               f"({info[0] if info else ''})",
                               lambda: run_packed(x, log, block, warps, per_sm, cap), nbytes, copy_bw)


if __name__ == "__main__":
    experiment(check, lambda: None, main)
