"""Experiment: ptxas register caps (the `maxnreg` launch option) where a kernel's registers
sit just above the count that fits one more program per SM (GPU, kernel alone, bf16).

Why: RMSNorm's one-chunk forward at 32768 took 35 registers at 32 warps (one program an
SM); held to 32 (two) it went from 0.91-0.92 to 0.957-0.960 of copy (session 13). A CPU
sweep of the bench's plans (sm_90, `scripts/check_occupancy.py`'s counting) lists the
others near such a step, here with the cap that would fit one more program:
RMSNorm forward 8192 (40 registers, 6 programs; 32: 8), 16384 (72, 3; 64: 4), LayerNorm
forward 1024 (64, 16; 56: 18) and 32768 (60, 2; 40: 3), softmax backward 32768 (128, 1;
64: 2), cross-entropy forward (80, 6; 72: 7) and backward (64, 4; 48: 5), rotary (118, 4;
96: 5). The library's launches are wrapped here to add the cap to one kernel at a time.

Predicted: a gain where the kernel is latency-bound with few programs (RMSNorm 8192, rotary,
softmax backward 32768) if the cap costs no spills in the inner loop; a loss where ptxas
spills (LayerNorm 32768: 80-336 bytes of stack under tighter caps, session 13).

Got (session 13, two rounds each, fraction of copy, uncapped / caps): every cap lost.
RMSNorm 8192 0.95 / 0.92 (32), 0.89 (40); 16384 0.96 / 0.93; LayerNorm 1024 0.94 / 0.93,
0.92; 32768 0.81 / 0.79, 0.78; softmax backward 32768 0.97 / 0.32 (64), 0.74 (96);
cross-entropy forward 0.96 / 0.94, 0.66, backward 0.91 / 0.89-0.90; rotary 0.91 / 0.76,
0.79. The 32768 case gained because it went from one program an SM to two; where 2-8
already run, the cap's spills and recomputation cost more than one more program gives.

    python scripts/exp_register_caps.py
"""

import importlib

import torch
from measure import copy_bandwidth, print_fraction, rotary_inputs

norm = importlib.import_module("pintail.norm")
softmax = importlib.import_module("pintail.softmax")
ce = importlib.import_module("pintail.cross_entropy")
rot = importlib.import_module("pintail.rotary")
launch_module = importlib.import_module("pintail._launch")

CAPS = {}  # kernel -> maxnreg for the launches below


def capped_launch(kernel, grid, *args, **kwargs):
    if CAPS.get(kernel):
        kwargs = {**kwargs, "maxnreg": CAPS[kernel]}
    launch_module.launch(kernel, grid, *args, **kwargs)


for module in (norm, softmax, ce, rot):
    module.launch = capped_launch


def norm_case(N, rms):
    M = 2**27 // N
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)
    return lambda: norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype), 2 * x.numel() * 2


def softmax_backward_case(N):
    M = 2**27 // N
    y = torch.softmax(torch.randn(M, N, device="cuda"), -1).bfloat16()
    dy, dx = torch.randn_like(y), torch.empty_like(y)
    return lambda: softmax.launch_backward(y, dy, dx, False), 3 * y.numel() * 2


def cross_entropy_cases(V):
    M = 4096
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, V, (M,), device="cuda")
    options = (-100, 0.0, 0.0, 0.0, False)
    _, stats, mass, _, denominator = ce._launch_forward(x, t, None, *options, "mean")
    grad = torch.ones((), device="cuda", dtype=x.dtype)
    forward = lambda: ce._launch_forward(x, t, None, *options, "none")
    backward = lambda: ce._backward(grad, x, t, None, stats, mass, *options, False, denominator)
    return (forward, x.numel() * 2), (backward, 2 * x.numel() * 2)


def rotary_case():
    q, k, cos, sin = rotary_inputs()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    fn = lambda: rot._launch([(q, q_out), (k, k_out)], cos, sin, None, 2, 0, 128, False, False)
    return fn, 2 * 2 * (q.numel() + k.numel())


def main():
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    ce_forward, ce_backward = cross_entropy_cases(131072)
    cases = [
        ("RMSNorm fwd 8192", norm._forward_long_kernel, norm_case(8192, True), (32, 40)),
        ("RMSNorm fwd 16384", norm._forward_long_kernel, norm_case(16384, True), (64,)),
        ("LayerNorm fwd 1024", norm._forward_rows_kernel, norm_case(1024, False), (56, 48)),
        ("LayerNorm fwd 32768", norm._forward_long_kernel, norm_case(32768, False), (48, 40)),
        ("softmax bwd 32768", softmax._backward_rows_kernel, softmax_backward_case(32768), (64, 96)),
        ("cross-entropy fwd 131072", ce._forward_kernel, ce_forward, (72, 64)),
        ("cross-entropy bwd 131072", ce._backward_kernel, ce_backward, (48, 56)),
        ("rotary fwd", rot._rotary_kernel, rotary_case(), (96, 104)),
    ]
    for label, kernel, (fn, nbytes), caps in cases:
        for _ in range(2):  # two rounds, alternating
            for cap in (None, *caps):
                CAPS[kernel] = cap
                print_fraction(f"{label} maxnreg {cap}", fn, nbytes, copy_bw)
        CAPS.clear()


if __name__ == "__main__":
    main()
