"""Experiment (session 14): is cross-entropy's spread at V = 32768 the host's speed?

Why: at M = 4096, V = 32768 (bf16) a forward is ~82 us of GPU work and a forward+backward
~220 us, plus the protocol's L2 flush (~64 us) per repetition; our host time per call is
~70-110 us forward and ~220-250 us forward+backward, so the step is GPU-bound only while the
host keeps its speed. Bench run 31 measured the checked forward at 0.34 and the unchecked
at 0.43 (0.72-0.77 in other processes), and torch.compile's forward+backward spread 0.36-0.52
between runs: Python-launched providers alike. This runs one process per line and prints,
per round: a pure-Python speed probe (a loop of 100000 additions, us), host time per call
(a loop of calls, one synchronisation) and the protocol's fraction of copy for the checked
forward and forward+backward (the backward on the calling thread, as the bench), so slow
fractions can be matched with a slow host. Predicted: a slow row has a slow probe.

    python scripts/exp_ce_spread_host.py            # one process
    for i in 1 2 3; do python scripts/exp_ce_spread_host.py; done
"""

import os
import time

import torch
from measure import copy_bandwidth, host_us, time_ms

import pintail


def python_probe_us():
    t0 = time.perf_counter()
    total = 0
    for i in range(100000):
        total += i
    return (time.perf_counter() - t0) * 1e6


def cpu():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[37])  # field 39: the CPU last run on


def main():
    M, V = 4096, 32768
    copy_bw = copy_bandwidth()
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, V, (M,), device="cuda")
    xg = x.clone().requires_grad_()

    def forward():
        return pintail.cross_entropy(x, t)

    def step():
        return torch.autograd.grad(pintail.cross_entropy(xg, t), xg)

    nbytes = M * V * 2
    with torch.autograd.set_multithreading_enabled(False):
        for round_ in range(3):
            probe = python_probe_us()
            fwd_host, step_host = host_us(forward), host_us(step)
            fwd = nbytes / (time_ms(forward, rep=100) * 1e-3) / copy_bw
            both = 3 * nbytes / (time_ms(step, rep=100) * 1e-3) / copy_bw
            print(f"pid {os.getpid()} cpu {cpu()} round {round_}: probe {probe:.0f} us, host fwd {fwd_host:.0f} us, "
                  f"fwd+bwd {step_host:.0f} us; fraction fwd {fwd:.2f}, fwd+bwd {both:.2f}", flush=True)


if __name__ == "__main__":
    main()
