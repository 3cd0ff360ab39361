"""Softmax's forward at 262144: the idle SMs' side rows in the same stream (session 49).

The library's persistent clusters (8 x 32768 / 16 warps, one CTA fills an SM's registers)
run 15 at a time on 120 of the 132 SMs; 512 rows take 35 rounds where 34.1 would do. Session
38 gave the last k rows to the two-pass kernel on a second stream, whose CTAs then ran on the
12 idle SMs: 0.90 at k = 17 against 0.88, not landed for the second stream inside the op
(event fork / join, a side stream a device). Here the side kernel goes in the same stream by
programmatic dependent launch (sm_90): each cluster CTA signals at its start
(griddepcontrol.launch_dependents), so the side kernel, launched with the PDL attribute,
starts once every cluster CTA runs, and only the idle SMs have room for it. Its rows do not
depend on the clusters' output; it waits for the clusters to finish (griddepcontrol.wait)
only after its stores, so that its own end implies theirs and the stream's next work sees
both. Predicted: session 38's 0.90 at k = 12-17 without the fork's cost, maybe +0.005.

    python scripts/exp_softmax_side_pdl.py   # on the GPU
"""

import importlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from measure import softmax_forms

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
_launch = importlib.import_module("pintail._launch")


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _clusters_signalling(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG: tl.constexpr,
                         BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                         PERSISTENT: tl.constexpr, LATE_WAIT: tl.constexpr = False, SHIFT: tl.constexpr = 0):
    gdc_launch_dependents()
    sm._forward_cluster_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG, BLOCK, CLUSTER,
                               CLUSTER_POW2, PERSISTENT, LATE_WAIT, SHIFT)


@triton.jit
def _side_two_pass(x_ptr, y_ptr, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr,
                   ALIGN: tl.constexpr):
    sm._forward_two_pass_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, 0, LOG, BLOCK, ALIGN)
    gdc_wait()  # ends only after the clusters: the stream's next work sees both


def side_form(x, k, block, warps, pdl=True):
    """(label, fn(log)): the clusters on the first M - k rows, then the two-pass kernel on
    the last k, launched with PDL (or plainly: then it runs after the clusters)."""
    M, N = x.shape

    def run(log):
        y = torch.empty_like(x)
        cfg = sm.forward_config(N, log, clusters=True)
        xs, ys = x[:M - k], y[:M - k]
        ctas, shift = cluster.window(N, cfg["BLOCK"], xs, ys)
        cluster.launch(_clusters_signalling, M - k, ctas, xs, ys, M - k, N, N, N, 0, 1, LOG=log, BLOCK=cfg["BLOCK"],
                       CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas), PERSISTENT=cfg["PERSISTENT"],
                       SHIFT=shift, num_warps=cfg["num_warps"])
        _launch.launch(_side_two_pass, (k,), x[M - k:], y[M - k:], N, N, N, LOG=log, BLOCK=block,
                       ALIGN=_launch.row_alignment(N, N, N), num_warps=warps, launch_pdl=pdl)
        return y

    return f"clusters + {k} two-pass rows of {block} / {warps} warps{' (PDL)' if pdl else ' (no PDL)'}", run


def forms_of(N, x):
    """Call 2: 8192 / 8-16 warps and 16384 / 16 at k = 8-24 (and k = 17 without PDL); call 5:
    32768 / 32 warps (one CTA an SM, a row in 31-40 us beside the clusters against 69-96 us
    at 8192 / 8 warps: exp_side_rows_timeline.py) at k = 12-36."""
    return ([side_form(x, 17, 8192, 8)]
            + [side_form(x, k, 32768, 32) for k in (12, 17, 24, 28, 32, 36)])


if __name__ == "__main__":
    softmax_forms(forms_of, sizes=(262144,))
