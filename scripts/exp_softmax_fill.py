"""Softmax forward past 131072: which slice size a row should take (prepared in session 22).

The library runs persistent clusters of 32768-element slices / 16 warps there. A row whose
last slice is mostly empty leaves SMs idle (200064: 7 slices, the row fills 87 % of them):
slices of 16384 / 8 warps won 0.05 at 140000, 200003 and 200064 but lost 0.015 at 180000
(11 CTAs a cluster, 100 % full) and 0.18 in log_softmax (176 registers). The guess to test:
a plan's fraction of copy follows fill x (SMs at work / 132), SMs at work = the clusters that
fit at once (cuOccupancyMaxActiveClusters, what `_cluster.launch` asks) x CTAs a cluster.
Per N this prints both numbers and the measured fraction of each candidate, so a rule can
be fitted and then chosen at launch.

    python scripts/exp_softmax_fill.py                 # CPU: the fills alone; GPU: fills, clusters, times
    python scripts/exp_softmax_fill.py --sizes 180000,200064
"""

import argparse
import importlib

import torch

import measure

sm = importlib.import_module("pintail.softmax")
cluster = importlib.import_module("pintail._cluster")
launch_ = importlib.import_module("pintail._launch")

CANDIDATES = [{"plan": "cluster", "BLOCK": 32768, "num_warps": 16, "PERSISTENT": True},
              {"plan": "cluster", "BLOCK": 16384, "num_warps": 8, "PERSISTENT": True},
              {"plan": "cluster", "BLOCK": 16384, "num_warps": 16, "PERSISTENT": True}]


def clusters_that_fit(x, y, log, cfg):
    """The clusters of 16 or fewer CTAs `launch_forward` would run at once for this config."""
    N = x.shape[1]
    ctas, shift = cluster.window(N, cfg["BLOCK"], x, y)
    return cluster.clusters_for(sm._forward_cluster_kernel, x.shape[0], ctas, x, y, x.shape[0], N, x.stride(0),
                                y.stride(0), 0, 1, LOG=log, BLOCK=cfg["BLOCK"], CLUSTER=ctas,
                                CLUSTER_POW2=launch_.next_power_of_2(ctas), PERSISTENT=True, LATE_WAIT=False,
                                SHIFT=shift, num_warps=cfg["num_warps"], maxnreg=None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="140000,151936,163841,180000,196608,200003,200064,229377,245760")
    args = p.parse_args()
    sizes = list(map(int, args.sizes.split(",")))
    gpu = torch.cuda.is_available()
    if gpu:
        copy_bw = measure.copy_bandwidth()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"copy {copy_bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    for N in sizes:
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda" if gpu else "cpu", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        for log in (False, True):
            for cfg in CANDIDATES:
                ctas, shift = cluster.window(N, cfg["BLOCK"], x, y)
                fill = N / (ctas * cfg["BLOCK"])
                label = f"N={N} log={log} {cfg['BLOCK']}/{cfg['num_warps']}w ctas={ctas} shift={shift} fill={fill:.3f}"
                if not gpu:
                    print(label)
                    continue
                fits = clusters_that_fit(x, y, log, cfg)
                busy = min(fits * ctas, sms)
                label += f" clusters={fits} SMs={fits * ctas} guess={fill * busy / sms:.3f}"
                measure.check_and_time_softmax(label, lambda: sm.launch_forward(x, y, log, cfg) or y, log, x,
                                               2 * x.numel() * 2, copy_bw)
        del x, y
        if gpu:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
