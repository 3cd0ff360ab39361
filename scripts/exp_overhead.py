"""Experiment: where the softmax backward loses time when timed through autograd
(python -m pintail.bench) but not when its kernel is launched directly
(scripts/tune_softmax.py). For each layer, the GPU time by do_bench and the host time of
one call (a loop of calls on a 1-row input, then one sync).

    python scripts/exp_overhead.py
"""

import importlib

import torch
from triton.testing import do_bench

import pintail
from measure import host_us

sm = importlib.import_module("pintail.softmax")



def main():
    for N in (1024, 32768, 262144):
        M = 2**27 // N
        for label, rows in (("big", M), ("1 row", 1)):
            x = torch.randn(rows, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            y = pintail.softmax(x, -1)
            dy = torch.randn_like(y)
            dx = torch.empty_like(y)
            yd = y.detach()
            layers = {
                "kernel launch": lambda: sm.launch_backward(yd, dy, dx, False),
                "custom op": lambda: torch.ops.pintail.softmax_backward(yd, dy, -1, False, torch.bfloat16),
                "autograd.grad": lambda: torch.autograd.grad(y, (x,), dy, retain_graph=True),
                "forward op": lambda: pintail.softmax(x.detach(), -1),
            }
            for name, fn in layers.items():
                if label == "big":
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    frac = (3 if name != "forward op" else 2) * M * N * 2 / (ms * 1e-3) / 4.27e12
                    print(f"N={N} {label} {name}: {ms * 1e3:.1f} us GPU-timed ({frac:.2f} of 4.27 TB/s)", flush=True)
                else:
                    print(f"N={N} {label} {name}: {host_us(fn):.1f} us host per call", flush=True)


if __name__ == "__main__":
    main()
