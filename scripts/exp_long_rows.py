"""Experiment: softmax forward over long rows (bf16, M*N = 2^27) on the GPU, three plans side
by side with the copy ceiling of the same run. Results go to docs/perf-notes.md.

- split:     pintail's split plan (pintail/softmax.py), a few configurations
- two_pass:  one program per row; pass 1 streams the row for (max, sum) with one exp per
             element (scalar max per chunk), pass 2 streams it again, optionally in reverse
             so that the most recently read chunks (most likely still in L2) come first
- cluster:   the whole row in one program spread over a thread-block cluster (num_ctas),
             if Triton 3.6 can reduce across the CTAs of a cluster

    python scripts/exp_long_rows.py
"""

import importlib

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sm = importlib.import_module("pintail.softmax")
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def two_pass_kernel(x_ptr, y_ptr, N, stride, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    y_row = y_ptr + row * stride
    m = -float("inf")
    s = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == -float("inf"), 0.0, new_m)
        s = s * tl.exp2((m - shift) * LOG2E) + tl.sum(tl.exp2((x - shift) * LOG2E), axis=0)
        m = new_m
    log2_s = tl.log2(s)
    chunks = tl.cdiv(N, BLOCK)
    for i in range(0, chunks):
        if REVERSE:
            start = (chunks - 1 - i) * BLOCK
        else:
            start = i * BLOCK
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = tl.exp2((x - m) * LOG2E - log2_s)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N, eviction_policy="evict_first")


def time_ms(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def main():
    x0 = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    y0 = torch.empty_like(x0)
    copy_bw = 2 * x0.numel() * 2 / (time_ms(lambda: y0.copy_(x0)) * 1e-3)
    del x0, y0
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for N in (32768, 131072, 262144):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref = torch.softmax(x.float(), -1)
        y = torch.empty_like(x)
        nbytes = 2 * M * N * 2

        def record(name, fn):
            y.fill_(float("nan"))
            try:
                fn()
                torch.cuda.synchronize()
                err = (y.float() - ref).abs().max().item()
                ms = time_ms(fn)
            except Exception as e:
                print(f"N={N} {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                return
            frac = nbytes / (ms * 1e-3) / copy_bw
            rows.append((N, name, frac, err))
            print(f"N={N} {name}: {ms:.4f} ms {frac:.3f} of copy, max err {err:.2e}", flush=True)

        for cfg in (sm.FORWARD_SPLIT, {**sm.FORWARD_SPLIT, "LAG_ROUNDS": 2}):
            record(f"split {cfg}", lambda: sm.launch_forward(x, y, False, cfg))
        for block in (8192, 16384):
            for warps in (8, 16, 32):
                for reverse in (False, True):
                    record(f"two_pass BLOCK={block} warps={warps} reverse={reverse}",
                           lambda: two_pass_kernel[(M,)](x, y, N, N, BLOCK=block, REVERSE=reverse,
                                                         num_warps=warps))
        for ctas in (2, 4, 8):
            for warps in (16, 32):
                if N // ctas // (32 * warps) > 64:
                    continue
                record(f"cluster num_ctas={ctas} warps={warps}",
                       lambda: sm._forward_rows_kernel[(M,)](x, y, M, N, N, N, LOG=False, BLOCK_M=1, BLOCK_N=N, TAIL=0,
                                                             EVEN=True, ALIGN=1,
                                                             num_warps=warps, num_ctas=ctas))
        del x, y, ref
        torch.cuda.empty_cache()
    print("\nbest per N:")
    for N in sorted({r[0] for r in rows}):
        for plan in ("split", "two_pass", "cluster"):
            cand = [r for r in rows if r[0] == N and r[1].startswith(plan) and r[3] < 1e-2]
            if cand:
                best = max(cand, key=lambda r: r[2])
                print(f"N={N} {plan}: {best[2]:.3f} ({best[1]})")


if __name__ == "__main__":
    main()
