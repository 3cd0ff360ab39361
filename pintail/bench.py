"""python -m pintail.bench: the benchmark on a GPU, a kernel check on a CPU.

On a GPU it follows benchmarks/README.md's protocol: measure the copy ceiling (y.copy_(x), 2^30
bf16 elements), then for each op, direction and shape (the benchmark protocol's (benchmarks/README.md) real model shapes;
--suite sweep: each op's powers of two) time pintail, PyTorch eager and
torch.compile(dynamic=False) with triton.testing.do_bench (median, L2 flushed), and report
each as ms, TB/s and a fraction of the copy bandwidth of the same run. It prints a table and
writes results.json and bandwidth.png into --out.

Without a GPU (or with --check on one) it checks every op's kernels, forward and backward,
at small ragged sizes against float64 torch (on a CPU in the Triton interpreter), prints a
pass/fail table, and exits non-zero on a failure. On a GPU that check is what
`compute-sanitizer --tool memcheck python -m pintail.bench --check` runs.
"""

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _matrix(M, N, dtype, device):
    return (torch.randn(M, N, device=device, dtype=dtype),), ()


# (2, 20000): softmax's two-pass forward, the norms' long forward; (2, 40000): every op's
# plan for rows past 32768
# 1001: rows from 16-byte boundaries; 5120: a hidden size the norms' rows plans take as two tiles
CHECK_SIZES = [(3, 1), (5, 7), (4, 1000), (3, 1001), (2, 5120), (2, 20000), (2, 40000)]


@dataclass
class Op:
    """One op as the bench sees it. `make(M, N, dtype, device)` gives (differentiable inputs,
    other inputs); the functions take both, in that order. Bytes are counted on the
    differentiable inputs: `directions` maps each direction the op is timed in to the fewest
    bytes it must move per element of them, in units of their element size:
      fwd: the forward; bwd: the backward of a saved forward, torch.autograd.grad(outputs,
      inputs, random gradients); fwd+bwd: forward and backward of a scalar loss as one step."""
    pintail: Callable
    torch: Callable
    directions: dict
    sizes: tuple                             # default sizes N (row length; sequence length for rotary)
    rows: Callable = None                    # N -> M (default: --elements // N)
    make: Callable = _matrix
    unchecked: Callable = None               # pintail without its input checks (a 4th provider)
    check_sizes: list = None                 # (M, N) for the CPU check (default CHECK_SIZES)


def _hf_rotary(q, k, cos, sin):
    """Hugging Face's apply_rotary_pos_emb (Llama), the eager and compile baseline."""
    def rotate_half(x):
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    cos, sin = cos[None, None].to(q.dtype), sin[None, None].to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _ops():
    import pintail
    norm_sizes = (1024, 4096, 8192, 32768, 131072, 262144)

    def class_targets(M, N, dtype, device):
        return (torch.randn(M, N, device=device, dtype=dtype),), (torch.randint(0, N, (M,), device=device),)

    def probability_targets(M, N, dtype, device):
        return (torch.randn(M, N, device=device, dtype=dtype),), (torch.softmax(torch.randn(M, N, device=device),
                                                                                -1).to(dtype),)

    def class_targets_and_weights(M, N, dtype, device):
        return ((torch.randn(M, N, device=device, dtype=dtype) * 10,),
                (torch.randint(0, N, (M,), device=device), torch.rand(N, device=device, dtype=dtype) + 0.5))

    def torch_options(x, t, w):  # softcap as users write it before torch's loss
        return F.cross_entropy(OPTIONS_SOFTCAP * torch.tanh(x / OPTIONS_SOFTCAP), t, w, label_smoothing=0.1)

    def attention_heads(M, N, dtype, device):
        """benchmarks/README.md: q (8, 32, seq, 128), k (8, 8, seq, 128), (batch, heads, seq, dim); seq = N;
        M caps the batch (small in the CPU check)."""
        batch = min(M, 8)
        q = torch.randn(batch, 32, N, 128, device=device, dtype=dtype)
        k = torch.randn(batch, 8, N, 128, device=device, dtype=dtype)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 128, 2, device=device).float() / 128)
        freqs = torch.outer(torch.arange(N, device=device).float(), inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        return (q, k), (emb.cos(), emb.sin())

    def rows_and_weight(M, N, dtype, device):
        return (torch.randn(M, N, device=device, dtype=dtype), torch.randn(N, device=device, dtype=dtype)), ()

    def residual_rows_and_weight(M, N, dtype, device):
        return (torch.randn(M, N, device=device, dtype=dtype), torch.randn(M, N, device=device, dtype=dtype),
                torch.randn(N, device=device, dtype=dtype)), ()

    def torch_rms_norm_residual(x, residual, w):
        h = x + residual
        return F.rms_norm(h, (h.shape[-1],), w), h

    def head(M, N, dtype, device):
        """x (M, 32) and a head W (N, 32) ~ N(0, 1/32); class targets. The GPU benchmark times real
        heads instead (pintail/bench_heads.py)."""
        return ((torch.randn(M, 32, device=device, dtype=dtype),
                 (torch.randn(N, 32, device=device) / 32**0.5).to(dtype)),
                (torch.randint(0, N, (M,), device=device),))

    def two_heads(M, N, dtype, device):
        """A student (x, W) and a teacher (x_t, W_t), each as `head` makes them."""
        student, _ = head(M, N, dtype, device)
        return student, head(M, N, dtype, device)[0]

    def log_probs_and_entropy(x, t):
        logp = torch.log_softmax(x.float(), -1).to(x.dtype)
        return logp.gather(-1, t[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    def distillation(x, W, xt, Wt):  # beta 0.5: the Jensen-Shannon divergence, mean over rows
        p_s, p_t = torch.softmax(F.linear(x, W), -1), torch.softmax(F.linear(xt, Wt), -1)
        m = (p_s + p_t) / 2
        return (0.5 * F.kl_div(m.log(), p_t, reduction="sum") + 0.5 * F.kl_div(m.log(), p_s, reduction="sum")) / len(x)

    def gate_and_up(M, N, dtype, device):
        return (torch.randn(M, N, device=device, dtype=dtype), torch.randn(M, N, device=device, dtype=dtype)), ()

    F = torch.nn.functional
    return {
        # bytes per element of x: read x, write y (fwd); read x, dy, write dx (bwd); the
        # weight's N elements are not counted (small vectors ignored, benchmarks/README.md)
        "rms_norm": Op(lambda x, w: pintail.rms_norm(x, (x.shape[-1],), w),
                       lambda x, w: F.rms_norm(x, (x.shape[-1],), w), {"fwd": 2, "bwd": 3}, norm_sizes,
                       make=rows_and_weight),
        "layer_norm": Op(lambda x, w: pintail.layer_norm(x, (x.shape[-1],), w, w),
                         lambda x, w: F.layer_norm(x, (x.shape[-1],), w, w), {"fwd": 2, "bwd": 3}, norm_sizes,
                         make=rows_and_weight),
        # per element of x and of the residual: read both, write y and h (fwd); read h, dy, dh,
        # write dx (bwd; the residual's gradient is the same tensor)
        "rms_norm_residual": Op(lambda x, r, w: pintail.rms_norm(x, (x.shape[-1],), w, residual=r),
                                torch_rms_norm_residual, {"fwd": 2, "bwd": 2}, norm_sizes,
                                make=residual_rows_and_weight),
        "softmax": Op(lambda x: pintail.softmax(x, -1), lambda x: torch.softmax(x, -1),
                      {"fwd": 2, "bwd": 3}, norm_sizes),
        "log_softmax": Op(lambda x: pintail.log_softmax(x, -1), lambda x: torch.log_softmax(x, -1),
                          {"fwd": 2, "bwd": 3}, norm_sizes),
        # benchmarks/README.md: M = 4096 rows; 128256 and 151936 are real vocabularies (Llama 3, Qwen 2)
        "cross_entropy": Op(pintail.cross_entropy, torch.nn.functional.cross_entropy,
                            {"fwd": 1, "fwd+bwd": 3}, (32768, 128256, 131072, 151936, 262144),
                            rows=lambda N: 4096, make=class_targets,
                            unchecked=lambda x, t: pintail.cross_entropy(x, t, check_target=False)),
        # probability targets (no gradient to them): read x and y (fwd); then read x and y,
        # write dx (bwd). 50257: rows from 16-byte boundaries
        "cross_entropy_probs": Op(pintail.cross_entropy, torch.nn.functional.cross_entropy,
                                  {"fwd": 2, "fwd+bwd": 5}, (32768, 50257, 131072), rows=lambda N: 4096,
                                  make=probability_targets),
        # class weights, label smoothing 0.1 and a softcap of 30 (the weights' V elements not counted)
        "cross_entropy_options": Op(lambda x, t, w: pintail.cross_entropy(x, t, w, label_smoothing=0.1,
                                                                          softcap=OPTIONS_SOFTCAP),
                                    torch_options, {"fwd": 1, "fwd+bwd": 3}, (32768, 50257, 131072),
                                    rows=lambda N: 4096, make=class_targets_and_weights,
                                    # not V = 1: smoothing's gradient there cancels to 0 in float64, leaving
                                    # float32 rounding of terms the size of the weights (no relative error)
                                    check_sizes=[size for size in CHECK_SIZES if size[1] > 1]),
        # gate and up (tokens x intermediate each): read both, write the output (fwd: 3 per
        # position, 1.5 per input element); read dy, gate, up, write both gradients (bwd: 2.5)
        "swiglu": Op(pintail.swiglu, lambda g, u: F.silu(g) * u, {"fwd": 1.5, "bwd": 2.5},
                     (5632, 6144, 8192, 9216, 14336), rows=lambda N: 16384, make=gate_and_up),
        "geglu": Op(pintail.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u, {"fwd": 1.5, "bwd": 2.5},
                    (9216, 16384), rows=lambda N: 16384, make=gate_and_up),
        # the GPU benchmark has its own protocol and heads (bench_heads.py): no sizes here
        "linear_cross_entropy": Op(pintail.linear_cross_entropy, lambda x, W, t: F.cross_entropy(F.linear(x, W), t),
                                   {}, (), make=head, check_sizes=[(3, 1), (5, 7), (4, 1000), (3, 1001), (2, 3000)]),
        # log-probs and entropy of each row (the CPU check; no GPU sizes)
        "log_probs": Op(lambda x, t: pintail.log_probs(x, t, return_entropy=True), log_probs_and_entropy, {}, (),
                        make=class_targets),
        # the GPU benchmark has its own protocol and heads (bench_rl.py): no sizes here
        "linear_log_probs": Op(lambda x, W, t: pintail.linear_log_probs(x, W, t, return_entropy=True),
                               lambda x, W, t: log_probs_and_entropy(F.linear(x, W), t), {}, (), make=head,
                               check_sizes=[(3, 1), (5, 7), (4, 1000), (3, 1001), (2, 3000)]),
        "linear_distillation_loss": Op(lambda x, W, xt, Wt: pintail.linear_distillation_loss(x, W, xt, Wt, beta=0.5),
                                       distillation, {}, (), make=two_heads,
                                       check_sizes=[(3, 2), (5, 7), (4, 1000), (3, 1001), (2, 3000)]),
        "rotary": Op(lambda q, k, cos, sin: pintail.apply_rotary(q, k, cos, sin, layout="bhsd"), _hf_rotary,
                     {"fwd": 2, "bwd": 2}, (4096,), rows=lambda N: 8, make=attention_heads,
                     check_sizes=[(1, 3), (2, 17)]),
    }


# the benchmark protocol's (benchmarks/README.md) real model shapes: op -> (row lengths N, rows M for N). Hidden sizes of
# Llama-3.2-1B/3B, Gemma-2-2B, Qwen2.5-7B, Llama-3-8B, Qwen-14B and 70B-class models at 16384
# tokens, and the per-head q/k norm (16384 tokens x 32 heads rows of 128); vocabularies of
# Llama-2, GPT-2, Llama-3, Qwen2, GPT-4o-style and Gemma at 8192 tokens; the MLP widths.
HIDDEN = (2048, 2304, 3072, 3584, 4096, 5120, 7168, 8192)
VOCABULARIES = (32000, 50257, 128256, 151936, 200064, 256000)


def _norm_rows(N):
    return 16384 * 32 if N == 128 else 16384


MODEL_SHAPES = {
    "rms_norm": ((128,) + HIDDEN, _norm_rows), "layer_norm": (HIDDEN, lambda N: 16384),
    "rms_norm_residual": (HIDDEN, lambda N: 16384),
    "cross_entropy": (VOCABULARIES, lambda N: 8192),
    "softmax": ((2048, 4096, 128256), lambda N: 2**27 // N), "log_softmax": ((128256,), lambda N: 8192),
    "swiglu": ((5632, 6144, 8192, 9216, 14336), lambda N: 16384), "geglu": ((9216, 16384), lambda N: 16384),
}

DEFAULT_OPS = ["softmax", "cross_entropy", "rms_norm", "layer_norm", "rms_norm_residual", "rotary", "swiglu"]
OPTIONS_SOFTCAP = 30.0


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m pintail.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None,
                   help=f"comma-separated ops, or 'all' ({', '.join(_ops())}; linear_cross_entropy, "
                        "linear_log_probs and linear_distillation_loss time real heads on a GPU, each written to "
                        "<op>.json and <op>.md, linear_cross_entropy's as heads.json and heads.md); default: "
                        f"{','.join(DEFAULT_OPS)} on a GPU, all in the CPU check")
    p.add_argument("--directions", default=None,
                   help="comma-separated subset of fwd, bwd, fwd+bwd (default: every direction of each op)")
    p.add_argument("--sizes", default=None, help="comma-separated row lengths N (default: each op's own)")
    p.add_argument("--suite", default="models", choices=("models", "sweep"),
                   help="models: the benchmark protocol's (benchmarks/README.md) real model shapes (default); sweep: each op's powers of two")
    p.add_argument("--host-time", action="store_true",
                   help="instead: the host time of one call on small tensors (8 x 1024), pintail against eager")
    p.add_argument("--elements", type=int, default=2**27, help="M*N per shape (default 2^27)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--providers", default="pintail,eager,compile", help="default %(default)s")
    p.add_argument("--out", default="bench-out", help="folder for results.json and bandwidth.png")
    p.add_argument("--check", action="store_true",
                   help="on a GPU too: the kernel check against float64 torch instead of the benchmark")
    return p.parse_args(argv)


def _selected_ops(args, default):
    ops = _ops()
    names = list(ops) if (args.ops or default) == "all" else (args.ops or default).split(",")
    unknown = [n for n in names if n not in ops]
    if unknown:
        raise SystemExit(f"unknown op(s) {unknown}; expected some of {list(ops)}")
    return {n: ops[n] for n in names}


# ------------------------------------------------------------------------------- GPU


def _time_ms(fn):
    from triton.testing import do_bench
    gc.collect()  # no collector pause inside the timed region
    torch.cuda.synchronize()
    # 200 ms of warm-up, not do_bench's 25: the GPU's clocks fall while it idles (torch.compile
    # compiling the previous provider), and the first shape timed after such a pause ran up
    # to 1.5x slower.
    return do_bench(fn, warmup=200, rep=100, return_mode="median")


def _copy_bandwidth():
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = _time_ms(lambda: y.copy_(x))
    del x, y
    return 2 * 2**30 * 2 / (ms * 1e-3)


def _outputs(y):
    return y if isinstance(y, tuple) else (y,)


def _step(fn, direction, inputs, others):
    """A zero-argument function that runs one timed step of `direction` (see Op)."""
    if direction == "fwd":
        return lambda: fn(*inputs, *others)
    for t in inputs:
        t.requires_grad_(True)
    if direction == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(*inputs, *others), inputs)
    outputs = _outputs(fn(*inputs, *others))
    grads = [torch.randn_like(y) for y in outputs]
    return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


def benchmark(args):
    import triton
    # Inductor compiles in this process, not in a pool of workers that would go on using the
    # CPU while later shapes are timed (host time shows in do_bench at these sizes).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    ops = _selected_ops(args, ",".join(DEFAULT_OPS))
    dtype = DTYPES[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    providers = args.providers.split(",")
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    heads = ops.pop("linear_cross_entropy", None)
    if heads is not None:
        _benchmark_heads(args)
    for name in ("linear_log_probs", "linear_distillation_loss"):
        if ops.pop(name, None) is not None:
            _benchmark_rl(args, name)
    ops.pop("log_probs", None)
    if not ops:
        return 0
    copy_bw = _copy_bandwidth()
    print(f"copy ceiling: {copy_bw / 1e12:.2f} TB/s (y.copy_(x), 2^30 bf16 elements)", flush=True)

    if args.suite == "models":
        ops = {name: dataclasses.replace(op, sizes=MODEL_SHAPES[name][0], rows=MODEL_SHAPES[name][1])
               if name in MODEL_SHAPES else op for name, op in ops.items()}
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    wanted = args.directions.split(",") if args.directions else None
    plan = [(name, d, N) for name, op in ops.items() for d in op.directions if wanted is None or d in wanted
            for N in (sizes or op.sizes)]
    results = []
    for i, (name, direction, N) in enumerate(plan, 1):
        op = ops[name]
        M = op.rows(N) if op.rows else max(1, args.elements // N)
        for provider in providers + (["pintail_unchecked"] if op.unchecked and "pintail" in providers else []):
            torch._dynamo.reset()  # dynamic=False: one graph per shape, no recompile limit
            fn = {"pintail": op.pintail, "pintail_unchecked": op.unchecked, "eager": op.torch,
                  "compile": torch.compile(op.torch, dynamic=False)}[provider]
            inputs, others = op.make(M, N, dtype, "cuda")
            nbytes = sum(t.numel() for t in inputs) * elem * op.directions[direction]
            # The backward on the calling thread, not autograd's per-device worker: handing
            # each grad() to that thread put 0.1-0.3 ms of host time into some samples of the
            # ~0.2-0.45 ms steps, moving a row by up to 0.4 between runs with the same kernels.
            # The GPU work is the same; every provider alike.
            with torch.autograd.set_multithreading_enabled(False):
                ms = _time_ms(_step(fn, direction, inputs, others))
            tbps = nbytes / (ms * 1e-3) / 1e12
            results.append({"op": name, "direction": direction, "M": M, "N": N, "provider": provider,
                            "ms": ms, "tbps": tbps, "fraction_of_copy": tbps * 1e12 / copy_bw})
            print(f"[{i}/{len(plan)}] {name} {direction} M={M} N={N} {provider}: {ms:.4f} ms, "
                  f"{tbps:.2f} TB/s, {tbps * 1e12 / copy_bw:.2f} of copy", flush=True)
            del inputs, others
        torch.cuda.empty_cache()

    table = _table(results, list(dict.fromkeys(r["provider"] for r in results)))
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "triton": triton.__version__, "dtype": args.dtype,
                   "copy_tbps": copy_bw / 1e12, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table + "\n")
    _plot(results, copy_bw, os.path.join(args.out, "bandwidth.png"))
    return 0


def host_time(args):
    """Wall time of one call on small tensors (8 x 1024) with the GPU idle, over 1000 calls
    after 100, forward and forward + backward, pintail against torch eager (benchmarks/README.md)."""
    ops = _selected_ops(args, ",".join(DEFAULT_OPS))
    for name in ("linear_cross_entropy", "linear_log_probs", "linear_distillation_loss", "log_probs"):
        ops.pop(name, None)
    rows = []
    for name, op in ops.items():
        inputs, others = op.make(8, 1024, torch.bfloat16, "cuda")
        for direction in ("fwd", "fwd+bwd"):
            times = {}
            for provider, fn in (("pintail", op.pintail), ("eager", op.torch)):
                if direction == "fwd":
                    step = lambda fn=fn: fn(*inputs, *others)  # noqa: E731
                else:
                    leaves = [t.detach().requires_grad_() for t in inputs]
                    step = lambda fn=fn, leaves=leaves: torch.autograd.grad(  # noqa: E731
                        [o.float().sum() for o in _outputs(fn(*leaves, *others))], leaves)
                for _ in range(100):
                    step()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(1000):
                    step()
                times[provider] = (time.perf_counter() - start) / 1000 * 1e6
                torch.cuda.synchronize()
            rows.append((name, direction, times["pintail"], times["eager"]))
            print(f"{name} {direction}: pintail {times['pintail']:.1f} us, eager {times['eager']:.1f} us", flush=True)
    table = ["| op | direction | pintail us | eager us | ratio |", "|---|---|---|---|---|"]
    table += [f"| {n} | {d} | {p:.1f} | {e:.1f} | {p / e:.2f}x |" for n, d, p, e in rows]
    print("\n" + "\n".join(table))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_time.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    return 0


def _benchmark_heads(args):
    from . import bench_heads
    providers = args.providers.split(",") if args.providers != "pintail,eager,compile" else None
    results = bench_heads.run(providers=providers)
    table = bench_heads.table(results)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "heads.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "heads.md"), "w") as f:
        f.write(table + "\n")


def _benchmark_rl(args, op):
    from . import bench_rl
    providers = args.providers.split(",") if args.providers != "pintail,eager,compile" else None
    results = bench_rl.run(op, providers=providers)
    table = bench_rl.table(results)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{op}.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "results": results}, f, indent=1)
    with open(os.path.join(args.out, f"{op}.md"), "w") as f:
        f.write(table + "\n")


def _table(results, providers):
    """Markdown: per op, direction and N, each provider's fraction of copy bandwidth, and
    pintail's time and speed-up over the better of eager and compile."""
    by_key = {}
    for r in results:
        by_key.setdefault((r["op"], r["direction"], r["N"]), {})[r["provider"]] = r
    head = ["op", "dir", "N"] + [f"{p} (frac)" for p in providers]
    if "pintail" in providers:
        head += ["pintail ms", "pintail TB/s", "speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, d, N), row in by_key.items():
        cells = [op, d, str(N)] + [f"{row[p]['fraction_of_copy']:.2f}" if p in row else "-" for p in providers]
        if "pintail" in providers:
            others = [row[p]["ms"] for p in ("eager", "compile") if p in row]
            speedup = f"{min(others) / row['pintail']['ms']:.2f}x" if others else "-"
            cells += [f"{row['pintail']['ms']:.4f}", f"{row['pintail']['tbps']:.2f}", speedup]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(results, copy_bw, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'pintail[bench]')")
        return
    panels = sorted({(r["op"], r["direction"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (op, d) in zip(axes[0], panels):
        rows = [r for r in results if r["op"] == op and r["direction"] == d]
        for provider in dict.fromkeys(r["provider"] for r in rows):
            pts = sorted((r["N"], r["tbps"]) for r in rows if r["provider"] == provider)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=provider)
        ax.axhline(copy_bw / 1e12, color="gray", linestyle="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (row length)")
        ax.set_ylabel("TB/s")
        ax.set_title(f"{op} {d}")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ------------------------------------------------------------------------------- CPU


# relative error allowed, or twice torch's own error in the same dtype if that is larger
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _relative_error(a, b):
    """|a - b| / |b|, with |b| at least 1e-3 per element's root: a truth that cancels to about
    zero (an RMS norm's input gradient at N = 1) leaves rounding, not a relative error."""
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-3 * b.numel() ** 0.5)).item()


def check_kernels(args, device):
    """Every op's kernels, forward and backward, at small sizes: on a CPU in the Triton
    interpreter, on a GPU compiled."""
    import pintail.reference
    from ._core.launch import INTERPRET
    assert INTERPRET or device == "cuda", "on a CPU the check must run the kernels in the interpreter"

    def refuse(*a, **k):
        raise RuntimeError("the torch reference ran instead of a kernel")

    for name, value in vars(pintail.reference).items():  # a pass must come from a kernel
        if callable(value) and getattr(value, "__module__", None) == pintail.reference.__name__:
            setattr(pintail.reference, name, refuse)

    print("Checking every kernel against float64 torch " +
          ("on the GPU." if device == "cuda" else "in the Triton interpreter (no GPU)."), flush=True)
    torch.manual_seed(0)  # the same inputs every run: a bar relative to torch's own error moves with the draw
    rows, failures = [], 0
    for name, op in _selected_ops(args, "all").items():
        first, t_op = len(rows), time.time()
        for dtype in CHECK_TOLERANCE:
            for M, N in op.check_sizes or CHECK_SIZES:
                inputs, others = op.make(M, N, dtype, device)
                t0 = time.time()
                try:
                    def run(fn, cast):  # outputs and input gradients, inputs (and float others) cast first
                        xs = tuple(cast(t).detach().requires_grad_() for t in inputs)
                        rest = tuple(cast(t) if t.is_floating_point() else t for t in others)
                        ys = _outputs(fn(*xs, *rest))
                        return ys, torch.autograd.grad(ys, xs, [cast(g) for g in dys])
                    dys = [torch.randn_like(y) for y in _outputs(op.torch(*inputs, *others))]
                    ours = run(op.pintail, lambda t: t)
                    truth = run(op.torch, lambda t: t.double())
                    same = run(op.torch, lambda t: t)  # torch in the same dtype: the second bar
                    errs = [max(_relative_error(a, b) for a, b in zip(o, t)) for o, t in zip(ours, truth)]
                    bars = [max(CHECK_TOLERANCE[dtype], 2 * max(_relative_error(a, b) for a, b in zip(s_, t)))
                            for s_, t in zip(same, truth)]
                    ok = errs[0] <= bars[0] and errs[1] <= bars[1]
                    detail = f"{errs[0]:.1e} / {errs[1]:.1e} (bar {bars[0]:.0e} / {bars[1]:.0e})"
                except Exception as e:  # a crash is a failure to report, not to hide
                    ok, detail = False, f"{type(e).__name__}: {e}"
                failures += not ok
                rows.append((name, str(dtype).replace("torch.", ""), f"{M}x{N}",
                             "pass" if ok else "FAIL", detail, f"{time.time() - t0:.1f}s"))
        passed = sum(r[3] == "pass" for r in rows[first:])
        print(f"{name}: {passed} of {len(rows) - first} cases passed ({time.time() - t_op:.0f} s)", flush=True)
    print("\n| op | dtype | shape | result | rel. error fwd / bwd | time |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\n{len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


def main(argv=None):
    args = _parse(argv)
    if torch.cuda.is_available():
        if args.check:
            return check_kernels(args, "cuda")
        return host_time(args) if args.host_time else benchmark(args)
    if os.environ.get("TRITON_INTERPRET") != "1":
        # Kernels choose interpreter or compiler when defined: start again with it set.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "pintail.bench", *(argv or sys.argv[1:])])
    return check_kernels(args, "cpu")


if __name__ == "__main__":
    sys.exit(main())
