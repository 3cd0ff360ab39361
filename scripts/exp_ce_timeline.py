"""Where the host time of one eager cross-entropy step goes (M = 8 rows, V = 32768, bf16,
mean, check_target=False: the kernels take no time): per step, the forward call, the
hand-off from autograd.grad to our backward on the engine's device thread, our backward,
and the hand-off back; medians over 300 steps, with the engine threaded (the default for
CUDA tensors) and single-threaded.

    python scripts/exp_ce_timeline.py
"""

import importlib
import time

import torch

import pintail

ce = importlib.import_module("pintail.cross_entropy")
marks = {}
_backward = ce._CrossEntropy.backward


def timed_backward(ctx, *grads):
    marks["backward start"] = time.perf_counter()
    out = _backward(ctx, *grads)
    marks["backward end"] = time.perf_counter()
    return out


ce._CrossEntropy.backward = staticmethod(timed_backward)


def timeline(steps=300):
    M, V = 8, 32768
    x = torch.randn(M, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,), device="cuda")
    rows = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = pintail.cross_entropy(x, t, check_target=False)
        t1 = time.perf_counter()
        torch.autograd.grad(loss, x)
        t2 = time.perf_counter()
        rows.append((t1 - t0, marks["backward start"] - t1, marks["backward end"] - marks["backward start"],
                     t2 - marks["backward end"], t2 - t0))
    torch.cuda.synchronize()
    names = ("forward call", "grad() to our backward", "our backward", "our backward to grad() return", "step")
    return {n: sorted(r[i] for r in rows)[steps // 2] * 1e6 for i, n in enumerate(names)}


def main():
    timeline(50)
    for label, threaded in (("engine threaded", True), ("engine single-threaded", False)):
        with torch.autograd.set_multithreading_enabled(threaded):
            parts = timeline()
        print(label + ": " + ", ".join(f"{k} {v:.1f} us" for k, v in parts.items()), flush=True)


if __name__ == "__main__":
    main()
