"""Experiment for the next GPU session: softmax's split forward (pintail/softmax.py,
`_forward_split_kernel`, 0.79-0.80 of copy past 32768) with its reductions kept inside
warps.

Why: Nsight's stall sampling by instruction (session 12,
docs/profiles/stalls-by-instruction-2026-12-01.txt) put 31.7 % of the split kernel's stall
samples on barriers, 19.5 % at the one shared-memory load that reads a block reduction's
result after its `bar.sync`. A ticket does five block-wide reductions: the new slice's max
and sum, the poll's count of missing words, and the lagged row's max and sum of the
partials. Here the slice, loaded as the library loads it, is reshaped to [repeats, WARPS,
32 * VEC]: the way Triton spreads a 1-D tile over the warps (checked by `--inspect`: the
reshaped layout has warpsPerCTA [1, WARPS, 1], no conversion), so that:
  - each warp reduces its own part of the slice (shuffles, no barrier) and publishes its own
    (max, sum) word: WARPS words a slice;
  - the poll, the row's max and the row's sum are one block reduction (a poll's loop
    condition is one scalar, so one block reduction a poll stays).
Five block reductions a ticket become one, done with tl.reduce over (missing words, max,
sum) with the online softmax's combine (the SASS: ~6 barriers a ticket against ~9, the
ticket's broadcast and the publish's layout change among them). Predicted: 0.85-0.92 at
N = 131072 / 262144 if the barriers are what holds the kernel; if not (0.78-0.80 again),
the limit is the per-ticket chain itself (the ticket atomic, the loads, the poll's round
trip). Got (session 13, H200): 0.65-0.73 at 32768-262144 over six configs (best 4096 / 4
warps / 6 per SM), against the library's 0.79-0.85: lost.

    TRITON_INTERPRET=1 python scripts/exp_softmax_warp_partials.py --check   # the interpreter, CPU
    python scripts/exp_softmax_warp_partials.py --inspect                     # layouts, registers, barriers (sm_90, CPU)
    python scripts/exp_softmax_warp_partials.py                               # GPU: check, then time
"""

import importlib
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

softmax = importlib.import_module("pintail.softmax")
split = importlib.import_module("pintail._split")
launch_module = importlib.import_module("pintail._launch")

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _combine(zeros_a, max_a, sum_a, zeros_b, max_b, sum_b):
    """Two (missing words, max, sum of exp(x - max)) into one: the online softmax's step."""
    row_max = tl.maximum(max_a, max_b)
    shift = tl.where(row_max == -float("inf"), 0.0, row_max)  # both -inf: sums 0, not NaN
    return (zeros_a + zeros_b, row_max,
            sum_a * tl.exp2((max_a - shift) * LOG2E) + sum_b * tl.exp2((max_b - shift) * LOG2E))


@triton.jit
def warp_split_kernel(x_ptr, y_ptr, slots_ptr, M, N, x_row_stride, y_row_stride, SLICES, LAG,
                      BLOCK: tl.constexpr, WARPS: tl.constexpr, VEC: tl.constexpr, WORDS_POW2: tl.constexpr):
    # The library's split forward (softmax, not log). slots[0]: the next ticket;
    # slots[1 + WARPS * t + w]: warp w's (max, sum) over its part of ticket t's slice.
    LANES: tl.constexpr = 32 * VEC  # elements a warp covers per load
    word = tl.arange(0, WORDS_POW2)
    words_in_row = SLICES * WARPS
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row = ticket // SLICES
        done = row - LAG
        cols = (ticket % SLICES) * BLOCK + tl.arange(0, BLOCK)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M),
                        other=-float("inf")).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0), other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")

        if row < M:
            # The slice as [repeats, warps, lanes * VEC], the way a 1-D tile is spread over the
            # warps: each warp's max and sum of exp(x - max) without leaving the warp.
            parts = tl.reshape(x_new, [BLOCK // (WARPS * LANES), WARPS, LANES])
            part_max = tl.max(tl.max(parts, axis=2), axis=0)
            shift = tl.where(part_max == -float("inf"), 0.0, part_max)
            part_sum = tl.sum(tl.sum(tl.exp2((parts - shift[None, :, None]) * LOG2E), axis=2), axis=0)
            hi = part_max.to(tl.int32, bitcast=True).to(tl.int64) << 32
            lo = part_sum.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            tl.atomic_xchg(slots_ptr + 1 + ticket * WARPS + tl.arange(0, WARPS), hi | lo, sem="relaxed")

        if done >= 0:
            # One block reduction a poll: the missing words, and the row's max and sum with them.
            valid = word < words_in_row
            ptrs = slots_ptr + 1 + done * words_in_row + word
            missing, row_max, total = 1, 0.0, 1.0  # (loop-carried: defined before the loop)
            while missing > 0:
                words = tl.load(ptrs, mask=valid, other=1, volatile=True)
                maxes = tl.where(valid, (words >> 32).to(tl.int32).to(tl.float32, bitcast=True), -float("inf"))
                sums = tl.where(valid, words.to(tl.int32).to(tl.float32, bitcast=True), 0.0)
                missing, row_max, total = tl.reduce(((words == 0).to(tl.int32), maxes, sums), 0, _combine)
            y = tl.exp2((x_old - row_max) * LOG2E - tl.log2(total))
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


def forward(x, cfg):
    """softmax(x[M, N]) along rows by the warp-partials kernel."""
    M, N = x.shape
    y = torch.empty_like(x)
    block, warps = cfg["BLOCK"], cfg["num_warps"]
    slices, lag, grid, _ = split.split_plan(M, N, cfg, x.device)
    slots = torch.zeros(1 + M * slices * warps, dtype=torch.int64, device=x.device)
    vec = 16 // x.element_size()
    assert block % (warps * 32 * vec) == 0, "a slice must be whole warp loads"
    warp_split_kernel[grid](x, y, slots, M, N, x.stride(0), y.stride(0), slices, lag, BLOCK=block, WARPS=warps,
                            VEC=vec, WORDS_POW2=launch_module.next_power_of_2(slices * warps), num_warps=warps)
    return y


def check(device):
    for M, N, block in ((7, 300, 512), (5, 1000, 512), (3, 4099, 1024), (12, 40, 512), (2, 1, 512)):
        x = torch.randn(M, N, device=device) * 4
        x[0, : N // 2] = -float("inf")  # a row's first slices all -inf
        cfg = {"BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 2, "LAG_ROUNDS": 1}
        got, want = forward(x, cfg), torch.softmax(x, -1)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"M={M} N={N}: {(got - want).abs().max().item()}"
    print(f"warp-partials split forward matches torch ({device})", flush=True)


# Registers (--inspect, sm_90): 8192 / 4 warps 159 (3 programs per SM), 8192 / 8 warps 80,
# 4096 / 4 warps 80, 16384 / 8 warps 165. The library: 8192 / 4 warps, 128, 4 per SM.
CONFIGS = [{"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "LAG_ROUNDS": 1}
           for block, warps, per_sm in ((8192, 4, 3), (8192, 8, 2), (8192, 8, 3), (4096, 4, 4), (4096, 4, 6),
                                        (16384, 8, 1))]


def inspect():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "slots_ptr": "*i64", "M": "i32", "N": "i32", "x_row_stride": "i32",
           "y_row_stride": "i32", "SLICES": "i32", "LAG": "i32", "BLOCK": "constexpr", "WARPS": "constexpr",
           "VEC": "constexpr", "WORDS_POW2": "constexpr"}
    divisible = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 4, 5, 6)}  # as a launch specialises them
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for cfg in CONFIGS:
        warps = cfg["num_warps"]
        constexprs = {"BLOCK": cfg["BLOCK"], "WARPS": warps, "VEC": 8, "WORDS_POW2": 16 * warps}
        compiled = triton.compile(ASTSource(warp_split_kernel, sig, constexprs, attrs=divisible),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        layouts = re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>)", compiled.asm["ttgir"])
        converts = compiled.asm["ttgir"].count("ttg.convert_layout")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name], capture_output=True,
                                  text=True).stdout
            usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                   text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        print(f"{cfg}: registers {regs.group(1) if regs else '?'}, BAR.SYNC {sass.count('BAR.SYNC')}, "
              f"convert_layout {converts}")
        for layout in layouts:
            print("   ", layout)


def main():
    from measure import long_rows, print_fraction
    for N, M, copy_bw in long_rows(check):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        want = torch.softmax(x.float(), -1)
        y = torch.empty_like(x)
        print_fraction(f"N={N} library", lambda: softmax.launch_forward(x, y, False), 2 * x.numel() * 2, copy_bw)
        for cfg in CONFIGS:
            error = (forward(x, cfg).float() - want).abs().max().item()
            print_fraction(f"N={N} warp partials {cfg} (max error {error:.1e})", lambda: forward(x, cfg),
                           2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    from measure import experiment
    experiment(check, inspect, main)
