"""The norms' cluster forward with the next row loaded ahead (AHEAD, HELD) against torch on
CUDA, at shapes whose rows the clusters do not divide evenly (session 40)."""
import torch
import torch.nn.functional as F
from pintail import norm

torch.manual_seed(0)
bad = 0
for rms in (True, False):
    for N, block, warps, cap in ((65536, 4096, 4, None), (131072, 8192, 4, 128), (131072, 8192, 4, None),
                                 (262144, 16384, 8, 128), (40000, 4096, 4, None),
                                 (150000, 16384, 8, 128), (196608, 16384, 8, 128)):
        for M in (1, 37, 301):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                x = torch.randn(M, N, device="cuda", dtype=dtype) * 3 + 2
                if M == 37:
                    x[:, 0] = 1000.0  # flagged rows (LayerNorm's second exchange)
                w = torch.randn(N, device="cuda", dtype=dtype)
                b = None if rms else torch.randn(N, device="cuda", dtype=dtype)
                cfg = {"plan": "cluster", "BLOCK": block, "num_warps": warps, "AHEAD": True, "HELD": True}
                if cap:
                    cfg["maxnreg"] = cap
                y = norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype, cfg)[0]
                xf = x.float()
                ref = (F.rms_norm(xf, (N,), w.float(), 1e-6) if rms
                       else F.layer_norm(xf, (N,), w.float(), b.float(), 1e-6)).to(dtype)
                err = (y.float() - ref.float()).abs().max().item()
                tol = 0.05 if dtype != torch.float32 else 1e-3
                ok = err <= tol * max(1.0, ref.float().abs().max().item() / 4)
                bad += not ok
                print(f"{'rms' if rms else 'layer'} N={N} M={M} {dtype} {block}/{warps} cap={cap}: "
                      f"max err {err:.3g} {'ok' if ok else 'FAIL'}", flush=True)
print("failures", bad)
