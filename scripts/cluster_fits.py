"""Print, per row length and config, how many clusters of the norms' cluster forward fit at
once on this GPU (cuOccupancyMaxActiveClusters) and the SMs they cover: a cluster of k CTAs
is placed inside one GPC, so slice counts that divide no GPC's SMs leave SMs idle.

    python scripts/cluster_fits.py [--sizes 131072,196608] [--layer]
"""

import argparse

import torch

from pintail import _cluster as cluster, norm

CONFIGS = ({"BLOCK": 16384, "num_warps": 8}, {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128},
           {"BLOCK": 8192, "num_warps": 4}, {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128},
           {"BLOCK": 4096, "num_warps": 4})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="65536,98304,131072,150000,196608,229376,262144")
    p.add_argument("--layer", action="store_true")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launched = []
    real_launch = cluster.launch

    def recording_launch(kernel, rows, ctas, *a, **k):
        clusters = real_launch(kernel, rows, ctas, *a, **k)
        launched.append((ctas, clusters))
        return clusters

    cluster.launch = recording_launch
    for N in map(int, args.sizes.split(",")):
        x = torch.randn(1024, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for cfg in CONFIGS:
            if not 2 <= -(-N // cfg["BLOCK"]) <= 16:
                continue
            for ahead in (False, True):
                launched.clear()
                norm._forward(x, None, w, None, 1e-6, 0.0, not args.layer, x.dtype,
                              {"plan": "cluster", **cfg, "AHEAD": ahead, "HELD": ahead})
                ctas, clusters = launched[0]
                print(f"N={N} {cfg} ahead={ahead}: {clusters} clusters of {ctas} CTAs = {clusters * ctas} CTAs "
                      f"({clusters * ctas / sms:.2f} a SM)", flush=True)


if __name__ == "__main__":
    main()
