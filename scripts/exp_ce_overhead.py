"""Experiment: host time of one cross-entropy step at a small size (M = 8 rows, V = 32768,
bf16; mean reduction, check_target=False), layer by layer, and a cProfile of the
forward+backward loop: where the host time goes when V = 32768 is host-bound.

    python scripts/exp_ce_overhead.py
"""

import cProfile
import importlib
import pstats

import torch
import torch.nn.functional as F

import pintail
from measure import Identity, host_us

ce = importlib.import_module("pintail.cross_entropy")


def main():
    M, V = 8, 32768
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    xd = x.detach()
    options = (-100, 0.0, 0.0, 0.0, False)

    def step():
        loss = pintail.cross_entropy(x, t, check_target=False)
        torch.autograd.grad(loss, x)

    def torch_step():
        torch.autograd.grad(F.cross_entropy(x, t), x)

    _, stats, mass, _, denominator = ce._launch_forward(xd, t, None, *options, "mean")
    grad = torch.ones((), device="cuda", dtype=x.dtype)
    identity = Identity.apply(x)
    dy = torch.randn_like(identity)
    layers = {
        "forward rows (kernel + allocations)": lambda: ce._forward(xd, t, None, *options),
        "torch.empty x3": lambda: (torch.empty(M, device="cuda"), torch.empty(M, 2, device="cuda"),
                                   torch.empty(0, device="cuda")),
        "three small torch ops": lambda: (t != -100).sum().float(),
        "pintail forward (unchecked)": lambda: pintail.cross_entropy(x, t, check_target=False),
        "pintail forward (checked)": lambda: pintail.cross_entropy(x, t),
        "pintail fwd+bwd (unchecked)": step,
        "backward rows (kernel + allocation)": lambda: ce._backward(grad, xd, t, None, stats, mass, *options, False,
                                                                   denominator),
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "torch.compiler.is_compiling()": torch.compiler.is_compiling,
        "autograd.grad of an identity Function": lambda: torch.autograd.grad(identity, x, dy, retain_graph=True),
        "torch forward": lambda: F.cross_entropy(x, t),
        "torch fwd+bwd": torch_step,
    }
    for name, fn in layers.items():
        print(f"{name}: {host_us(fn):.1f} us host per call", flush=True)
    with torch.autograd.set_multithreading_enabled(False):  # backward on this thread: no hand-off
        print(f"pintail fwd+bwd (unchecked), engine single-threaded: {host_us(step):.1f} us", flush=True)
        print(f"torch fwd+bwd, engine single-threaded: {host_us(torch_step):.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        step()
    torch.cuda.synchronize()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
