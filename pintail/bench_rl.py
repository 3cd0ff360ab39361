"""The GPU benchmark of linear_log_probs and linear_distillation_loss at real heads: one step
(the loss and its backward to the student's x and W) timed beside the GEMMs it cannot avoid
(x W^T, G W, G^T x, and the teacher's x_t W_t^T for distillation), its extra peak memory
beyond inputs and gradients, and its error against a float32 composition."""

import torch
import torch.nn.functional as F

from .bench_heads import time_ms, time_step

KEEP_ALL = 2**40  # a memory_budget that holds every logit: the kept-logits plans
# (name, M tokens, K hidden, V vocabulary)
HEADS = [("Qwen2.5-7B", 8192, 3584, 152064), ("Llama-3.2-1B", 8192, 2048, 128256)]


def _log_probs_composition(x, W, t, entropy):
    logp = torch.log_softmax(F.linear(x, W).float(), -1)
    lp = logp.gather(-1, t[:, None])[:, 0]
    loss = -(lp * torch.linspace(-1, 1, len(t), device=t.device)).sum()
    return loss - (logp.exp() * logp).sum() * 0.01 if entropy else loss


def _distillation_composition(x, W, xt, Wt, beta):
    lp_s = torch.log_softmax(F.linear(x, W).float(), -1)
    lp_t = torch.log_softmax(F.linear(xt, Wt).float(), -1)
    if beta == 0:
        return F.kl_div(lp_s, lp_t, log_target=True, reduction="batchmean")
    m = (beta * lp_t.exp() + (1 - beta) * lp_s.exp()).log()
    return (beta * F.kl_div(m, lp_t, log_target=True, reduction="sum")
            + (1 - beta) * F.kl_div(m, lp_s, log_target=True, reduction="sum")) / len(x)


def _providers(op):
    import pintail
    advantages = {}

    def weights(t):
        if len(t) not in advantages:
            advantages[len(t)] = torch.linspace(-1, 1, len(t), device=t.device)
        return advantages[len(t)]

    if op == "linear_log_probs":
        def fused(x, W, t, entropy, memory_budget=None):
            out = pintail.linear_log_probs(x, W, t, return_entropy=entropy, memory_budget=memory_budget)
            lp, H = out if entropy else (out, None)
            loss = -(lp * weights(t)).sum()
            return loss - 0.01 * H.sum() if entropy else loss
        providers = {"pintail": lambda x, W, t: fused(x, W, t, False),
                     "pintail_kept": lambda x, W, t: fused(x, W, t, False, KEEP_ALL),
                     "pintail_entropy": lambda x, W, t: fused(x, W, t, True),
                     "eager": lambda x, W, t: _log_probs_composition(x, W, t, False),
                     "eager_entropy": lambda x, W, t: _log_probs_composition(x, W, t, True),
                     "compile": torch.compile(lambda x, W, t: _log_probs_composition(x, W, t, False), dynamic=False)}
        return providers, lambda x, W, t, *_: _log_probs_composition(x, W, t, False)
    providers = {f"pintail_beta{beta}": (lambda beta: lambda x, W, xt, Wt: pintail.linear_distillation_loss(
        x, W, xt, Wt, beta=beta))(beta) for beta in (0.0, 0.5)}
    providers["pintail_kept_beta0.5"] = lambda x, W, xt, Wt: pintail.linear_distillation_loss(
        x, W, xt, Wt, beta=0.5, memory_budget=KEEP_ALL)
    providers["eager_beta0.5"] = lambda x, W, xt, Wt: _distillation_composition(x, W, xt, Wt, 0.5)
    providers["compile_beta0.5"] = torch.compile(lambda x, W, xt, Wt: _distillation_composition(x, W, xt, Wt, 0.5),
                                                 dynamic=False)
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD
        jsd = LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0)
        providers["liger_jsd_beta0.5"] = lambda x, W, xt, Wt: jsd(x, W, xt, Wt)
    except ImportError:
        pass
    return providers, lambda x, W, xt, Wt: _distillation_composition(x, W, xt, Wt, 0.5)


def run(op, providers=None):
    """One row a head and provider of `op` ("linear_log_probs" or "linear_distillation_loss")."""
    results = []
    for name, M, K, V in HEADS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
        W = (torch.randn(V, K, device="cuda", generator=gen) / K**0.5).bfloat16()
        others = [torch.randint(0, V, (M,), device="cuda", generator=gen)]
        if op != "linear_log_probs":
            others = [torch.randn(M, K, device="cuda", generator=gen).bfloat16(),
                      (torch.randn(V, K, device="cuda", generator=gen) / K**0.5).bfloat16()]
        G = torch.randn(M, V, device="cuda", generator=gen).bfloat16() / M
        gemms = time_ms(lambda: x @ W.t()) + time_ms(lambda: G @ W) + time_ms(lambda: G.t() @ x)
        if op != "linear_log_probs":
            gemms += time_ms(lambda: others[0] @ others[1].t())
        del G
        fns, composition = _providers(op)
        xr, Wr = x.float().requires_grad_(), W.float().requires_grad_()
        reference = composition(xr, Wr, *[o.float() if o.is_floating_point() else o for o in others])
        ref_dx, ref_dW = torch.autograd.grad(reference, (xr, Wr))
        del xr, Wr
        torch.cuda.empty_cache()
        print(f"{op} {name} {M}x{K}x{V}: GEMM bound {gemms:.2f} ms", flush=True)
        for provider, fn in fns.items():
            if providers and provider not in providers:
                continue
            comparable = provider.endswith("beta0.5") or provider in ("pintail", "pintail_kept", "eager", "compile")
            row = time_step(provider, fn, x, W, others, (reference, ref_dx, ref_dW), gemms, comparable)
            if row is not None:
                results.append(dict(op=op, head=name, M=M, K=K, V=V, provider=provider, **row))
        del x, W, others, reference, ref_dx, ref_dW
        torch.cuda.empty_cache()
    return results


def table(results):
    lines = ["| op | head | provider | ms | / GEMMs | extra MiB | loss error | dx error | dW error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['op']} | {r['head']} {r['M']}x{r['K']}x{r['V']} | {r['provider']} | {r['ms']:.2f} | "
                     f"{r['ratio']:.2f}x | {r['extra_mib']:.0f} | {r['loss_error']:.1e} | {r['dx_error']:.2%} | "
                     f"{r['dW_error']:.2%} |")
    return "\n".join(lines)
