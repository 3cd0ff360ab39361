"""Softmax's forward at 262144 with the SMs the clusters leave idle put to work (session 38).

The library's plan there, persistent clusters of 8 x 32768 / 16 warps, runs 15 clusters: 120
of the 132 SMs, one CTA each (its registers fill the SM). This form gives the clusters the
first M - k rows and the last k rows to the two-pass kernel (one CTA a row, the second read
from L2) on a second stream, launched after the clusters, so that its CTAs land on the 12
idle SMs and both finish together. Predicted: the clusters' 35 rounds of 15 rows at 512 rows
become 32-33 at k = 17-32, up to 35 / 33 of 0.88 = 0.93 if HBM keeps up; the side rows need
1.4-2.7 rows an idle SM in the clusters' time, fewer than the ~4 a cluster's SM does.
Measured (session 38, docs/perf-notes.md): 0.90 at k = 17 against the library's 0.88, less
past it; the split kernel as the side form, or the clusters on a stream of higher priority,
no better.

    python scripts/exp_softmax_side_rows.py   # on the GPU
"""

import importlib

import torch
from measure import softmax_forms

sm = importlib.import_module("pintail.softmax")
launch = importlib.import_module("pintail._launch").launch


def on_two_streams(x, k, side_launch, side, first):
    """fn(log): the clusters on the first M - k rows, side_launch(x rows, y rows, log) on the
    rest on stream `side`; with `first` (a stream of higher priority) the clusters go there,
    so that the block scheduler places their CTAs before the side kernel's."""
    M = x.shape[0]

    def run(log):
        y = torch.empty_like(x)
        main = torch.cuda.current_stream()
        cluster_stream = first or main
        for stream in (side, cluster_stream):
            stream.wait_stream(main)
        with torch.cuda.stream(cluster_stream):
            sm.launch_forward(x[:M - k], y[:M - k], log, sm.forward_config(x.shape[1], log, clusters=True))
        with torch.cuda.stream(side):
            side_launch(x[M - k:], y[M - k:], log)
        for stream in (side, cluster_stream):
            main.wait_stream(stream)
        return y

    return run


def side_rows_form(x, k, block, warps, side, first=None):
    """(label, fn(log)): the two-pass kernel on the side rows."""
    two_pass = {"plan": "two_pass", "BLOCK": block, "num_warps": warps}
    label = f"clusters{' (high priority)' if first else ''} + {k} two-pass rows of {block} / {warps} warps"
    return label, on_two_streams(x, k, lambda xs, ys, log: sm.launch_forward(xs, ys, log, two_pass), side, first)


def side_split_form(x, k, programs, side, first=None):
    """(label, fn(log)): the clusters on the first M - k rows, the split kernel (slices of
    8192 / 4 warps, their (max, sum) through global memory, the write lagged a round so its
    read comes from L2) on the rest, on a persistent grid of `programs` for the idle SMs."""
    M, N = x.shape
    slices = sm.cdiv(N, 8192)
    lag = max(1, min(k, programs // slices))

    def split_rows(xs, ys, log):
        slots = torch.zeros(1 + k * slices, dtype=torch.int64, device=x.device)
        grid = (min((k + lag) * slices, programs),)
        launch(sm._forward_split_kernel, grid, xs, ys, slots, k, N, xs.stride(0), ys.stride(0), slices, lag,
               LOG=log, BLOCK=8192, SLICES_POW2=sm.next_power_of_2(slices), ALIGN=1, num_warps=4)

    label = f"clusters{' (high priority)' if first else ''} + {k} split rows on {programs} programs"
    return label, on_two_streams(x, k, split_rows, side, first)


def forms_of(N, x):
    """Session 38's forms (its calls 4-7, docs/perf-notes.md)."""
    side, first = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    return ([side_rows_form(x, k, block, warps, side) for block, warps in
             ((8192, 8), (8192, 16), (16384, 16), (32768, 16), (32768, 32)) for k in (8, 17, 24, 32, 40)]
            + [side_split_form(x, k, programs, side) for programs in (36, 48, 60) for k in (17, 32, 40, 48, 56)]
            + [side_rows_form(x, k, 8192, 8, side, first) for k in (17, 24, 32, 40)]
            + [side_split_form(x, k, programs, side, first) for programs in (48, 60) for k in (24, 32, 40, 48)])


if __name__ == "__main__":
    softmax_forms(forms_of, sizes=(262144,))
