"""Experiment for the next GPU session: the softmax split plan carried over to the RMSNorm
forward over long rows (N >= 32768, where the long plan measures 0.60-0.86 of copy on the
H200). Ticket-ordered persistent programs read slice s of row r, publish its sum of squares
as a self-flagging word (pintail/softmax.py's _publish / _wait_for_row / _ticket_work; the
low half is 1.0, so the word is never 0), and write slice s of row r - lag, re-read from L2,
once every slice of that row has published. HBM traffic: x once, y once.

Checks the kernel against torch first (in the interpreter too: TRITON_INTERPRET=1, small
sizes), then on a GPU times it beside the library's current plan, as fractions of the copy
bandwidth of the same run (bf16, M*N = 2^27, weight).

    python scripts/exp_norm_split.py
"""

import importlib
import itertools

import torch
import triton
import triton.language as tl

sm = importlib.import_module("pintail.softmax")
norm = importlib.import_module("pintail.norm")


@triton.jit
def rms_forward_split_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, slots_ptr, M, N, inv_n, eps, x_row_stride, y_row_stride,
                             SLICES, LAG, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = sm._ticket_work(ticket, SLICES, LAG, BLOCK)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=(cols < N) & (row < M), other=0.0).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0), other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            sm._publish(slots_ptr, ticket, tl.sum(x_new * x_new, axis=0), tl.full((), 1.0, tl.float32))
        if done >= 0:
            sums, _, valid = sm._wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            rstd = 1.0 / tl.sqrt(tl.sum(tl.where(valid, sums, 0.0), axis=0) * inv_n + eps)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(y_ptr + done * y_row_stride + cols, (x_old * rstd * w).to(y_ptr.dtype.element_ty), mask=cols < N)
            tl.store(rstd_ptr + done, rstd, mask=ticket % SLICES == 0)
        ticket = next_ticket


def rms_forward_split(x, w, eps, cfg):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    slices, lag, grid, slots = sm._split_plan(M, N, cfg, x.device)
    rms_forward_split_kernel[grid](x, w, y, rstd, slots, M, N, 1.0 / N, eps, x.stride(0), y.stride(0), slices, lag,
                                   BLOCK=cfg["BLOCK"], SLICES_POW2=triton.next_power_of_2(slices),
                                   num_warps=cfg["num_warps"])
    return y, rstd


def check(device):
    for M, N, block in ((5, 1000, 128), (3, 4097, 1024)):
        x = torch.randn(M, N, device=device)
        w = torch.randn(N, device=device)
        cfg = {"BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}
        y, rstd = rms_forward_split(x, w, 1e-6, cfg)
        truth = torch.nn.functional.rms_norm(x.double(), (N,), w.double(), 1e-6)
        err = (y.double() - truth).abs().max().item()
        assert err < 1e-4, f"M={M} N={N}: max error {err}"
        assert torch.allclose(rstd.double(), x.double().square().mean(1).add(1e-6).rsqrt(), rtol=1e-5)
    print("split RMSNorm forward matches torch", flush=True)


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(device)
    if device.type != "cuda":
        return
    from triton.testing import do_bench
    big = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    copy_bw = 4 * big.numel() / (do_bench(lambda: torch.empty_like(big).copy_(big), return_mode="median") * 1e-3)
    del big
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in (32768, 131072, 262144):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * 2
        runs = {"library": lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)}
        for block, warps, per_sm, rounds in itertools.product((4096, 8192), (4, 8), (2, 4), (0.5, 1)):
            cfg = {"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "LAG_ROUNDS": rounds}
            runs[f"split {cfg}"] = lambda cfg=cfg: rms_forward_split(x, w, 1e-6, cfg)
        for name, fn in runs.items():
            ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            print(f"N={N} {name}: {ms:.4f} ms {nbytes / (ms * 1e-3) / copy_bw:.3f}", flush=True)


if __name__ == "__main__":
    main()
