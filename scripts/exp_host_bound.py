"""Is the slow mode at 262144 the host? (session 51.) Session 51's first call saw the SM clock
at 1980 MHz through a slow do_bench trial, and its second saw 0.80 in the machine's first
bench process only. A timed step is the L2 flush (~85 us on the GPU), then the kernels
(~140 us); pintail.softmax at 512 x 262144 costs ~100 us of host time (two launches). If
the host once takes longer than the step's GPU time, the GPU idles inside the timed span.

Here do_bench's loop is rebuilt with three events a step: before the flush (a), after it
(b), after the call (c). GPU idle before a step = a[i] - c[i-1]; the timed span = c - b;
host time a step from perf_counter. Then the same call captured in a CUDA graph (no host in
the span). Run it as a machine's first process: a slow trial with idle gaps and host time
past the GPU's step is the host; a slow trial with no gaps is the GPU.

--delays: a slow host made on purpose, a busy wait of so many us before each step, at
131072 (one launch) and 262144 (the clusters, then the side rows' launch ~20 us of host
later): where the GPU has no backlog, 262144's side rows start as late as the host launches
them, and a side row beside the clusters takes 70-95 us.
Measured (session 51): no slow trial came; the host's time a step 106-110 us with a spell at
194-213 us; graph replays' largest span 146-148 us against eager's 250-490 (each trial's
first step). With --delays the GPU idled before every step from 140 us (131072) / 120 us
(262144) of wait on, and the span stayed the kernel's (133 / 139 us): the flush covers the
host's launch latency at its usual speed.

    PYTHONPATH=.:scripts python scripts/exp_host_bound.py [--delays 0,100,150,200]   # on the GPU
"""

import argparse
import statistics
import time

import torch

import pintail

STEPS = 300


def trial(fn, flush, delay_us=0):
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(STEPS)]
    host = []
    torch.cuda.synchronize()
    for a, b, c in marks:
        t = time.perf_counter()
        while (time.perf_counter() - t) * 1e6 < delay_us:
            pass
        a.record()
        flush.zero_()
        b.record()
        fn()
        c.record()
        host.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    span = [b.elapsed_time(c) * 1e3 for a, b, c in marks]
    idle = [prev[2].elapsed_time(cur[0]) * 1e3 for prev, cur in zip(marks, marks[1:])]
    return statistics.median(span), max(span), statistics.median(host), max(host), sum(i > 5 for i in idle)


def slowed_host(delays):
    for N in (131072, 262144):
        x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16)
        pintail.softmax(x, -1)
        for delay in delays:
            span, span_max, host, host_max, gaps = trial(lambda: pintail.softmax(x, -1),
                                                         torch.empty(2**28, dtype=torch.int8, device="cuda"), delay)
            print(f"N={N} host wait {delay:4d} us: step span median {span:6.1f} us, host a step median {host:6.1f} us, "
                  f"steps after a GPU idle > 5 us: {gaps}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--delays", default=None, help="comma-separated busy waits (us) before each step")
    args = p.parse_args()
    if args.delays:
        slowed_host([int(d) for d in args.delays.split(",")])
        return
    x = torch.randn(512, 262144, device="cuda", dtype=torch.bfloat16)
    flush = torch.empty(2**28, dtype=torch.int8, device="cuda")
    ops = {"softmax": lambda: pintail.softmax(x, -1), "log_softmax": lambda: pintail.log_softmax(x, -1)}
    for fn in ops.values():
        fn()
    t0 = time.time()
    for round_ in range(8):
        for name, fn in ops.items():
            span, span_max, host, host_max, gaps = trial(fn, flush)
            print(f"t={time.time() - t0:5.1f} s {name:11s} step span median {span:6.1f} us (max {span_max:6.1f}), "
                  f"host a step median {host:6.1f} us (max {host_max:7.1f}), steps after a GPU idle > 5 us: {gaps}",
                  flush=True)
    for name, fn in ops.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            span, span_max, host, host_max, gaps = trial(graph.replay, flush)
            print(f"graph {name:11s} step span median {span:6.1f} us (max {span_max:6.1f}), host {host:6.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
