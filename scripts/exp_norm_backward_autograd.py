"""Experiment for the next GPU session: why the groups norm backward measured 0.69 of copy
alone but 0.35-0.39 through autograd at N = 32768 (bench runs 9 and 10). For RMSNorm rows of
N = 32768 (M = 4096, bf16), each backward plan (the library's long plan, groups, blocks)
timed four ways: the plan's function called directly (do_bench), the bench's step through
autograd (do_bench), the step's host time (a loop of calls, one synchronisation) and the
step's kernels (torch.profiler), and a chrome trace of a few steps per plan (into $OUT).
The experimental plans are swapped in for the library's by patching pintail.norm._backward,
which the autograd node calls.

Session 5 (H200, copy 4.25 TB/s), two runs of the long plan then one of each:

| plan | direct | through autograd | host per step | kernels |
|---|---|---|---|---|
| long (library) | 0.341 ms (0.556) | 0.400 / 0.344 ms (0.474 / 0.551) | 346 / 344 us | 195 + 135 us |
| groups | 0.275 ms (0.689) | 0.504 ms (0.376) | 462 us | - |
| blocks | 0.295 ms (0.642) | 0.468 ms (0.405) | 356 us | - |

The step is host-bound for every plan (~350 us of host time per step against 275-340 us of
GPU time), and the measured time is about the host's time to the plan's big launch (minus
the ~60 us L2 flush before it) plus that kernel: the long plan starts its first kernel
early and overlaps the rest; the single-kernel plans lose their kernel's gain and more.

    python scripts/exp_norm_backward_autograd.py
"""

import importlib
import os

import torch
from exp_host_gaps import kernels_of
from exp_norm_blocks_backward import backward as blocks_backward
from exp_norm_groups_backward import backward as groups_backward
from measure import copy_bandwidth, host_us, time_ms

import pintail

norm = importlib.import_module("pintail.norm")
library_backward = norm._backward


def plans(cfg_groups, cfg_blocks):
    """name -> the tensor-level backward with the library's signature."""
    def groups(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms, x_dtype, config=None):
        return groups_backward(dy, dh, x, weight, has_bias, mean, rstd, rms, cfg_groups)

    def blocks(dy, dh, x, weight, has_bias, mean, rstd, weight_offset, rms, x_dtype, config=None):
        return blocks_backward(dy, x, weight, has_bias, mean, rstd, rms, cfg_blocks)
    return {"long (library)": library_backward, "groups": groups, "blocks": blocks}


def write_trace(name, step, steps=5):
    """A chrome trace (host and GPU timelines) of a few steps into $OUT (the device tool
    brings it back): where the host waits, and when each kernel starts after its launch."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    path = os.path.join(os.environ.get("OUT", "."), f"trace-{name.split()[0]}.json")
    prof.export_chrome_trace(path)
    print(f"    trace: {path}", flush=True)


def main():
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    N = 32768
    M = 2**27 // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    y = pintail.rms_norm(x, (N,), w)
    _, _, mean, rstd = norm._forward(x.detach(), None, w.detach(), None, 1e-6, 0.0, True, x.dtype)
    nbytes = 3 * x.numel() * 2
    cfg_groups = {"BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 4}
    cfg_blocks = {"ROWS": 32, "BLOCK": 2048, "num_warps": 4, "PROGRAMS_PER_SM": 4}
    for name, backward in plans(cfg_groups, cfg_blocks).items():
        direct = lambda: backward(dy, None, x.detach(), w.detach(), False, mean, rstd, 0.0, True, x.dtype)
        step = lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True)
        norm._backward = backward
        try:
            ms_direct, ms_step = time_ms(direct), time_ms(step)
            print(f"{name}: direct {ms_direct:.4f} ms ({nbytes / (ms_direct * 1e-3) / copy_bw:.3f}), "
                  f"through autograd {ms_step:.4f} ms ({nbytes / (ms_step * 1e-3) / copy_bw:.3f}), "
                  f"host {host_us(step, calls=100):.0f} us per step", flush=True)
            for kernel, (count, gpu_us) in sorted(kernels_of(step).items(), key=lambda kv: -kv[1][1]):
                print(f"    {count:.0f}x {gpu_us:8.1f} us  {kernel}", flush=True)
            write_trace(name, step)
        finally:
            norm._backward = library_backward


if __name__ == "__main__":
    main()
