"""Experiment (session 14): where our RMSNorm forward at 8192 and LayerNorm forward at 1024
lose 0.02-0.03 of copy to torch.compile's kernels (0.949 / 0.935 against 0.975 / 0.956, the
same timing, session 14 call 3).

Inductor's kernels (scripts/exp_compile_kernels.py): RMSNorm 8192 is our long plan's form
with one chunk (pass 1 evict_last, pass 2 evict_first, the weight evict_last) but at 16 warps,
with the row length a constant, int32 offsets and no rstd stored; LayerNorm 1024 is one row a
program at 1 warp, held in registers, int32 offsets, weight / bias evict_last, no statistics
stored, plain two-pass mean / variance. Ours: RMSNorm at 8 warps (the sweeps put 16 below),
int64 row offsets, runtime strides, rstd stored; LayerNorm two rows a program at 2 warps with
a pilot-shifted sum and the flagged-row branch, mean and rstd stored.

The minimal kernels below are compile's form written for this test; each variant changes
one thing, so the gap splits into its causes. Predicted: the row length as a constant and
int32 offsets (fewer address instructions before the first load) carry most of it; the
statistics' stores cost nothing measurable.

Result (call 4): statistics stored cost LayerNorm 0.025 (0.961 -> 0.938); RMSNorm 16 warps
+0.025; the rest nothing. Second part (call 7): the statistics' stores in other forms, for
the training forward, which must store them: after y, rstd alone, as one (mean, rstd) pair a
row, streaming stores, 4-8 rows a program. Predicted: if the cost is partial 32-byte sectors
written back to HBM, pairs and more rows a program cut it; if it is the stores' latency at
the program's end, storing after y does not help and nothing here does.

    TRITON_INTERPRET=1 python scripts/exp_short_forward.py --check
    python scripts/exp_short_forward.py
"""

import importlib

import torch
import triton
import triton.language as tl
from measure import copy_bandwidth, experiment, print_fraction

norm = importlib.import_module("pintail.norm")


@triton.jit
def rms_plain_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, eps, N_RUNTIME, N: tl.constexpr, WIDE: tl.constexpr,
                     CONST_N: tl.constexpr, STORE_RSTD: tl.constexpr):
    row = tl.program_id(0)
    if WIDE:
        row = row.to(tl.int64)
    n = N if CONST_N else N_RUNTIME
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + row * n + cols, eviction_policy="evict_last").to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    if STORE_RSTD:
        tl.store(rstd_ptr + row, rstd)
    x = tl.load(x_ptr + row * n + cols, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x * rstd * w).to(y_ptr.dtype.element_ty))


@triton.jit
def layer_plain_kernel(x_ptr, w_ptr, b_ptr, y_ptr, stats_ptr, eps, N_RUNTIME, N: tl.constexpr, ROWS: tl.constexpr,
                       WIDE: tl.constexpr, CONST_N: tl.constexpr, STORE_STATS: tl.constexpr):
    # STORE_STATS 0: none; 1: mean and rstd to two arrays before y; 2: the same after y;
    # 3: rstd alone; 4: both as one (mean, rstd) pair a row; 5: as 1, streaming stores (.cs)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    if WIDE:
        rows = rows.to(tl.int64)
    n = N if CONST_N else N_RUNTIME
    cols = tl.arange(0, N)
    offsets = rows[:, None] * n + cols[None, :]
    x = tl.load(x_ptr + offsets).to(tl.float32)
    w = tl.load(w_ptr + cols, eviction_policy="evict_last").to(tl.float32)
    b = tl.load(b_ptr + cols, eviction_policy="evict_last").to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    d = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / N + eps)
    second = stats_ptr + 2 * tl.num_programs(0) * ROWS
    if STORE_STATS == 1:
        tl.store(stats_ptr + rows, mean)
        tl.store(second + rows, rstd)
    if STORE_STATS == 3:
        tl.store(second + rows, rstd)
    if STORE_STATS == 4:
        tl.store(stats_ptr + 2 * rows[:, None] + tl.arange(0, 2)[None, :],
                 tl.reshape(tl.join(mean, rstd), (ROWS, 2)))
    if STORE_STATS == 5:
        tl.store(stats_ptr + rows, mean, cache_modifier=".cs")
        tl.store(second + rows, rstd, cache_modifier=".cs")
    tl.store(y_ptr + offsets, (d * rstd[:, None] * w[None, :] + b[None, :]).to(y_ptr.dtype.element_ty))
    if STORE_STATS == 2:
        tl.store(stats_ptr + rows, mean)
        tl.store(second + rows, rstd)


def rms_plain(x, w, warps, wide=False, const_n=True, store=False):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    rms_plain_kernel[(M,)](x, w, y, rstd, 1e-6, N, N=N, WIDE=wide, CONST_N=const_n, STORE_RSTD=store,
                           num_warps=warps)
    return y


def layer_plain(x, w, b, warps, rows=1, wide=False, const_n=True, store=0):
    M, N = x.shape
    y = torch.empty_like(x)
    stats = torch.empty(4 * M, device=x.device, dtype=torch.float32)
    layer_plain_kernel[(M // rows,)](x, w, b, y, stats, 1e-6, N, N=N, ROWS=rows, WIDE=wide, CONST_N=const_n,
                                     STORE_STATS=store, num_warps=warps)
    return y


def library(x, w, b, rms, cfg=None):
    return norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype, config=cfg, stats=False)[0]


def rms_variants():
    return [("library", lambda x, w: library(x, w, None, True)),
            ("library at 16 warps", lambda x, w: library(x, w, None, True,
                                                        {"plan": "long", "BLOCK": x.shape[1], "num_warps": 16})),
            ("plain 16 warps", lambda x, w: rms_plain(x, w, 16)),
            ("plain 8 warps", lambda x, w: rms_plain(x, w, 8)),
            ("plain 16 warps, int64 rows", lambda x, w: rms_plain(x, w, 16, wide=True)),
            ("plain 16 warps, runtime N", lambda x, w: rms_plain(x, w, 16, const_n=False)),
            ("plain 16 warps, rstd stored", lambda x, w: rms_plain(x, w, 16, store=True)),
            ("plain 16 warps, int64, runtime N, rstd", lambda x, w: rms_plain(x, w, 16, True, False, True))]


def layer_variants():
    return [("library", lambda x, w, b: library(x, w, b, False)),  # no statistics: as the bench's forward
            ("library 1 row / 1 warp", lambda x, w, b: library(x, w, b, False, {"plan": "rows", "BLOCK_M": 1,
                                                                              "BLOCK_N": x.shape[1], "num_warps": 1})),
            ("plain 1 row / 1 warp", lambda x, w, b: layer_plain(x, w, b, 1)),
            ("plain 2 rows / 2 warps", lambda x, w, b: layer_plain(x, w, b, 2, rows=2)),
            ("plain 1 row, int64 rows", lambda x, w, b: layer_plain(x, w, b, 1, wide=True)),
            ("plain 1 row, runtime N", lambda x, w, b: layer_plain(x, w, b, 1, const_n=False)),
            ("plain 1 row, statistics stored", lambda x, w, b: layer_plain(x, w, b, 1, store=1)),
            ("plain 1 row, int64, runtime N, stats", lambda x, w, b: layer_plain(x, w, b, 1, 1, True, False, 1)),
            ("plain 1 row, stats after y", lambda x, w, b: layer_plain(x, w, b, 1, store=2)),
            ("plain 1 row, rstd alone", lambda x, w, b: layer_plain(x, w, b, 1, store=3)),
            ("plain 1 row, stats as pairs", lambda x, w, b: layer_plain(x, w, b, 1, store=4)),
            ("plain 1 row, stats streaming", lambda x, w, b: layer_plain(x, w, b, 1, store=5)),
            ("plain 4 rows / 4 warps, stats", lambda x, w, b: layer_plain(x, w, b, 4, rows=4, store=1)),
            ("plain 4 rows / 4 warps, stats as pairs", lambda x, w, b: layer_plain(x, w, b, 4, rows=4, store=4)),
            ("plain 8 rows / 8 warps, stats", lambda x, w, b: layer_plain(x, w, b, 8, rows=8, store=1)),
            ("plain 8 rows / 8 warps, no stats", lambda x, w, b: layer_plain(x, w, b, 8, rows=8)),
            ("library, stats stored", lambda x, w, b: norm._forward(x, None, w, b, 1e-6, 0.0, False, x.dtype)[0])]


def check(device):
    M = 16 if device.type == "cpu" else 64
    for N in (1024, 8192):
        x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, device=device, dtype=torch.bfloat16)
        b = torch.randn(N, device=device, dtype=torch.bfloat16)
        want = torch.nn.functional.rms_norm(x.float(), (N,), w.float(), 1e-6)
        for name, fn in rms_variants():
            assert (fn(x, w).float() - want).abs().max().item() < 0.1, ("rms", N, name)
        want = torch.nn.functional.layer_norm(x.float(), (N,), w.float(), b.float(), 1e-6)
        for name, fn in layer_variants():
            assert (fn(x, w, b).float() - want).abs().max().item() < 0.1, ("layer", N, name)
    print(f"every variant matches torch ({device.type})", flush=True)


def main():
    check(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for round_ in range(2):
        for N in (1024,):
            x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            for name, fn in rms_variants() if N == 8192 else layer_variants():
                args = (x, w) if N == 8192 else (x, w, b)
                print_fraction(f"round {round_} {'rms' if N == 8192 else 'layer'} N={N}: {name}",
                               lambda: fn(*args), 2 * x.numel() * 2, copy_bw)


if __name__ == "__main__":
    experiment(check, lambda: None, main)
