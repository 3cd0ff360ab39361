"""One launch of one library kernel, inside cudaProfilerStart / Stop, for Nsight Compute
(`ncu --profile-from-start off`): where the split, own-row and blocks plans lose their
time (stall reasons, L2 hit rate, achieved occupancy) rather than guessing from fractions.
The kernels are compiled and run once before the profiled launch; inputs are bf16 with
M*N = 2^27 (cross-entropy: M = 4096), as in the bench.

The device tool's one-GPU machine (Firecracker) runs ncu with hardware counters (its
KINDS.md, seen 2026-11-04; leave the clocks alone: --clock-control none):

    bash scripts/device_run.sh profile                                # every case below
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \\
        python3 scripts/profile_kernel.py softmax_fwd 131072

On a CPU (TRITON_INTERPRET=1, tiny sizes) it only checks that each case runs:
    TRITON_INTERPRET=1 python scripts/profile_kernel.py --smoke
"""

import importlib
import sys

import torch

import pintail

norm = importlib.import_module("pintail.norm")
softmax_module = importlib.import_module("pintail.softmax")
rotary_module = importlib.import_module("pintail.rotary")
ce_module = importlib.import_module("pintail.cross_entropy")


def cases(N, device, elements):
    """name -> a function that makes the inputs and returns the call to profile."""
    M = max(1, elements // N)
    bf16 = dict(device=device, dtype=torch.bfloat16)

    def softmax_fwd(config=None):
        def make():
            x = torch.randn(M, N, **bf16)
            y = torch.empty_like(x)
            return lambda: softmax_module.launch_forward(x, y, False, config)
        return make

    def softmax_bwd():
        y = torch.softmax(torch.randn(M, N, **bf16).float(), -1).to(torch.bfloat16)
        dy, dx = torch.randn_like(y), torch.empty_like(y)
        return lambda: softmax_module.launch_backward(y, dy, dx, False)

    def norm_fwd(rms):
        def make():
            x, w = torch.randn(M, N, **bf16), torch.randn(N, **bf16)
            b = None if rms else torch.randn(N, **bf16)
            return lambda: norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype)
        return make

    def norm_bwd(rms):
        def make():
            x, w, dy = torch.randn(M, N, **bf16), torch.randn(N, **bf16), torch.randn(M, N, **bf16)
            _, _, mean, rstd = norm._forward(x, None, w, None if rms else w, 1e-6, 0.0, rms, x.dtype)
            return lambda: norm._backward(dy, None, x, w, not rms, mean, rstd, 0.0, rms, x.dtype)
        return make

    def cross_entropy_fwd(weighted=False, smoothing=0.0, softcap=None):
        def make():
            rows = min(M, 4096)
            x, t = torch.randn(rows, N, **bf16), torch.randint(0, N, (rows,), device=device)
            w = torch.rand(N, **bf16) + 0.5 if weighted else None
            return lambda: pintail.cross_entropy(x, t, w, label_smoothing=smoothing, softcap=softcap,
                                                 check_target=False, reduction="none")
        return make

    def cross_entropy_bwd():  # the class-index backward alone, from the forward's statistics
        rows = min(M, 4096)
        x, t = torch.randn(rows, N, **bf16), torch.randint(0, N, (rows,), device=device)
        _, stats, mass, _, denominator = ce_module._launch_forward(x, t, None, -100, 0.0, 0.0, 0.0, False, "mean")
        grad = torch.ones((), **bf16)
        return lambda: ce_module._backward(grad, x, t, None, stats, mass, -100, 0.0, 0.0, 0.0, False, False,
                                           denominator)

    def rotary_fwd():
        # the bench's q (8, 32, S, 128) and k (8, 8, S, 128), S = N; half-split pairs
        S = N if device == "cuda" else 8
        q, k = torch.randn(8, 32, S, 128, **bf16), torch.randn(8, 8, S, 128, **bf16)
        angles = torch.outer(torch.arange(S, device=device).float(), torch.rand(64, device=device))
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        return lambda: rotary_module._launch([(q, q_out), (k, k_out)], cos, sin, None, 2, 0, 128, False, False)

    # softmax_fwd_split: the split plan at any N (at 32768 beside the library's two passes)
    return {"softmax_fwd": softmax_fwd(), "softmax_fwd_split": softmax_fwd(softmax_module.FORWARD_SPLIT),
            "softmax_bwd": softmax_bwd, "rms_fwd": norm_fwd(True),
            "layer_fwd": norm_fwd(False), "rms_bwd": norm_bwd(True), "layer_bwd": norm_bwd(False),
            "cross_entropy_fwd": cross_entropy_fwd(), "cross_entropy_bwd": cross_entropy_bwd, "rotary_fwd": rotary_fwd,
            # smoothing with and without the weights (read by every row, from L1 or L2): the weights'
            # forward reads 0.15 below smoothing alone; its loop issues 16.6 instructions an element
            # against 11.2 (session 28): the issue rate, or the weights' loads?
            "cross_entropy_fwd_smooth": cross_entropy_fwd(smoothing=0.1),
            "cross_entropy_fwd_weight_smooth": cross_entropy_fwd(True, 0.1),
            # the softcap forward (0.51-0.58 alone): three MUFU an element, yet taking one off
            # the MUFU gained at most 0.02 (session 29): which pipe or stall holds it?
            "cross_entropy_fwd_softcap": cross_entropy_fwd(softcap=30.0)}


def profile(name, N):
    call = cases(N, "cuda", 2**27)[name]()
    call()  # compile and load outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def smoke():
    for N in (300, 40000):
        for name, make in cases(N, "cpu", 4 * N).items():
            make()()
    print("every case runs (cpu)", flush=True)


if __name__ == "__main__":
    if "--smoke" in sys.argv:
        smoke()
    else:
        profile(sys.argv[1], int(sys.argv[2]))
