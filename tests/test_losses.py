"""pintail.losses (DPO, CPO, SimPO, ORPO, KTO, GRPO) against float64 compositions of the
papers' formulas on the whole logits: the loss and the gradients of the hidden states, the
head and its bias, ignored prompt and padding tokens, every dtype; bad arguments."""

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES

B, T, K, V = 4, 7, 16, 50  # two pairs of chosen / rejected completions


def inputs(dtype, device):
    x = torch.randn(B, T, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, device=device).to(dtype).requires_grad_()
    t = torch.randint(0, V, (B, T), device=device)
    t[:, :2] = -100  # the prompt
    t[1, -2:] = -100  # padding
    return x, W, b, t


def token_log_probs64(x, W, b, t, temperature=1.0):
    logp = torch.log_softmax((x.double() @ W.double().T + b.double()) / temperature, -1)
    kept = t != -100
    return torch.where(kept, logp.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0), kept


def sequences64(lp, kept, average=False):
    total = lp.sum(-1)
    return total / kept.sum(-1) if average else total


def nll64(lp, kept):
    return -lp[:B // 2].sum() / kept[:B // 2].sum()


def sigmoid_loss(z, e=0.0):
    return (-(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)).mean()


REF = torch.tensor([-21.0, -19.0])  # reference log-probs of the chosen and rejected halves' rows
DESIRABLE = torch.tensor([True, False, True, False])
ADVANTAGES = torch.tensor([0.5, -1.0, 1.5, 0.0])


def truths(name, x, W, b, t):
    """The float64 loss of each method, from the whole logits."""
    lp, kept = token_log_probs64(x, W, b, t)
    s, avg = sequences64(lp, kept), sequences64(lp, kept, average=True)
    c, r, ac, ar = s[:2], s[2:], avg[:2], avg[2:]
    ref = REF.double().to(x.device)
    if name == "dpo":
        return sigmoid_loss(0.2 * ((c - ref) - (r - (ref + 3.0))), 0.1)
    if name == "cpo":
        return sigmoid_loss(0.1 * (c - r)) + 0.5 * nll64(lp, kept)
    if name == "simpo":
        return sigmoid_loss(2.0 * (ac - ar) - 0.5)
    if name == "orpo":
        log_odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
        return nll64(lp, kept) - 0.1 * F.logsigmoid(log_odds).mean()
    if name == "kto":
        reward = s - torch.cat([ref, ref])
        z = 0.25
        desirable = DESIRABLE.to(x.device)
        return torch.where(desirable, 1.0 * (1 - torch.sigmoid(0.1 * (reward - z))),
                           1.5 * (1 - torch.sigmoid(0.1 * (z - reward)))).mean()
    lp, kept = token_log_probs64(x, W, b, t, temperature=0.8)
    old = (lp.detach() + 0.1 * torch.arange(T, device=x.device) / T).where(kept, 0.0)
    ref_lp = lp.detach() - 0.05
    ratio = torch.exp(lp - old)
    A = ADVANTAGES.double().to(x.device)[:, None]
    per_token = -torch.minimum(ratio * A, ratio.clamp(0.8, 1.28) * A)
    per_token = per_token + 0.04 * (torch.exp(ref_lp - lp) - (ref_lp - lp) - 1)
    per_token = torch.where(kept, per_token, 0.0)
    if name == "grpo":
        return (per_token.sum(-1) / kept.sum(-1)).mean()
    return per_token.sum() / kept.sum()


def ours(name, x, W, b, t):
    ref = REF.to(x.device)
    L = pintail.losses
    if name == "dpo":
        return L.dpo_loss(x, W, t, ref, ref + 3.0, beta=0.2, label_smoothing=0.1, linear_bias=b)
    if name == "cpo":
        return L.cpo_loss(x, W, t, beta=0.1, alpha=0.5, linear_bias=b)
    if name == "simpo":
        return L.simpo_loss(x, W, t, beta=2.0, gamma=0.5, linear_bias=b)
    if name == "orpo":
        return L.orpo_loss(x, W, t, beta=0.1, linear_bias=b)
    if name == "kto":
        return L.kto_loss(x, W, t, torch.cat([ref, ref]), DESIRABLE.to(x.device), beta=0.1, undesirable_weight=1.5,
                          kl=torch.tensor(0.25), linear_bias=b)
    with torch.no_grad():  # the sampler's and the reference's log-probs, as a trainer keeps them
        lp = pintail.linear_log_probs(x, W, t, linear_bias=b, temperature=0.8)
    kept = t != -100
    old = (lp + 0.1 * torch.arange(T, device=x.device) / T).where(kept, 0.0)
    return L.grpo_loss(x, W, t, ADVANTAGES.to(x.device), old_log_probs=old, ref_log_probs=lp - 0.05, beta=0.04,
                       epsilon=0.2, epsilon_high=0.28, temperature=0.8, loss_type="grpo" if name == "grpo" else "token",
                       linear_bias=b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["dpo", "cpo", "simpo", "orpo", "kto", "grpo", "grpo_token"])
def test_matches_float64_composition(name, dtype, device):
    x, W, b, t = inputs(dtype, device)
    loss = ours(name, x, W, b, t)
    sources64 = [s.detach().double().requires_grad_() for s in (x, W, b)]
    want = truths(name, *sources64, t)
    assert loss.dtype == torch.float32 and loss.shape == ()
    # 16-bit heads: the logits are rounded once to the dtype before the kernel reads them
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert abs(loss.item() - want.item()) <= rtol * (abs(want.item()) + 1), (loss.item(), want.item())
    grads = torch.autograd.grad(loss, (x, W, b))
    expected = torch.autograd.grad(want, sources64)
    for label, got, truth in zip("xWb", grads, expected):
        assert got.dtype == dtype
        scale = truth.abs().max().item() + 1e-6
        assert (got.double() - truth).abs().max().item() <= 4 * rtol * scale, label


def test_sequence_log_probs_and_averages(device):
    x, W, b, t = inputs(torch.float32, device)
    lp, kept = token_log_probs64(x, W, b, t)
    for average in (False, True):
        got = pintail.losses.sequence_log_probs(x, W, t, linear_bias=b, average=average)
        assert torch.allclose(got.double(), sequences64(lp, kept, average), rtol=1e-5, atol=1e-5)


def test_bad_arguments(device):
    x, W, b, t = inputs(torch.float32, device)
    L = pintail.losses
    with pytest.raises(ValueError, match="even number of rows"):
        L.simpo_loss(x[:3], W, t[:3])
    with pytest.raises(ValueError, match="ref_chosen_logps must be a tensor of one log-probability per pair"):
        L.dpo_loss(x, W, t, torch.zeros(3, device=device), torch.zeros(2, device=device))
    with pytest.raises(ValueError, match=r"input must be \(batch, seq, hidden\)"):
        L.orpo_loss(x[0], W, t[0])
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        L.cpo_loss(x, W, t, label_smoothing=0.5)
    with pytest.raises(ValueError, match="desirable must be a bool tensor"):
        L.kto_loss(x, W, t, torch.zeros(B, device=device), torch.ones(B, device=device))
    with pytest.raises(ValueError, match="pass ref_log_probs"):
        L.grpo_loss(x, W, t, torch.zeros(B, device=device))
    with pytest.raises(ValueError, match="advantages must be a tensor of one value a row"):
        L.grpo_loss(x, W, t, torch.zeros(B, T, device=device), beta=0.0)
    with pytest.raises(ValueError, match="loss_type must be"):
        L.grpo_loss(x, W, t, torch.zeros(B, device=device), beta=0.0, loss_type="seq")
