"""Experiment for the next GPU session (docs/perf-notes.md, plan item 1): softmax's own-row
backward with its slots kept zeroed between launches, against the library's torch.zeros
before each launch, A/B in one process, alternating (bench runs on different hosts cannot
tell a 20-40 us change from the host's drift: session 6).

The own-row plan (pintail/_split.py) needs its slot words zeroed before the launch. The
library allocates and fills them each call, on the autograd engine's worker thread, before
the launch: 20-45 us more than the rows plan before its first launch
(scripts/exp_backward_timeline.py). The kept version holds one buffer per (device, stream),
and zeroes the words a launch used right after that launch, on the stream: the next
launch finds them clean, and the fill's host time comes after the kernel has been queued.
(The library version of commit d866b95 also kept it per thread, fell back to fresh slots
under CUDA graph capture and for large buffers.)

Per variant and round: the time from grad() to the launch (median of 200 steps, 4 rows),
and the protocol's fraction of copy through autograd at N = 131072 and 262144 (M*N = 2^27,
bf16; the bar is 0.85, run 12 measured 0.84 / 0.82). Predicted: 20-40 us less to the
launch, and the fractions up by ~0.03-0.1 where the step is host-bound.

    python scripts/exp_kept_slots.py
"""

import importlib
import time

import torch
from measure import copy_bandwidth, time_ms

import pintail

split = importlib.import_module("pintail._split")
softmax_module = importlib.import_module("pintail.softmax")
launch_module = importlib.import_module("pintail._launch")
LIBRARY = {"own_row_plan": split.own_row_plan, "launch": softmax_module.launch}
kept = {}
launch_times = []


def kept_slots(words, device):
    key = (device.index, torch.cuda.current_stream(device).stream_id)
    buffer = kept.get(key)
    if buffer is None or buffer.numel() < words:
        buffer = kept[key] = torch.zeros(launch_module.next_power_of_2(words), dtype=torch.int64, device=device)
    return buffer[:words]


def kept_own_row_plan(M, N, cfg, device):
    """The library's own-row plan (compiled: no interpreter case) with kept slots."""
    block = cfg["BLOCK"]
    slices = launch_module.cdiv(N, block)
    grid = min(M * slices, launch_module.program_slots(device, cfg["PROGRAMS_PER_SM"]))
    return block, slices, (grid,), kept_slots(2 + M * slices, device)


def timed_launch(with_rezero):
    def launch(kernel, grid, *args, **kwargs):
        launch_times.append(time.perf_counter())
        LIBRARY["launch"](kernel, grid, *args, **kwargs)
        if with_rezero and kernel is softmax_module._backward_own_row_kernel:
            args[3].zero_()  # the slots, behind the kernel on the stream
    return launch


def use(variant):
    if variant == "kept":
        split.own_row_plan = kept_own_row_plan
        softmax_module.launch = timed_launch(with_rezero=True)
    else:
        split.own_row_plan = LIBRARY["own_row_plan"]
        softmax_module.launch = timed_launch(with_rezero=False)


def to_launch_us(N, steps=200):
    x = torch.randn(4, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = pintail.softmax(x, -1)
    dy = torch.randn_like(y)
    torch.autograd.grad(y, x, dy, retain_graph=True)
    gaps = []
    for _ in range(steps):
        launch_times.clear()
        t0 = time.perf_counter()
        torch.autograd.grad(y, x, dy, retain_graph=True)
        gaps.append(launch_times[-1] - t0)
    torch.cuda.synchronize()
    return sorted(gaps)[steps // 2] * 1e6


def fraction(N, copy_bw):
    x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = pintail.softmax(x, -1)
    dy = torch.randn_like(y)
    ms = time_ms(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
    return 3 * x.numel() * 2 / (ms * 1e-3) / copy_bw


def check():
    """Both variants give the same bits, twice in a row (the kept words were clean again)."""
    x = torch.randn(37, 131072 + 5, device="cuda", requires_grad=True)
    y = pintail.softmax(x, -1)
    dy = torch.randn_like(y)
    results = []
    for variant in ("library", "kept", "kept", "library"):
        use(variant)
        results.append(torch.autograd.grad(y, x, dy, retain_graph=True)[0])
    assert all(torch.equal(results[0], r) for r in results[1:])
    torch.cuda.synchronize()
    assert not any(b.any() for b in kept.values())
    print("kept slots: same results, words zero after use", flush=True)


def main():
    check()
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for round_ in range(3):
        for variant in ("library", "kept"):
            use(variant)
            gap = to_launch_us(131072)
            fractions = [fraction(N, copy_bw) for N in (131072, 262144)]
            print(f"round {round_} {variant}: grad() to the launch {gap:.0f} us; softmax bwd 131072 "
                  f"{fractions[0]:.3f}, 262144 {fractions[1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
