"""Where the host time of one eager backward goes, per op, before its first kernel launch:
the protocol times one `torch.autograd.grad` at a time, so on a host-bound step the GPU
waits for the host's time from grad() to the first launch (minus the L2 flush queued
before it). Per step, medians over 200 steps (small inputs: the kernels take ~no time):
grad() to our backward's start (the engine's hand-off to its worker thread), our
backward's start to its first launch, first to last launch, last launch to our backward's
end, and back to grad()'s return. Launches are timed where each op module calls
`launch`; the torch ops between them (allocations, sums, casts) fall in the gaps.

    python scripts/exp_backward_timeline.py
"""

import importlib
import time

import torch

import pintail

marks = {}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test with TRITON_INTERPRET=1


def timed(name, fn):
    def wrapper(*args, **kwargs):
        marks.setdefault(name, []).append(time.perf_counter())
        return fn(*args, **kwargs)
    return wrapper


def instrument():
    for module_name, cls in (("softmax", "_Softmax"), ("norm", "_Norm"), ("cross_entropy", "_CrossEntropy")):
        module = importlib.import_module(f"pintail.{module_name}")
        module.launch = timed("launch", module.launch)
        function = getattr(module, cls)
        backward = function.backward

        def timed_backward(ctx, *grads, backward=backward):
            marks["backward start"] = [time.perf_counter()]
            out = backward(ctx, *grads)
            marks["backward end"] = [time.perf_counter()]
            return out
        function.backward = staticmethod(timed_backward)


def steps(make, count=200):
    """make() -> (output, inputs, upstream gradient); per-step medians in us."""
    out, inputs, grad = make()
    rows = []
    for _ in range(count):
        marks.clear()
        t0 = time.perf_counter()
        torch.autograd.grad(out, inputs, grad, retain_graph=True)
        t1 = time.perf_counter()
        start, end, launches = marks["backward start"][0], marks["backward end"][0], marks["launch"]
        rows.append((start - t0, launches[0] - start, launches[-1] - launches[0], end - launches[-1], t1 - end,
                     t1 - t0, len(launches)))
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    names = ("grad() to backward", "backward to 1st launch", "1st to last launch", "last launch to end",
             "end to grad() return", "step", "launches")
    return {n: sorted(r[i] for r in rows)[count // 2] * (1 if n == "launches" else 1e6) for i, n in enumerate(names)}


def cases():
    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)

    def norm(N, rms, residual=False):
        def make():
            x = torch.randn(4, N, **bf16, requires_grad=True)
            w = torch.randn(N, **bf16, requires_grad=True)
            if rms:
                out = pintail.rms_norm(x, (N,), w, residual=torch.randn_like(x) if residual else None)
                out = out[0] if residual else out
            else:
                out = pintail.layer_norm(x, (N,), w, torch.randn(N, **bf16, requires_grad=True))
            return out, (x, w), torch.randn_like(out)
        return make

    def softmax(N):
        def make():
            x = torch.randn(4, N, **bf16, requires_grad=True)
            y = pintail.softmax(x, -1)
            return y, (x,), torch.randn_like(y)
        return make

    def cross_entropy(V):
        def make():
            x = torch.randn(8, V, **bf16, requires_grad=True)
            loss = pintail.cross_entropy(x, torch.randint(0, V, (8,), device=DEVICE))
            return loss, (x,), None
        return make

    return {"rms_norm N=1024 (rows plan)": norm(1024, True), "rms_norm N=32768 (blocks plan)": norm(32768, True),
            "rms_norm + residual N=4096": norm(4096, True, residual=True),
            "layer_norm N=4096": norm(4096, False), "softmax N=1024": softmax(1024),
            "softmax N=131072 (own row)": softmax(131072), "cross_entropy V=32768": cross_entropy(32768)}


def main():
    instrument()
    for name, make in cases().items():
        steps(make, 20)  # compile and warm up
        with torch.autograd.set_multithreading_enabled(True):
            parts = steps(make)
        print(f"{name}: " + ", ".join(f"{k} {v:.0f}" + ("" if k == "launches" else " us") for k, v in parts.items()),
              flush=True)


if __name__ == "__main__":
    main()
