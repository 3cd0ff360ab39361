"""Where the bench loses to the kernels alone, on a GPU: per step of the bench (through
autograd, as pintail.bench times it) the GPU time (do_bench), the host time of one call (a
loop of calls, one synchronisation: no L2 flush in between), and the kernels one call runs
(torch.profiler: name, count, GPU us). Then the host time of a Triton launch three ways:
kernel[grid](...), the CompiledKernel from kernel.warmup(...)[grid](...), and
CompiledKernel.run(...) with the stream looked up once.

    python scripts/exp_host_gaps.py
"""

import torch
from measure import Identity, host_us, time_ms

import pintail
from pintail import bench, norm
from pintail._launch import launch


def kernels_of(fn, calls=3):
    """GPU kernels of one call: {name: (count per call, us per call)}."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.key[:60]] = (e.count / calls, e.device_time_total / calls)
    return out


def steps():
    ops = bench._ops()
    cases = [("rms_norm", "bwd", 1024), ("rms_norm", "bwd", 4096), ("rms_norm", "bwd", 8192),
             ("layer_norm", "bwd", 8192), ("rms_norm_residual", "bwd", 1024), ("rotary", "bwd", 4096),
             ("rotary", "fwd", 4096), ("cross_entropy", "fwd+bwd", 32768), ("cross_entropy", "fwd", 32768)]
    for name, direction, N in cases:
        op = ops[name]
        M = op.rows(N) if op.rows else 2**27 // N
        inputs, others = op.make(M, N, torch.bfloat16, "cuda")
        step = bench._step(op.pintail, direction, inputs, others)
        ms = time_ms(step)
        us = host_us(step, calls=100)
        print(f"{name} {direction} N={N}: do_bench {ms * 1e3:.0f} us, host {us:.0f} us per call", flush=True)
        for k, (count, gpu_us) in sorted(kernels_of(step).items(), key=lambda kv: -kv[1][1]):
            print(f"    {count:.0f}x {gpu_us:8.1f} us  {k}", flush=True)
        del inputs, others, step
        torch.cuda.empty_cache()



def engine():
    """Host time of the autograd engine around a Python node that does nothing, and of the
    RMSNorm backward's tensor-level function called directly (no engine)."""
    x = torch.randn(8, 1024, device="cuda", requires_grad=True)
    y = Identity.apply(x)
    dy = torch.randn_like(y)
    us = host_us(lambda: torch.autograd.grad(y, x, dy, retain_graph=True))
    print(f"autograd.grad of an identity Function: {us:.1f} us")
    w = torch.randn(1024, device="cuda", requires_grad=True)
    out = pintail.rms_norm(x, (1024,), w)
    print(f"autograd.grad of rms_norm (8 x 1024): "
          f"{host_us(lambda: torch.autograd.grad(out, (x, w), dy, retain_graph=True)):.1f} us")
    _, _, mean, rstd = norm._forward(x.detach(), None, w.detach(), None, 1e-6, 0.0, True, x.dtype)
    us = host_us(lambda: norm._backward(dy, None, x.detach(), w.detach(), False, mean, rstd, 0.0, True, x.dtype))
    print(f"norm._backward direct: {us:.1f} us")
    ref = torch.nn.functional.rms_norm(x, (1024,), w)
    print(f"autograd.grad of torch's rms_norm: "
          f"{host_us(lambda: torch.autograd.grad(ref, (x, w), dy, retain_graph=True)):.1f} us", flush=True)


def launches():
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(8, device="cuda")
    args = (x, x, x, w, w, y, rstd, rstd, 8, 1024, 1.0 / 1024, x.stride(0), 0, 0, y.stride(0), 1e-6, 0.0)
    flags = dict(RMS=True, HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, BLOCK_M=2, BLOCK_N=1024, ALIGN=1)
    kernel = norm._forward_rows_kernel
    grid = (4, 1, 1)
    print(f"kernel[grid](...): {host_us(lambda: kernel[grid](*args, **flags, num_warps=4)):.1f} us", flush=True)
    compiled = kernel.warmup(*args, **flags, num_warps=4, grid=grid)
    full = (*args, *flags.values())  # the launcher takes every parameter, constexprs included
    print(f"compiled[grid](...): {host_us(lambda: compiled[grid](*full)):.1f} us", flush=True)
    stream = torch.cuda.current_stream().cuda_stream
    compiled._init_handles()

    def direct():
        compiled.run(4, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)
    direct()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (1024,), w, 1e-6))
    print(f"compiled.run(...): {host_us(direct):.1f} us", flush=True)
    print(f"pintail._launch.launch(...): {host_us(lambda: launch(kernel, grid, *args, **flags, num_warps=4)):.1f} us",
          flush=True)
    print(f"torch.empty x2: {host_us(lambda: (torch.empty_like(x), torch.empty(8, device='cuda'))):.1f} us")
    print(f"x.add(1): {host_us(lambda: x.add(1)):.1f} us")


if __name__ == "__main__":
    launches()
    engine()
    steps()
