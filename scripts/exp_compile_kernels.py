"""What torch.compile's kernels do at the short-row forwards where they beat ours (GPU).

Why: compile's RMSNorm forward measures 0.96 / 0.98 of copy at N = 1024 / 8192 (run 19),
ours 0.95 / 0.94, and LayerNorm 0.96 at 1024 against ours 0.93-0.94; launch-config sweeps
of ours top out at 0.93-0.95 (session 9). This prints Inductor's generated Triton source
for each case, the config its autotuner picked (rows a program, warps, stages), and both
kernels' fraction of copy, timed alike (bf16, M*N = 2^27, weight; LayerNorm with a bias;
forward without grad, as the bench's). Predicted: the difference is in the loads'
eviction hints or rows a program, something our rows kernel can take.

    python scripts/exp_compile_kernels.py [--out DIR] [--cases rms:32768,layer:1024,rotary:4096]
"""

import argparse
import importlib
import os

import torch
import torch.nn.functional as F
from measure import copy_bandwidth
from torch._inductor.codecache import PyCodeCache
from torch._inductor.utils import run_and_get_code
from triton.testing import do_bench

norm = importlib.import_module("pintail.norm")
rot = importlib.import_module("pintail.rotary")
bench = importlib.import_module("pintail.bench")


def chosen_configs():
    """The autotuners' picked configs, from Inductor's loaded modules."""
    found = []
    for module in list(PyCodeCache.modules):
        for name, value in vars(module).items():
            launchers = getattr(value, "launchers", None)
            if name.startswith("triton_") and launchers:
                found.append(f"{name}: {launchers[0].config}")
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--cases", default="rms:8192,rms:1024,layer:1024",
                   help="kind:N, kind rms, layer or rotary (N: sequence length, the bench's q and k)")
    args = p.parse_args()
    copy_bw = copy_bandwidth()
    report = [f"copy {copy_bw / 1e12:.2f} TB/s"]
    for case in args.cases.split(","):
        kind, N = case.split(":")[0], int(case.split(":")[1])
        if kind == "rotary":
            report += rotary_case(N, copy_bw)
            continue
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16) if kind == "layer" else None
        if kind == "rms":
            def reference(x, w, b):
                return F.rms_norm(x, (N,), w)
        else:
            def reference(x, w, b):
                return F.layer_norm(x, (N,), w, b)
        torch._dynamo.reset()
        PyCodeCache.modules.clear()
        compiled = torch.compile(reference, dynamic=False)
        _, sources = run_and_get_code(compiled, x, w, b)
        nbytes = 2 * M * N * 2
        with torch.no_grad():
            theirs = do_bench(lambda: compiled(x, w, b), warmup=200, rep=500)
            ours = do_bench(lambda: norm._forward(x, None, w, b, 1e-6, 0.0, kind == "rms", x.dtype), warmup=200,
                            rep=500)
        line = (f"{kind} N={N}: compile {theirs:.4f} ms {nbytes / theirs / 1e9 / (copy_bw / 1e12):.3f}, "
                f"ours {ours:.4f} ms {nbytes / ours / 1e9 / (copy_bw / 1e12):.3f} "
                f"(ours {norm.forward_config(N, kind == 'rms')})")
        print(line, flush=True)
        report += ["", "=" * 100, line] + chosen_configs() + sources
    with open(os.path.join(args.out, "compile_kernels.txt"), "w") as f:
        f.write("\n".join(report) + "\n")


def rotary_case(S, copy_bw):
    """Hugging Face's rotary (the bench's eager baseline) compiled, beside ours: q and k of
    the bench's shape, forward."""
    (q, k), (cos, sin) = bench._ops()["rotary"].make(8, S, torch.bfloat16, "cuda")
    torch._dynamo.reset()
    PyCodeCache.modules.clear()
    compiled = torch.compile(bench._hf_rotary, dynamic=False)
    _, sources = run_and_get_code(compiled, q, k, cos, sin)
    nbytes = 2 * 2 * (q.numel() + k.numel())
    theirs = do_bench(lambda: compiled(q, k, cos, sin), warmup=200, rep=500)
    ours = do_bench(lambda: rot._rotate(q, k, cos, sin, None, 2, 0, 128, False, False), warmup=200, rep=500)
    line = (f"rotary S={S}: compile {theirs:.4f} ms {nbytes / theirs / 1e9 / (copy_bw / 1e12):.3f}, "
            f"ours {ours:.4f} ms {nbytes / ours / 1e9 / (copy_bw / 1e12):.3f}")
    print(line, flush=True)
    return ["", "=" * 100, line] + chosen_configs() + sources


if __name__ == "__main__":
    main()
