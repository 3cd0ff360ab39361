"""Shared by the tuning and experiment scripts: GPU time of a call, the copy ceiling of the
run, host time of a call, the sweep over plans and shapes with its best configuration per
shape, the sizes loop of the long-row experiments, and an autograd node that does nothing
(the engine's own cost)."""

import argparse
import functools
import json
import os
import time

import torch


def time_ms(fn, rep=40):
    """Median GPU time of fn in ms (triton's do_bench: L2 flushed before each call)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=200, rep=rep, return_mode="median")  # 200 ms: clocks up after an idle pause


def copy_bandwidth():
    """Bytes per second of y.copy_(x) over 2^30 bf16 elements: the ceiling every fraction
    is taken of (benchmarks/README.md)."""
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (time_ms(lambda: y.copy_(x)) * 1e-3)


def rotary_inputs(interleaved=False):
    """The benchmark protocol's rotary shape: q (8, 32, 4096, 128) and k (8, 8, 4096, 128) bf16, (batch,
    heads, seq, dim), and the float32 cos / sin tables of a column per feature (Hugging Face's
    halves, or GPT-J's pairs side by side)."""
    q = torch.randn(8, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv_freq)
    table = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
    return q, k, table.cos(), table.sin()


def norm_backward_inputs(norm, N, rms):
    """A norm backward's inputs at the bench's shape (M * N = 2^27, bf16): x, the weight,
    LayerNorm's bias (None for RMSNorm), dy, and mean / rstd from the library's forward."""
    x = torch.randn(2**27 // N, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    b = None if rms else torch.randn(N, device="cuda", dtype=torch.bfloat16)
    _, _, mean, rstd = norm._forward(x, None, w, b, 1e-6, 0.0, rms, x.dtype)
    return x, w, b, torch.randn_like(x), mean, rstd


def host_us(fn, calls=300):
    """Host time of one call in us: a loop of calls, then one synchronisation."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def record(results, direction, N, cfg, fn, nbytes, copy_bw, default):
    """Time one configuration, append it to results and print it; a configuration that
    fails to compile or launch (e.g. out of registers) is printed and skipped."""
    try:
        ms = time_ms(fn)
    except Exception as e:
        print(f"{direction} N={N} {cfg}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
        return
    frac = nbytes / (ms * 1e-3) / copy_bw
    results.append({"direction": direction, "N": N, "config": cfg, "ms": ms, "fraction": frac,
                    "default": cfg == default})
    print(f"{direction} N={N} {cfg}: {ms:.4f} ms {frac:.3f}{' (default)' if cfg == default else ''}", flush=True)


def print_best(results, directions, sizes):
    """Per direction and N: the best configuration and the library's default."""
    print("\nbest per shape:")
    for direction in directions:
        for N in sizes:
            rows = [r for r in results if r["direction"] == direction and r["N"] == N]
            if not rows:
                continue
            best = max(rows, key=lambda r: r["fraction"])
            default = next((r for r in rows if r["default"]), None)
            print(f"{direction} N={N}: best {best['fraction']:.3f} {best['config']}; default "
                  f"{default['fraction'] if default else float('nan'):.3f}", flush=True)


def tune_parser(doc):
    """The sweeps' common options: where the JSON goes, which row lengths and directions,
    the default plan alone or only some plans."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=doc.split("\n\n", 1)[-1])
    p.add_argument("--out", default=".", help="folder for the JSON results")
    p.add_argument("--sizes", default="1024,4096,8192,16384,32768,65536,131072,262144", help="row lengths N")
    p.add_argument("--directions", default="fwd,bwd")
    p.add_argument("--default-only", action="store_true", help="time the library's default plan alone")
    p.add_argument("--plans", default="", help="only these plans (and the default), e.g. cluster,split")
    return p


def sweep(args, shape, name):
    """Time each candidate config of every direction and row length N (M = 2^27 / N rows),
    save the results as args.out/name and print the best per shape. shape(direction, N, M)
    returns the library's default config, the candidates, a launch(cfg) that runs one, and
    the bytes a launch must move."""
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    directions, sizes = args.directions.split(","), [int(n) for n in args.sizes.split(",")]
    plans = [p for p in args.plans.split(",") if p]
    results = []
    for direction in directions:
        for N in sizes:
            default, candidates, launch, nbytes = shape(direction, N, 2**27 // N)
            candidates = [default] + [cfg for cfg in candidates if cfg != default and not args.default_only
                                      and (not plans or cfg["plan"] in plans)]
            for cfg in candidates:
                record(results, direction, N, cfg, functools.partial(launch, cfg), nbytes, copy_bw, default)
            del launch  # its tensors, before the next shape's
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, name), "w") as f:
        json.dump({"copy_tbps": copy_bw / 1e12, "results": results}, f, indent=1)
    print_best(results, directions, sizes)


def checked_copy_bandwidth(check):
    """An experiment's start: check(device) (on the CPU machine: in the interpreter), then on
    a GPU the copy ceiling in bytes per second, printed; None without a GPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(device)
    if device.type != "cuda":
        return None
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    return copy_bw


def long_rows(check, sizes=(32768, 131072, 262144)):
    """An experiment's frame: checked_copy_bandwidth, then per N (N, M, copy bytes per
    second) with M*N = 2^27."""
    copy_bw = checked_copy_bandwidth(check)
    if copy_bw is None:
        return
    for N in sizes:
        yield N, 2**27 // N, copy_bw


def print_fraction(label, fn, nbytes, copy_bw):
    """Time fn and print its ms and fraction of the copy bandwidth; a call that fails (a
    configuration the shape does not allow) is printed and skipped."""
    try:
        ms = time_ms(fn)
    except Exception as e:
        print(f"{label}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
        return
    print(f"{label}: {ms:.4f} ms {nbytes / (ms * 1e-3) / copy_bw:.3f}", flush=True)


def check_and_time_softmax(label, fn, log, x, nbytes, copy_bw):
    """fn() (log_)softmax of x along its rows: its largest error against torch's in float32,
    then its time as print_fraction prints it; a call that fails is printed and skipped."""
    try:
        err = (fn().float() - (torch.log_softmax if log else torch.softmax)(x.float(), -1)).abs().max().item()
    except Exception as e:
        print(f"{label}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    print_fraction(f"{label} (err {err:.1e})", fn, nbytes, copy_bw)


def softmax_forms(forms_of, sizes):
    """The frame of a softmax forward experiment on the GPU: per N (bf16 rows, M*N = 2^27),
    the library and each (label, function of log) of forms_of(N, x), softmax then
    log_softmax, checked and timed (check_and_time_softmax)."""
    import pintail
    for N, M, copy_bw in long_rows(lambda device: None, sizes=sizes):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3
        forms = [("library", lambda log: (pintail.log_softmax if log else pintail.softmax)(x))] + forms_of(N, x)
        for log in (False, True):
            for label, fn in forms:
                check_and_time_softmax(f"N={N} {label} log={log}", lambda: fn(log), log, x, 2 * x.numel() * 2,
                                       copy_bw)


class Identity(torch.autograd.Function):
    """An autograd node that does nothing: what the engine costs around a Python node."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def experiment(check, inspect, main):
    """An experiment script's command line: --check runs check(cpu) (in the interpreter,
    with TRITON_INTERPRET=1), --inspect compiles for sm_90 on the CPU machine, else main()
    (on a GPU: check, then time)."""
    import sys
    if "--check" in sys.argv:
        check(torch.device("cpu"))
    elif "--inspect" in sys.argv:
        inspect()
    else:
        main()
