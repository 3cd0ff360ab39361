"""Experiment for the next GPU session: the softmax split plan carried over to RMSNorm and
LayerNorm, forward and backward, over long rows (forward N >= 32768, where the long plan measures 0.60-0.86 of copy on the H200;
backward N >= 16384, 0.55-0.56). Ticket-ordered persistent programs read slice s of row r, publish its sum of squares
as a self-flagging word (pintail/softmax.py's _publish / _wait_for_row / _ticket_work; the
low half is 1.0, so the word is never 0), and write slice s of row r - lag, re-read from L2,
once every slice of that row has published. HBM traffic: x once, y once.

The backward publishes each slice's sum of g * x^ (g = dy * w) the same way and writes dx
lagged. Its weight gradient must come out the same on every run although tickets go to
programs in no fixed order: rows are dealt into G groups (r mod G), and group g keeps one
float32 accumulator row per slice column; ticket (r, s) adds its dy * x^ to acc[g, s-th
slice] only after row r - G has (a count per (g, s), acquire / release), so every column is
summed in row order. The wait is on a smaller ticket, held by a running program that never
waits on a larger one: no deadlock (the softmax argument). dweight = acc.sum(0) by torch.

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
def forward_split_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, slots_ptr, M, N, inv_n, eps, x_row_stride,
                         y_row_stride, SLICES, LAG, RMS: tl.constexpr, BLOCK: tl.constexpr,
                         SLICES_POW2: tl.constexpr):
    # Published per slice: RMS (sum x^2, 1.0); LayerNorm (mean, M2) of s = x - pilot (the
    # row's first value) over the slice, M2's lowest mantissa bit set so that the word is
    # never 0 (a constant slice has mean 0 and M2 0; the bit adds 1.4e-45 or one ulp).
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = sm._ticket_work(ticket, SLICES, LAG, BLOCK)
        new = (cols < N) & (row < M)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=new, other=0.0).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=(cols < N) & (done >= 0), other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
        if row < M:
            if RMS:
                sm._publish(slots_ptr, ticket, tl.sum(x_new * x_new, axis=0), tl.full((), 1.0, tl.float32))
            else:
                s = tl.where(new, x_new - tl.load(x_ptr + row * x_row_stride).to(tl.float32), 0.0)
                count = tl.minimum(N - (ticket % SLICES) * BLOCK, BLOCK) * 1.0
                slice_mean = tl.sum(s, axis=0) / count
                m2 = tl.sum(tl.where(new, (s - slice_mean) * (s - slice_mean), 0.0), axis=0)
                m2 = (m2.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
                sm._publish(slots_ptr, ticket, slice_mean, m2)
        if done >= 0:
            his, los, valid = sm._wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            if RMS:
                rstd = 1.0 / tl.sqrt(tl.sum(tl.where(valid, his, 0.0), axis=0) * inv_n + eps)
                y = x_old * rstd * w
            else:  # Chan et al.: merge the slices' (count, mean, M2)
                k = tl.arange(0, SLICES_POW2)
                counts = tl.where(valid, tl.minimum(N - k * BLOCK, BLOCK), 0) * 1.0
                mean = tl.sum(counts * his, axis=0) * inv_n
                m2 = tl.sum(tl.where(valid, los + counts * (his - mean) * (his - mean), 0.0), axis=0)
                rstd = 1.0 / tl.sqrt(m2 * inv_n + eps)
                pilot = tl.load(x_ptr + done * x_row_stride).to(tl.float32)
                b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                y = ((x_old - pilot) - mean) * rstd * w + b
                tl.store(mean_ptr + done, pilot + mean, mask=ticket % SLICES == 0)
            tl.store(y_ptr + done * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)
            tl.store(rstd_ptr + done, rstd, mask=ticket % SLICES == 0)
        ticket = next_ticket


def forward_split(x, w, b, eps, cfg):
    """RMSNorm (b None) or LayerNorm of rows x[M, N]: (y, mean, rstd)."""
    M, N = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    slices, lag, grid, slots = sm._split_plan(M, N, cfg, x.device)
    forward_split_kernel[grid](x, w, b if b is not None else w, y, mean, rstd, slots, M, N, 1.0 / N, eps, x.stride(0),
                               y.stride(0), slices, lag, RMS=b is None, BLOCK=cfg["BLOCK"],
                               SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])
    return y, mean, rstd


@triton.jit
def backward_split_kernel(x_ptr, w_ptr, dy_ptr, mean_ptr, rstd_ptr, dx_ptr, acc_ptr, counts_ptr, slots_ptr, M, N,
                          inv_n, x_row_stride, dy_row_stride, dx_row_stride, SLICES, LAG, GROUPS,
                          RMS: tl.constexpr, BLOCK: tl.constexpr, SLICES_POW2: tl.constexpr):
    # Published per slice: (sum g, sum g x^) with g = dy * w; for RMS the first is 1.0 (the
    # word is never 0), for LayerNorm its lowest mantissa bit is set (a slice of zeros would
    # publish (0, 0); the bit adds 1.4e-45 or one ulp). acc[group] holds dweight, and for
    # LayerNorm acc[GROUPS + group] dbias, summed in row order per slice column.
    end = (M + LAG) * SLICES
    ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")
    while ticket < end:
        row, done, cols = sm._ticket_work(ticket, SLICES, LAG, BLOCK)
        slice_index = ticket % SLICES
        new = (cols < N) & (row < M)
        old = (cols < N) & (done >= 0)
        x_new = tl.load(x_ptr + row * x_row_stride + cols, mask=new, other=0.0).to(tl.float32)
        dy_new = tl.load(dy_ptr + row * dy_row_stride + cols, mask=new, other=0.0).to(tl.float32)
        x_old = tl.load(x_ptr + done * x_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        dy_old = tl.load(dy_ptr + done * dy_row_stride + cols, mask=old, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        next_ticket = tl.atomic_add(slots_ptr, 1, sem="relaxed")

        if row < M:
            if RMS:
                x_hat = x_new * tl.load(rstd_ptr + row)
                sum_g = tl.full((), 1.0, tl.float32)
            else:
                x_hat = tl.where(new, x_new - tl.load(mean_ptr + row), 0.0) * tl.load(rstd_ptr + row)
                sum_g = tl.sum(dy_new * w, axis=0)
                sum_g = (sum_g.to(tl.int32, bitcast=True) | 1).to(tl.float32, bitcast=True)
            sm._publish(slots_ptr, ticket, sum_g, tl.sum(dy_new * w * x_hat, axis=0))
            # this row's dweight (and dbias) terms, added to its group's accumulator in row order
            group = row % GROUPS
            count_ptr = counts_ptr + group * SLICES + slice_index
            turn = (row // GROUPS).to(tl.int32)
            while tl.atomic_add(count_ptr, 0, sem="acquire") != turn:
                pass
            acc = acc_ptr + group * N + cols
            tl.store(acc, tl.load(acc, mask=cols < N, other=0.0, cache_modifier=".cg") + dy_new * x_hat,
                     mask=cols < N)
            if not RMS:
                acc_b = acc + GROUPS * N
                tl.store(acc_b, tl.load(acc_b, mask=cols < N, other=0.0, cache_modifier=".cg") + dy_new,
                         mask=cols < N)
            tl.atomic_add(count_ptr, 1, sem="release")

        if done >= 0:
            sums_g, sums_gx, valid = sm._wait_for_row(slots_ptr, done, SLICES, SLICES_POW2)
            mean_gx = tl.sum(tl.where(valid, sums_gx, 0.0), axis=0) * inv_n
            rstd = tl.load(rstd_ptr + done)
            g = dy_old * w
            if RMS:
                dx = rstd * (g - x_old * rstd * mean_gx)
            else:
                mean_g = tl.sum(tl.where(valid, sums_g, 0.0), axis=0) * inv_n
                dx = rstd * (g - mean_g - (x_old - tl.load(mean_ptr + done)) * rstd * mean_gx)
            tl.store(dx_ptr + done * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < N)
        ticket = next_ticket


def backward_split(x, w, dy, mean, rstd, rms, cfg):
    """(dx, dweight, dbias or None) of RMSNorm (rms) or LayerNorm (with a bias) rows."""
    M, N = x.shape
    dx = torch.empty_like(x)
    slices, lag, grid, slots = sm._split_plan(M, N, cfg, x.device)
    # enough groups that a row's turn has come by the time its ticket does (about two
    # persistent rounds of tickets between rows r - G and r)
    groups = max(1, min(M, triton.cdiv(2 * grid[0], slices)))
    acc = torch.zeros(1 if rms else 2, groups, N, dtype=torch.float32, device=x.device)
    counts = torch.zeros(groups * slices, dtype=torch.int32, device=x.device)
    backward_split_kernel[grid](x, w, dy, mean, rstd, dx, acc, counts, slots, M, N, 1.0 / N, x.stride(0),
                                dy.stride(0), dx.stride(0), slices, lag, groups, RMS=rms, BLOCK=cfg["BLOCK"],
                                SLICES_POW2=triton.next_power_of_2(slices), num_warps=cfg["num_warps"])
    sums = acc.sum(1)
    return dx, sums[0], (None if rms else sums[1])


def check(device):
    for M, N, block in ((5, 1000, 128), (3, 4097, 1024)):
        x = torch.randn(M, N, device=device) * 0.1 + 1000.0  # a large mean: LayerNorm's pilot shift
        w, b = torch.randn(N, device=device), torch.randn(N, device=device)
        cfg = {"BLOCK": block, "num_warps": 4, "PROGRAMS_PER_SM": 4, "LAG_ROUNDS": 1}
        y, mean, rstd = forward_split(x, w, b, 1e-5, cfg)
        x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
        truth = torch.nn.functional.layer_norm(x64, (N,), w64, b64, 1e-5)
        err = (y.double() - truth).abs().max().item() / truth.abs().max().item()
        assert err < 1e-3, f"LayerNorm M={M} N={N}: relative error {err}"  # x itself keeps ~4 digits of x - mean
        dy = torch.randn(M, N, device=device)
        grads = backward_split(x, w, dy, mean, rstd, False, cfg)
        for g, t in zip(grads, torch.autograd.grad(truth, (x64, w64, b64), dy.double())):
            err = (g.double() - t).abs().max().item() / t.abs().max().item()
            assert err < 1e-3, f"LayerNorm M={M} N={N}: backward relative error {err}"
        x = torch.randn(M, N, device=device)
        y, _, rstd = forward_split(x, w, None, 1e-6, cfg)
        truth = torch.nn.functional.rms_norm(x.double(), (N,), w.double(), 1e-6)
        err = (y.double() - truth).abs().max().item()
        assert err < 1e-4, f"M={M} N={N}: max error {err}"
        assert torch.allclose(rstd.double(), x.double().square().mean(1).add(1e-6).rsqrt(), rtol=1e-5)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        dy = torch.randn(M, N, device=device)
        truth = torch.autograd.grad(torch.nn.functional.rms_norm(x64, (N,), w64, 1e-6), (x64, w64), dy.double())
        grads = backward_split(x, w, dy, rstd, rstd, True, cfg)[:2]
        for g, t in zip(grads, truth):
            err = (g.double() - t).abs().max().item() / t.abs().max().item()
            assert err < 1e-5, f"M={M} N={N}: backward relative error {err}"
        again = backward_split(x, w, dy, rstd, rstd, True, cfg)
        assert torch.equal(again[1], grads[1]), "dweight differs between runs"
    print("split RMSNorm and LayerNorm, forward and backward, match torch", flush=True)


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(device)
    if device.type != "cuda":
        return
    from measure import copy_bandwidth, time_ms
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    for N in (16384, 32768, 131072, 262144):
        M = 2**27 // N
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        _, _, _, rstd = norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)
        _, _, mean_l, rstd_l = norm._forward(x, None, w, w, 1e-5, 0.0, False, x.dtype)
        runs = {"fwd library": (2, lambda: norm._forward(x, None, w, None, 1e-6, 0.0, True, x.dtype)),
                "bwd library": (3, lambda: norm._backward(dy, None, x, w, False, rstd, rstd, 0.0, True, x.dtype)),
                "layer fwd library": (2, lambda: norm._forward(x, None, w, w, 1e-5, 0.0, False, x.dtype)),
                "layer bwd library": (3, lambda: norm._backward(dy, None, x, w, True, mean_l, rstd_l, 0.0, False,
                                                                 x.dtype))}
        for block, warps, per_sm, rounds in itertools.product((4096, 8192), (4, 8), (2, 4), (0.5, 1)):
            cfg = {"BLOCK": block, "num_warps": warps, "PROGRAMS_PER_SM": per_sm, "LAG_ROUNDS": rounds}
            runs[f"fwd split {cfg}"] = (2, lambda cfg=cfg: forward_split(x, w, None, 1e-6, cfg))
            runs[f"layer fwd split {cfg}"] = (2, lambda cfg=cfg: forward_split(x, w, w, 1e-5, cfg))
            if block == 4096:
                runs[f"bwd split {cfg}"] = (3, lambda cfg=cfg: backward_split(x, w, dy, rstd, rstd, True, cfg))
                runs[f"layer bwd split {cfg}"] = (3, lambda cfg=cfg: backward_split(x, w, dy, mean_l, rstd_l, False,
                                                                                    cfg))
        for name, (passes, fn) in runs.items():
            ms = time_ms(fn)
            print(f"N={N} {name}: {ms:.4f} ms {passes * x.numel() * 2 / (ms * 1e-3) / copy_bw:.3f}", flush=True)


if __name__ == "__main__":
    main()
