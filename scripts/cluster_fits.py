"""Print how many clusters fit at once on this GPU (cuOccupancyMaxActiveClusters, as the
library's persistent launches take them) and the SMs they cover: a cluster of k CTAs is
placed inside one GPC, so a kernel that takes an SM alone fits clusters of 10-14 CTAs only
once a GPC (session 41).

    python scripts/cluster_fits.py [--sizes 131072,196608] [--layer]   # the norms' forward configs below
    python scripts/cluster_fits.py --library [--sizes ...]             # every op's own plan, fwd and bwd
"""

import argparse

import torch

import pintail
from pintail import _cluster as cluster, norm

CONFIGS = ({"BLOCK": 16384, "num_warps": 8}, {"BLOCK": 16384, "num_warps": 8, "maxnreg": 128},
           {"BLOCK": 8192, "num_warps": 4}, {"BLOCK": 8192, "num_warps": 4, "maxnreg": 128},
           {"BLOCK": 4096, "num_warps": 4})


def library_ops(N):
    """(name, function of bf16 rows x of N) for each op whose plan may go across clusters."""
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    return [("softmax", lambda x: pintail.softmax(x, -1)), ("log_softmax", lambda x: pintail.log_softmax(x, -1)),
            ("rms_norm", lambda x: pintail.rms_norm(x, (N,), w)),
            ("rms_norm_residual", lambda x: pintail.rms_norm(x, (N,), w, residual=torch.randn_like(x))[0]),
            ("layer_norm", lambda x: pintail.layer_norm(x, (N,), w, w))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="65536,98304,131072,150000,196608,229376,262144")
    p.add_argument("--layer", action="store_true")
    p.add_argument("--library", action="store_true")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launched = []
    real_launch = cluster.launch

    def recording_launch(kernel, rows, ctas, *a, **k):
        clusters = real_launch(kernel, rows, ctas, *a, **k)
        launched.append((kernel.__name__, ctas, clusters))
        return clusters

    cluster.launch = recording_launch

    def report(label):
        for name, ctas, clusters in launched:
            print(f"{label} {name}: {clusters} clusters of {ctas} CTAs = {clusters * ctas} CTAs "
                  f"({clusters * ctas / sms:.2f} an SM)", flush=True)
        launched.clear()

    for N in map(int, args.sizes.split(",")):
        x = torch.randn(1024, N, device="cuda", dtype=torch.bfloat16)
        if args.library:
            for name, fn in library_ops(N):
                xg = x.detach().requires_grad_()
                fn(xg).backward(torch.randn_like(x))
                report(f"N={N} {name}")
            continue
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for cfg in CONFIGS:
            if not 2 <= -(-N // cfg["BLOCK"]) <= 16:
                continue
            for ahead in (False, True):
                norm._forward(x, None, w, None, 1e-6, 0.0, not args.layer, x.dtype,
                              {"plan": "cluster", **cfg, "AHEAD": ahead, "HELD": ahead})
                report(f"N={N} {cfg} ahead={ahead}")


if __name__ == "__main__":
    main()
