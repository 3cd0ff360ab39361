"""Host time of the softmax forward's call, piece by piece (session 51). The slow mode at
262144 looked like the host: a timed step's GPU time is ~225 us (flush + kernels) and
pintail.softmax's host time ~100 us there, doubling in spells (exp_host_bound.py). Each
piece is timed behind a GPU sleep, so no call waits on the GPU: the public call, the plan,
the launch with the plan given, Triton's binder, the compiled kernel's run; then cProfile's
top functions of the public call at 262144.
Measured (session 51): 92-100 us a call at 1024-262144; ~190 Python function calls a call,
none above ~10 us of its own (docs/perf-notes.md).

    PYTHONPATH=.:scripts python scripts/exp_host_pieces.py    # on the GPU
"""

import cProfile
import importlib
import pstats
import time

import torch

import pintail

sm = importlib.import_module("pintail.softmax")
launch_ = importlib.import_module("pintail._launch")


def host_us(fn, calls=200):
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU work ahead of the calls: none waits
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return spent


def main():
    for N in (1024, 32768, 131072, 262144):
        x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        cfg = sm.planned_forward(x, y, False)
        pieces = {
            "pintail.softmax": lambda: pintail.softmax(x, -1),
            "autograd.Function apply": lambda: sm._Softmax.apply(x, -1, False, x.dtype),
            "_forward": lambda: sm._forward(x, -1, False, x.dtype),
            "torch.empty_like": lambda: torch.empty_like(x),
            "planned_forward": lambda: sm.planned_forward(x, y, False),
            "launch_forward(cfg)": lambda: sm.launch_forward(x, y, False, cfg),
        }
        print(f"N={N} plan {cfg}")
        for name, fn in pieces.items():
            print(f"  {name:26s} {host_us(fn):6.1f} us", flush=True)
    x = torch.randn(512, 262144, device="cuda", dtype=torch.bfloat16)
    pintail.softmax(x, -1)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        pintail.softmax(x, -1)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
