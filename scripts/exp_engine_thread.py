"""Why a cross-entropy backward costs ~290 us of host time through autograd when its work
called directly costs ~22 us (scripts/exp_ce_overhead.py, H200 machine): the same Python
work timed on the calling thread and inside an autograd backward (which runs on the
engine's device thread for CUDA tensors), for a few kinds of work.

    python scripts/exp_engine_thread.py
"""

import importlib
import time

import torch
from measure import host_us

ce = importlib.import_module("pintail.cross_entropy")


def python_loop():
    total = 0
    for i in range(1000):
        total += i
    return total


def make_function(work, seen):
    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, dy):
            t0 = time.perf_counter()
            work()
            seen.append(time.perf_counter() - t0)
            return dy
    return Timed


def main():
    M, V = 8, 32768
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    xd = x.detach()
    options = (-100, 0.0, 0.0, 0.0, False)
    _, stats, mass, _, denominator = ce._launch_forward(xd, t, None, *options, "mean")
    grad = torch.ones((), device="cuda", dtype=x.dtype)
    works = {
        "python loop of 1000 additions": python_loop,
        "torch.empty_like x10": lambda: [torch.empty_like(xd) for _ in range(10)],
        "cross-entropy backward launch": lambda: ce._backward(grad, xd, t, None, stats, mass, *options, False,
                                                             denominator),
    }
    for name, work in works.items():
        direct = host_us(work) 
        seen = []
        y = make_function(work, seen).apply(x)
        dy = torch.ones_like(y)
        through = host_us(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
        inside = sorted(seen)[len(seen) // 2] * 1e6
        with torch.autograd.set_multithreading_enabled(False):
            seen.clear()
            single = host_us(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
            inside_single = sorted(seen)[len(seen) // 2] * 1e6
        print(f"{name}: called directly {direct:.1f} us; inside backward (median) {inside:.1f} us, "
              f"autograd.grad {through:.1f} us; engine single-threaded: inside {inside_single:.1f} us, "
              f"autograd.grad {single:.1f} us", flush=True)


if __name__ == "__main__":
    main()
