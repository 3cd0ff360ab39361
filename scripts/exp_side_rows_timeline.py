"""When do the side rows run beside the persistent clusters (session 49)? Each CTA of the
clusters and of the side kernel stamps %globaltimer at its start and its end (the side
kernel's end before its wait for the clusters), after an L2 flush as the bench's, so the
timeline shows whether the dependent launch starts the side rows early (also with both launches
queued behind a GPU sleep, so that the host's launch latency is out of it), and how long a side
row takes beside the clusters and alone.

    python scripts/exp_side_rows_timeline.py   # on the GPU
"""

import importlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
_launch = importlib.import_module("pintail._launch")


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _sm_id():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit(do_not_specialize=["WORDS", "ROUNDS"])
def _clusters_stamped(x_ptr, y_ptr, stamps_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG: tl.constexpr,
                      BLOCK: tl.constexpr, CLUSTER: tl.constexpr, CLUSTER_POW2: tl.constexpr,
                      PERSISTENT: tl.constexpr, LATE_WAIT: tl.constexpr = False, SHIFT: tl.constexpr = 0):
    tl.store(stamps_ptr + tl.program_id(0) * 3, _now())
    sm._forward_cluster_kernel(x_ptr, y_ptr, M, N, x_row_stride, y_row_stride, WORDS, ROUNDS, LOG, BLOCK, CLUSTER,
                               CLUSTER_POW2, PERSISTENT, LATE_WAIT, SHIFT)
    tl.store(stamps_ptr + tl.program_id(0) * 3 + 1, _now())
    tl.store(stamps_ptr + tl.program_id(0) * 3 + 2, _sm_id().to(tl.int64))


@triton.jit
def _side_stamped(x_ptr, y_ptr, stamps_ptr, N, x_row_stride, y_row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr,
                  ALIGN: tl.constexpr):
    tl.store(stamps_ptr + tl.program_id(0) * 2, _now())
    sm._forward_two_pass_kernel(x_ptr, y_ptr, N, x_row_stride, y_row_stride, 0, LOG, BLOCK, ALIGN)
    tl.store(stamps_ptr + tl.program_id(0) * 2 + 1, _now())
    gdc_wait()


def run(x, k, block, warps, clusters_too=True, per_cluster=False, queued=False, log=False):
    M, N = x.shape
    y = torch.empty_like(x)
    cfg = sm.forward_config(N, log, clusters=True)
    xs, ys = x[:M - k], y[:M - k]
    ctas, shift = cluster.window(N, cfg["BLOCK"], xs, ys)
    c_stamps = torch.zeros(3 * 16 * 16, dtype=torch.int64, device=x.device)
    s_stamps = torch.zeros(2 * max(k, 1), dtype=torch.int64, device=x.device)
    if queued:  # both launches queued behind ~0.3 ms of GPU sleep, as in a timed loop: no host latency between them
        torch.cuda._sleep(600_000)
    if clusters_too:
        launched = cluster.launch(_clusters_stamped, M - k, ctas, xs, ys, c_stamps, M - k, N, N, N, 0, 1, LOG=log,
                                  BLOCK=cfg["BLOCK"], CLUSTER=ctas, CLUSTER_POW2=triton.next_power_of_2(ctas),
                                  PERSISTENT=True, SHIFT=shift, num_warps=cfg["num_warps"])
    if k:
        _launch.launch(_side_stamped, (k,), x[M - k:], y[M - k:], s_stamps, N, N, N, LOG=log, BLOCK=block,
                       ALIGN=_launch.row_alignment(N, N, N), num_warps=warps, launch_pdl=True)
    torch.cuda.synchronize()
    c = c_stamps[: 3 * launched * ctas].view(-1, 3).cpu() if clusters_too else None
    s = s_stamps.view(-1, 2).cpu()[:k]
    t0 = c[:, 0].min() if clusters_too else s[:, 0].min()
    us = lambda t: (t - t0).item() / 1e3
    text = ""
    if clusters_too:
        text += f"clusters start {us(c[:, 0].min()):.1f}-{us(c[:, 0].max()):.1f} end {us(c[:, 1].min()):.1f}-{us(c[:, 1].max()):.1f} us"
    if k:
        row = (s[:, 1] - s[:, 0]).double() / 1e3
        text += (f"; side start {us(s[:, 0].min()):.1f}-{us(s[:, 0].max()):.1f} end {us(s[:, 1].min()):.1f}-"
                 f"{us(s[:, 1].max()):.1f} us, a row {row.min():.1f}-{row.max():.1f} us")
    if clusters_too and per_cluster:  # which clusters end late, and on which SMs (their GPC)
        for j in range(launched):
            cta = c[j * ctas:(j + 1) * ctas]
            text += f"\n    cluster {j}: end {us(cta[:, 1].max()):.1f} us, SMs {sorted(cta[:, 2].tolist())}"
    return text


def main():
    flush = torch.empty(2**28, dtype=torch.int8, device="cuda")
    # session 49: (512, 32 / 24, 32768, 32, True) first (call 5); session 50: per cluster (the spread of their ends)
    for M, k, block, warps, both in ((512, 17, 8192, 8, True), (512, 2, 8192, 8, True), (256, 1, 8192, 8, True),
                                     (512, 17, 32768, 32, True), (512, 0, 8192, 8, True), (512, 17, 8192, 8, False),
                                     (512, 1, 8192, 8, False)):
        x = torch.randn(M, 262144, device="cuda", dtype=torch.bfloat16)
        run(x, k, block, warps, both)
        for trial in range(4):
            flush.zero_()
            print(f"M={M} k={k} side {block}/{warps}w{'' if both else ' alone'}: "
                  f"{run(x, k, block, warps, both, per_cluster=trial < 2 and k in (0, 17) and both)}", flush=True)
        if both and k:
            print(f"M={M} k={k} side {block}/{warps}w queued: {run(x, k, block, warps, both, queued=True)}", flush=True)


if __name__ == "__main__":
    main()
