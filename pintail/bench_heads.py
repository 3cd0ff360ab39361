"""The GPU benchmark of linear_cross_entropy at real language-model heads (benchmarks/README.md's
protocol for linear + CE): one step, loss = f(x, W, t) and its backward (dx, dW), timed
beside the three cuBLAS GEMMs of the head alone; the step's extra peak memory beyond its
inputs and gradients; the loss's and dW's error against a float32 composition."""

import gc

import torch
import torch.nn.functional as F

# (name, M tokens, K hidden, V vocabulary, final-logit softcap)
HEADS = [("Llama-3-8B", 8192, 4096, 128256, None), ("Llama-3.2-1B", 16384, 2048, 128256, None),
         ("Qwen2.5-7B", 8192, 3584, 152064, None), ("Gemma-2-2B", 8192, 2304, 256000, 30.0),
         ("GPT-2", 16384, 768, 50257, None)]


def _composition(x, W, t, softcap=None):
    logits = F.linear(x, W)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.float(), t)


def _providers(M, V, softcap):
    import pintail
    logits_bytes = M * V * 2
    providers = {
        "pintail": lambda x, W, t: pintail.linear_cross_entropy(x, W, t, softcap=softcap, out_dtype=torch.float32),
        "pintail_quarter_budget": lambda x, W, t: pintail.linear_cross_entropy(
            x, W, t, softcap=softcap, out_dtype=torch.float32, memory_budget=logits_bytes // 4),
        "pintail_logits_budget": lambda x, W, t: pintail.linear_cross_entropy(
            x, W, t, softcap=softcap, out_dtype=torch.float32, memory_budget=logits_bytes + M * 4096 * 4),
        "eager": lambda x, W, t: _composition(x, W, t, softcap),
        "compile": torch.compile(lambda x, W, t: _composition(x, W, t, softcap), dynamic=False),
    }
    if softcap is None and hasattr(F, "linear_cross_entropy"):  # torch 2.13 on
        options = torch.nn.LinearCrossEntropyOptions()
        providers["torch_chunked"] = lambda x, W, t: F.linear_cross_entropy(x, W, t, options=options)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        providers["liger"] = lambda x, W, t: liger_fused_linear_cross_entropy(x, W, t, softcap=softcap)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        providers["cce"] = lambda x, W, t: cce(x, W, t, softcap=softcap)
        providers["cce_exact"] = lambda x, W, t: cce(x, W, t, softcap=softcap, filter_eps=None)
    except ImportError:
        pass
    return providers


def time_ms(fn):
    from triton.testing import do_bench
    gc.collect()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=200, rep=300, return_mode="median")


def measure(step, input_bytes):
    """(median ms, extra bytes) of a step: its peak memory beyond what was allocated before it
    and beyond its inputs' bytes (their gradients)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return time_ms(step), torch.cuda.max_memory_allocated() - before - input_bytes


def time_step(provider, fn, x, W, others, truth, gemms_ms, compare=True):
    """One step loss = fn(x, W, *others) and its gradients to x and W: the time, the extra
    memory and (compare) the errors against truth = (loss, dx, dW), as a row printed as it
    comes; None (and the error printed) where the provider fails."""
    torch._dynamo.reset()
    leaves = [x.detach().requires_grad_(), W.detach().requires_grad_()]

    def step():
        loss = fn(*leaves, *others)
        return loss, torch.autograd.grad(loss, leaves)
    try:
        loss, (dx, dW) = step()
        errors = [relative_error(a, b) if compare else float("nan") for a, b in zip((loss, dx, dW), truth)]
        del loss, dx, dW
        ms, extra = measure(step, (x.numel() + W.numel()) * 2)
    except Exception as e:  # a provider that fails is reported, not hidden
        print(f"  {provider}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    print(f"  {provider}: {ms:.2f} ms = {ms / gemms_ms:.2f}x the GEMMs, extra {extra / 2**20:.0f} MiB, error "
          f"loss {errors[0]:.1e} dx {errors[1]:.2%} dW {errors[2]:.2%}", flush=True)
    return dict(ms=ms, gemms_ms=gemms_ms, ratio=ms / gemms_ms, extra_mib=extra / 2**20, loss_error=errors[0],
                dx_error=errors[1], dW_error=errors[2])


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(heads=None, providers=None):
    """Print and return one row a head and provider."""
    results = []
    for name, M, K, V, softcap in HEADS:
        if heads and name not in heads:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
        W = (torch.randn(V, K, device="cuda", generator=gen) / K**0.5).bfloat16()
        t = torch.randint(0, V, (M,), device="cuda", generator=gen)
        G = torch.randn(M, V, device="cuda", generator=gen).bfloat16() / M
        gemms = (time_ms(lambda: x @ W.t()) + time_ms(lambda: G @ W) + time_ms(lambda: G.t() @ x))
        del G
        xr, Wr = x.float().requires_grad_(), W.float().requires_grad_()
        reference = _composition(xr, Wr, t, softcap)
        ref_dx, ref_dW = torch.autograd.grad(reference, (xr, Wr))
        del xr, Wr
        torch.cuda.empty_cache()
        print(f"{name} {M}x{K}x{V}: 3 GEMMs {gemms:.2f} ms", flush=True)
        for provider, fn in _providers(M, V, softcap).items():
            if providers and provider not in providers:
                continue
            row = time_step(provider, fn, x, W, [t], (reference, ref_dx, ref_dW), gemms)
            if row is not None:
                results.append(dict(head=name, M=M, K=K, V=V, provider=provider, **row))
        del x, W, t, reference, ref_dx, ref_dW
        torch.cuda.empty_cache()
    return results


def table(results):
    lines = ["| head | provider | ms | / 3 GEMMs | extra MiB | dx error | dW error |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['head']} {r['M']}x{r['K']}x{r['V']} | {r['provider']} | {r['ms']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['extra_mib']:.0f} | {r['dx_error']:.2%} | {r['dW_error']:.2%} |")
    return "\n".join(lines)
