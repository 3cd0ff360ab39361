"""Experiment for the next GPU session: the norms' dweight / dbias finished by one Triton
launch instead of torch ops, to cut the host time of the backward on the engine's worker
thread.

The library's norm backward ends with dw.sum(0) and dw.to(weight dtype) (LayerNorm: the
same for db): two to four torch ops, ~25 us each of host time on the worker thread of the
H200 machine (scripts/exp_backward_timeline.py: 76 us after the launch for RMSNorm, 100 for
LayerNorm), in steps that are host-bound on some runs. Here one kernel sums the float32
partials (a row per backward program) over the programs in a fixed order and writes them
in the parameters' dtypes. For the partial shapes of the library's rows plan at N = 1024,
4096 and 8192 (M * N = 2^27), with and without dbias, it times both ways of finishing:
- host time inside an autograd backward (the worker thread), median of the calls;
- their GPU time (torch.profiler): a slower reduction would add to the step's GPU time.
Predicted: ~25-60 us less host time a step (LayerNorm the most), the same GPU time within
a few us. Session 6 (H200): LayerNorm 30-39 us less, RMSNorm -9 to +4 us (table in
docs/perf-notes.md); the kernel moved into pintail/norm.py (with ~128 programs or more
instead of this experiment's 64 columns a program), which this script now calls.

    python scripts/exp_norm_partials.py
"""

import importlib

import torch

norm = importlib.import_module("pintail.norm")
launch_module = importlib.import_module("pintail._launch")


def finish_by_kernel(dw_parts, db_parts, w_dtype, b_dtype):
    """What the library does since session 6 (pintail/norm.py: _sum_partials)."""
    return norm._sum_partials(dw_parts, db_parts, w_dtype, b_dtype)


def finish_by_torch(dw_parts, db_parts, w_dtype, b_dtype):
    """What the library did before session 6 (torch ops after the backward kernel)."""
    return dw_parts.sum(0).to(w_dtype), (db_parts.sum(0).to(b_dtype) if db_parts is not None else None)


def check(device):
    for parts, N in ((5, 33), (70, 100), (3, 1)):
        dw_parts = torch.randn(parts, N, device=device)
        db_parts = torch.randn(parts, N, device=device)
        for dtype in (torch.float32, torch.bfloat16):
            got = finish_by_kernel(dw_parts, db_parts, dtype, dtype)
            want = finish_by_torch(dw_parts.double(), db_parts.double(), torch.float64, torch.float64)
            for g, w in zip(got, want):
                assert g.dtype == dtype
                torch.testing.assert_close(g.double(), w, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                           atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        assert torch.equal(finish_by_kernel(dw_parts, None, torch.float32, None)[0],
                           finish_by_kernel(dw_parts, db_parts, torch.float32, torch.float32)[0])
    print(f"partials kernel matches torch ({device})", flush=True)


def main():
    from exp_engine_thread import make_function
    from exp_host_gaps import kernels_of
    check(torch.device("cuda"))
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    dy = torch.ones_like(x)
    for N in (1024, 4096, 8192):
        for rms in (True, False):
            cfg = norm.backward_config(N, rms)
            M = 2**27 // N
            parts = max(1, min(launch_module.cdiv(M, cfg["BLOCK_M"]),
                               launch_module.program_slots(x.device, cfg["PROGRAMS_PER_SM"])))
            dw_parts = torch.randn(parts, N, device="cuda")
            db_parts = None if rms else torch.randn(parts, N, device="cuda")
            for name, finish in (("torch ops", finish_by_torch), ("one kernel", finish_by_kernel)):
                work = lambda: finish(dw_parts, db_parts, torch.bfloat16, torch.bfloat16)
                work()
                seen = []
                y = make_function(work, seen).apply(x)
                for _ in range(300):
                    torch.autograd.grad(y, x, dy, retain_graph=True)
                torch.cuda.synchronize()
                inside = sorted(seen)[len(seen) // 2] * 1e6
                gpu = sum(us for _, us in kernels_of(work).values())
                print(f"N={N} {'rms' if rms else 'layer'} ({parts} partials), {name}: {inside:.1f} us of host time "
                      f"inside a backward, {gpu:.1f} us of GPU time", flush=True)


if __name__ == "__main__":
    import sys
    if "--check" in sys.argv:  # the interpreter (TRITON_INTERPRET=1) on a CPU
        check(torch.device("cpu"))
    else:
        main()
