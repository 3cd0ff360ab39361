"""Experiment on any machine (no GPU needed): host time of pintail's Python layers per call,
with every Triton launch replaced by a no-op, on small CPU tensors, beside torch's own op.
What remains is the part of the host time that is ours to cut (argument checks, launch
configuration, allocations, autograd), not the launch itself (scripts/exp_ce_overhead.py
measures that on the GPU machine). A cProfile of the slowest call follows.

    python scripts/exp_host_python.py
"""

import cProfile
import importlib
import os
import pstats
import time

os.environ["TRITON_INTERPRET"] = "1"  # before pintail's import: CPU tensors take the kernel path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pintail  # noqa: E402


class NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_launches():
    for name in ("norm", "rotary", "cross_entropy", "softmax"):
        module = importlib.import_module(f"pintail.{name}")
        for attr in dir(module):
            if attr.endswith("_kernel") and hasattr(getattr(module, attr), "run"):
                setattr(module, attr, NoLaunch())


def us(fn, calls=2000):
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    stub_launches()
    x = torch.randn(8, 1024, requires_grad=True)
    w = torch.randn(1024, requires_grad=True)
    y, y_torch = pintail.rms_norm(x, (1024,), w), F.rms_norm(x, (1024,), w)
    dy = torch.randn_like(y)
    q, k = torch.randn(1, 4, 8, 128, requires_grad=True), torch.randn(1, 2, 8, 128, requires_grad=True)
    cos, sin = torch.randn(8, 128), torch.randn(8, 128)
    q_out, k_out = pintail.apply_rotary(q, k, cos, sin, layout="bhsd")
    logits, target = torch.randn(8, 1000, requires_grad=True), torch.randint(0, 1000, (8,))
    loss = pintail.cross_entropy(logits, target, check_target=False)
    loss_torch = F.cross_entropy(logits, target)
    calls = {
        "rms_norm forward": (lambda: pintail.rms_norm(x, (1024,), w), lambda: F.rms_norm(x, (1024,), w)),
        "rms_norm backward": (lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True),
                              lambda: torch.autograd.grad(y_torch, (x, w), dy, retain_graph=True)),
        "rotary forward (q and k)": (lambda: pintail.apply_rotary(q, k, cos, sin, layout="bhsd"), None),
        "rotary backward": (lambda: torch.autograd.grad((q_out, k_out), (q, k), (q_out, k_out), retain_graph=True),
                            None),
        "cross_entropy forward": (lambda: pintail.cross_entropy(logits, target, check_target=False),
                                  lambda: F.cross_entropy(logits, target)),
        "cross_entropy backward": (lambda: torch.autograd.grad(loss, logits, retain_graph=True),
                                   lambda: torch.autograd.grad(loss_torch, logits, retain_graph=True)),
    }
    for name, (ours, theirs) in calls.items():
        line = f"{name}: {us(ours):.1f} us"
        if theirs is not None:
            line += f" (torch {us(theirs):.1f} us)"
        print(line, flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        calls["rotary backward"][0]()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
