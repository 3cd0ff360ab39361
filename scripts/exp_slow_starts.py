"""What a slow call at 262144 is made of (session 51). The slow mode (0.46-0.82 of copy where
0.90 is usual) showed in the first process on a fresh machine, in persistent cluster kernels
only (softmax forward 262144, log_softmax backward 131072), with the SM clock at 1980 MHz.
Here the bench's timed step is rebuilt back to back (L2 flush, event, clusters + side rows,
event; the library's plan computed each call as pintail.softmax does, for its host time),
with every CTA's start and end stamped (%globaltimer, exp_side_rows_timeline's kernels) into
a stamp buffer per call. For each call slower than 1.15x the median:
- span - (last end - first start) large: the GPU waited inside the span (the host),
- the clusters' starts spread: a cluster placed late (not co-resident),
- neither: the kernels themselves ran slow.
Run it as the machine's first process.
Measured (session 51, 24 x 400 calls): the clusters' starts spread 0.1-0.2 us in every call,
and no call was slow but each trial's first (the host after a sync). The stamped softmax
takes 163 us against the library's 140 (the stamps change its code); log_softmax 140.

    PYTHONPATH=.:scripts python scripts/exp_slow_starts.py    # on the GPU
"""

import importlib
import statistics
import time

import torch
import triton

import exp_side_rows_timeline as timeline

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")

CALLS = 400
SIDE, SIDE_BLOCK, SIDE_WARPS = 17, 8192, 8  # the library's side rows at 512 x 262144


def trial(x, log, flush):
    M, N = x.shape
    cfg = sm.forward_config(N, log, clusters=True)
    k = SIDE
    c_stamps = torch.zeros(CALLS, 3 * 16 * 16, dtype=torch.int64, device=x.device)
    s_stamps = torch.zeros(CALLS, 2 * k, dtype=torch.int64, device=x.device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(CALLS)]
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(events):
        flush.zero_()
        a.record()
        y = torch.empty_like(x)
        sm.planned_forward(x, y, log)  # the library's host work before its launches
        xs, ys = x[:M - k], y[:M - k]
        ctas, shift = cluster.window(N, cfg["BLOCK"], xs, ys)
        launched = cluster.launch(timeline._clusters_stamped, M - k, ctas, xs, ys, c_stamps[i], M - k, N, N, N, 0, 1,
                                  LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas),
                                  PERSISTENT=True, SHIFT=shift, num_warps=cfg["num_warps"])
        launch_.launch(timeline._side_stamped, (k,), x[M - k:], y[M - k:], s_stamps[i], N, N, N, LOG=log,
                       BLOCK=SIDE_BLOCK, ALIGN=launch_.row_alignment(N, N, N), num_warps=SIDE_WARPS, launch_pdl=True)
        b.record()
    torch.cuda.synchronize()
    spans = [a.elapsed_time(b) * 1e3 for a, b in events]
    c = c_stamps[:, :3 * launched * ctas].view(CALLS, -1, 3).cpu()
    s = s_stamps.view(CALLS, -1, 2).cpu()
    first = torch.minimum(c[:, :, 0].min(1).values, s[:, :, 0].min(1).values)
    last = torch.maximum(c[:, :, 1].max(1).values, s[:, :, 1].max(1).values)
    busy = ((last - first).double() / 1e3).tolist()
    spread = ((c[:, :, 0].max(1).values - c[:, :, 0].min(1).values).double() / 1e3).tolist()
    ends = ((c[:, :, 1].max(1).values - c[:, :, 1].min(1).values).double() / 1e3).tolist()
    median = statistics.median(spans)
    slow = [i for i, span in enumerate(spans) if span > 1.15 * median]
    text = (f"span median {median:.1f} us, kernels' busy median {statistics.median(busy):.1f} us, "
            f"cluster start spread median {statistics.median(spread):.2f} us; slow calls {len(slow)}")
    for i in slow[:8]:
        text += (f"\n    call {i}: span {spans[i]:.1f} us, busy {busy[i]:.1f}, GPU waiting in the span "
                 f"{spans[i] - busy[i]:.1f}, cluster starts spread {spread[i]:.1f}, ends spread {ends[i]:.1f}")
    return text


def main():
    flush = torch.empty(2**28, dtype=torch.int8, device="cuda")
    x = torch.randn(512, 262144, device="cuda", dtype=torch.bfloat16)
    t0 = time.time()
    for round_ in range(12):
        for log in (False, True):
            print(f"t={time.time() - t0:5.1f} s log={log}: {trial(x, log, flush)}", flush=True)


if __name__ == "__main__":
    main()
