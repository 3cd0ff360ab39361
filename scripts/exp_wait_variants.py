"""Experiment for the next GPU session: how the cross-program plans poll for a row's
published words (pintail/_split.py, wait_for_row), three ways.

Every wait reloads all SLICES words of the row until none is 0. At N = 262144 the norms'
blocks backward has 128 slices a row: each of the row's 128 programs reloads 128 words (1 KB)
per poll, ~128 KB of L2 reads per poll round against the row's 1.5 MB of HBM traffic, and
more rounds the longer the slowest slice takes. The blocks backward falls from 0.639 at
32768 (16 slices) to 0.588 at 262144 (128); the split forwards hold 0.79-0.80 throughout
(32 slices of 8192). If polling traffic is part of the loss:
- masked: reload only the words still 0 (a lane whose word has arrived issues no load);
- sleep:  the full reload, after a nanosleep of ~100 ns (fewer poll rounds; GPU only:
          inline PTX, which the interpreter does not run).
Predicted: the blocks backward at 262144 toward its 32768 figure if polling is the cause;
no change for the forwards (32 slices).

Each variant runs in its own process (the library's kernels compile with whichever
wait_for_row the _split module holds at their first launch), twice, alternating:
library, masked, sleep, library, masked, sleep. A process times the library's kernels
launched directly: softmax forward (split) and backward (own row), RMSNorm forward (split)
and backward (blocks), as fractions of the copy bandwidth of its own run.

    TRITON_INTERPRET=1 python scripts/exp_wait_variants.py --check   # masked, in the interpreter
    python scripts/exp_wait_variants.py                             # GPU
"""

import importlib
import os
import subprocess
import sys

import torch
import triton
import triton.language as tl

split = importlib.import_module("pintail._split")


@triton.jit
def _unpacked(words, k, SLICES):
    """As the library's wait_for_row returns them: (hi, lo, valid)."""
    hi = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    lo = words.to(tl.int32).to(tl.float32, bitcast=True)
    return hi, lo, k < SLICES


@triton.jit
def wait_for_row_masked(slots_ptr, row, SLICES, SLICES_POW2: tl.constexpr):
    k = tl.arange(0, SLICES_POW2)
    ptrs = slots_ptr + 1 + row * SLICES + k
    words = tl.load(ptrs, mask=k < SLICES, other=1, volatile=True)
    while tl.sum((words == 0).to(tl.int32), axis=0) > 0:
        again = tl.load(ptrs, mask=(k < SLICES) & (words == 0), other=0, volatile=True)
        words = tl.where(words == 0, again, words)
    return _unpacked(words, k, SLICES)


@triton.jit
def _nanosleep():
    tl.inline_asm_elementwise("nanosleep.u32 100;\n mov.b32 $0, $1;", "=r,r", [tl.full((), 0, tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_for_row_sleep(slots_ptr, row, SLICES, SLICES_POW2: tl.constexpr):
    k = tl.arange(0, SLICES_POW2)
    ptrs = slots_ptr + 1 + row * SLICES + k
    words = tl.load(ptrs, mask=k < SLICES, other=1, volatile=True)
    while tl.sum((words == 0).to(tl.int32), axis=0) > 0:
        _nanosleep()
        words = tl.load(ptrs, mask=k < SLICES, other=1, volatile=True)
    return _unpacked(words, k, SLICES)


VARIANTS = {"library": None, "masked": wait_for_row_masked, "sleep": wait_for_row_sleep}


def use(variant):
    """Before any library kernel compiles: the _split module's wait_for_row becomes the variant."""
    if VARIANTS[variant] is not None:
        split.wait_for_row = VARIANTS[variant]


def check():
    """The masked variant in the library's cross-program kernels, in the interpreter, against torch
    (rows cut into slices: split softmax and the own-row backward; the interpreter runs one
    program at a time, so the waits there end at once: the arithmetic, not the waiting)."""
    use("masked")
    softmax_module = importlib.import_module("pintail.softmax")
    x = torch.randn(5, 1000) * 3
    y = torch.empty_like(x)
    cfg = {"plan": "split", "BLOCK": 128, "num_warps": 4, "PROGRAMS_PER_SM": 3, "LAG_ROUNDS": 1}
    softmax_module.launch_forward(x, y, False, cfg)
    torch.testing.assert_close(y, torch.softmax(x.double(), -1).float(), rtol=1e-5, atol=1e-6)
    print("masked wait: split softmax matches torch (cpu)", flush=True)


def child(variant):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from measure import copy_bandwidth, time_ms
    from profile_kernel import cases
    use(variant)
    copy_bw = copy_bandwidth()
    for name, N, directions in (("softmax_fwd", 131072, 2), ("softmax_fwd", 262144, 2), ("softmax_bwd", 131072, 3),
                                ("softmax_bwd", 262144, 3), ("rms_fwd", 262144, 2), ("rms_bwd", 32768, 3),
                                ("rms_bwd", 131072, 3), ("rms_bwd", 262144, 3)):
        call = cases(N, "cuda", 2**27)[name]()
        ms = time_ms(call)
        print(f"{variant}: {name} N={N} {directions * 2**27 * 2 / (ms * 1e-3) / copy_bw:.3f}", flush=True)


def main():
    for _ in range(2):
        for variant in VARIANTS:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--variant", variant],
                                 capture_output=True, text=True, timeout=120)
            print(run.stdout.strip() or f"{variant}: failed\n{run.stderr[-1500:]}", flush=True)


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    elif "--variant" in sys.argv:
        child(sys.argv[sys.argv.index("--variant") + 1])
    else:
        main()
