"""pintail.linear_distillation_loss against float64 torch: forward KL, reverse KL and the
mixture between them, every reduction, with and without targets, ragged token chunks, every
dtype; the teacher never gets a gradient; the workspace; compile and opcheck; errors."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES, GemmFlops
from test_linear_cross_entropy import RecordAllocations

api = importlib.import_module("pintail.distillation.api")


def truth(x, W, teacher_x, teacher_W, target=None, beta=0.0, temperature=1.0, ignore_index=-100, reduction="mean"):
    lp_s = torch.log_softmax(F.linear(x.double(), W.double()) / temperature, -1)
    lp_t = torch.log_softmax(F.linear(teacher_x.double(), teacher_W.double()) / temperature, -1)
    p_s, p_t = lp_s.exp(), lp_t.exp()
    if beta == 0:
        rows = (p_t * (lp_t - lp_s)).sum(-1)
    elif beta == 1:
        rows = (p_s * (lp_s - lp_t)).sum(-1)
    else:
        lm = (beta * p_t + (1 - beta) * p_s).log()
        rows = beta * (p_t * (lp_t - lm)).sum(-1) + (1 - beta) * (p_s * (lp_s - lm)).sum(-1)
    kept = target != ignore_index if target is not None else torch.ones_like(rows, dtype=torch.bool)
    rows = torch.where(kept, rows, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / kept.sum()


def models(shape, K, K_t, V, dtype, device):
    x = torch.randn(*shape, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5 * 2).to(dtype).requires_grad_()
    teacher_x = torch.randn(*shape, K_t, device=device).to(dtype).requires_grad_()
    teacher_W = (torch.randn(V, K_t, device=device) / K_t**0.5 * 2).to(dtype).requires_grad_()
    return x, W, teacher_x, teacher_W


# each beta (0, 1, and mixtures) with each reduction and with and without targets, not every product
CASES = [(0.0, "mean", True), (0.0, "none", False), (1.0, "sum", True), (1.0, "mean", False), (0.5, "none", True),
         (0.2, "mean", True)]


@pytest.mark.parametrize("plan", ["chunks", "kept logits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta, reduction, with_target", CASES, ids=lambda v: str(v))
def test_matches_torch(dtype, beta, reduction, with_target, plan, device):
    """37 rows of a (1, 37) batch in token chunks of 16 (a ragged last one), or both whole
    logits kept from the forward to the backward; V = 300."""
    K, K_t, V = 16, 24, 300
    x, W, teacher_x, teacher_W = models((1, 37), K, K_t, V, dtype, device)
    target = torch.randint(0, V, (1, 37), device=device) if with_target else None
    if with_target:
        target[0, ::4] = -100
    element = x.element_size()
    budget = 32 * 320 * element + (320 * K * 4 if element < 4 else 0)
    if plan == "kept logits":
        budget = 37 * 320 * 2 * element
    options = dict(target=target, beta=beta, temperature=0.8, reduction=reduction)
    loss = pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, memory_budget=budget, **options)
    x64, W64 = x.detach().double().requires_grad_(), W.detach().double().requires_grad_()
    want = truth(x64, W64, teacher_x.detach(), teacher_W.detach(), **options)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    tol = {torch.float32: 2e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    assert torch.allclose(loss.double(), want, rtol=tol, atol=tol * 0.1), (loss.double() - want).abs().max()
    weights = torch.rand_like(want) + 0.5
    dx, dW = torch.autograd.grad((loss * weights.float()).sum(), (x, W))
    want_dx, want_dW = torch.autograd.grad((want * weights).sum(), (x64, W64))
    grad_tol = max(tol, 2e-5)  # p_s (a - sum p_s a): a float32 difference of terms near 1
    for ours, expected in ((dx, want_dx), (dW, want_dW)):
        assert ours.dtype == dtype
        assert torch.allclose(ours.double(), expected, rtol=0, atol=grad_tol * expected.abs().max().item())


def test_kept_logits_four_gemms(device):
    """A budget of both whole logits: two GEMMs forward (the teacher's logits made once), two
    backward, where the token chunks make both again (six); the same loss and gradients as the
    chunks; a second backward raises."""
    M, K, K_t, V = 40, 16, 24, 256
    x, W, teacher_x, teacher_W = models((M,), K, K_t, V, torch.float32, device)
    once = 2 * M * V * (K + K_t)  # both heads' logits once
    backward = 2 * 2 * M * V * K  # dx and dW
    with GemmFlops() as counter:
        loss = pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=0.5, memory_budget=M * V * 8)
        grads = torch.autograd.grad(loss, (x, W), retain_graph=True)
    assert counter.flops == once + backward
    with GemmFlops() as counter:  # the token chunks' ops, whose GEMMs run inside them
        rows = api._forward(x.detach(), W.detach(), teacher_x.detach(), teacher_W.detach(), None, -100, 0.5, 1.0, 16)
        grads2 = api._backward(torch.full((M,), 1.0 / M, device=device), x.detach(), W.detach(), teacher_x.detach(),
                               teacher_W.detach(), None, -100, 0.5, 1.0, 16, True, True)
    assert counter.flops == 2 * once + backward
    torch.testing.assert_close(loss, rows.mean())
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="second backward through a call whose memory_budget kept the logits"):
        torch.autograd.grad(loss, (x, W))


def test_teacher_gets_no_gradient(device):
    x, W, teacher_x, teacher_W = models((8,), 8, 8, 64, torch.float32, device)
    loss = pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=0.5)
    loss.backward()
    assert x.grad is not None and W.grad is not None
    assert teacher_x.grad is None and teacher_W.grad is None


def test_every_row_ignored_and_no_rows(device):
    x, W, teacher_x, teacher_W = models((5,), 8, 8, 64, torch.float32, device)
    ignored = torch.full((5,), -100, device=device)
    assert torch.isnan(pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, target=ignored))
    assert pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, target=ignored, reduction="sum") == 0
    empty = pintail.linear_distillation_loss(x[:0], W, teacher_x[:0], teacher_W, reduction="none")
    assert empty.shape == (0,)


@pytest.mark.uses_reference
def test_float64(device):
    x, W, teacher_x, teacher_W = models((6,), 8, 12, 40, torch.float64, device)
    for beta in (0.0, 0.5, 1.0):
        loss = pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=beta, temperature=1.5)
        want = truth(x, W, teacher_x, teacher_W, beta=beta, temperature=1.5)
        assert torch.allclose(loss, want, atol=1e-12)
        ours = torch.autograd.grad(loss, (x, W))
        expected = torch.autograd.grad(want, (x, W))
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ours, expected))


@pytest.mark.kernels_only
def test_workspace_and_launches(device, monkeypatch):
    """No (tokens, vocabulary) tensor and the buffers within the budget; a kernel a chunk each way."""
    M, K, V = 40, 16, 256
    x, W, teacher_x, teacher_W = models((M,), K, K, V, torch.float32, device)
    launched = []
    real = api.launch
    monkeypatch.setattr(api, "launch", lambda kernel, grid, *a, **k: (launched.append(kernel.__name__),
                                                                      real(kernel, grid, *a, **k)))
    budget = 2 * 16 * V * 4
    with RecordAllocations(x, W, teacher_x, teacher_W) as record:
        loss = pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=0.5, memory_budget=budget)
        grads = torch.autograd.grad(loss, (x, W))
    assert all(elements < M * V for _, elements, _ in record.workspace(loss, *grads))
    assert record.peak <= budget + 4 * 3 * M + V * K * 4 + M * K * 4  # + rows' losses, dW and dx
    assert launched == ["_distillation_kernel"] * 6


def test_compile_fullgraph_and_opcheck(device):
    x, W, teacher_x, teacher_W = models((12,), 8, 8, 96, torch.float32, device)
    target = torch.randint(0, 96, (12,), device=device)

    def step(x, W):
        return pintail.linear_distillation_loss(x * 2, W, teacher_x, teacher_W, target=target, beta=0.5)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(x, W), step(x, W)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(torch.autograd.grad(got, (x, W)), torch.autograd.grad(want, (x, W))):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    args = (x, W, teacher_x.detach(), teacher_W.detach(), target, -100, 0.5, 1.0, 5)
    torch.library.opcheck(torch.ops.pintail.linear_distillation.default, args)


def test_bad_input(device):
    x, W, teacher_x, teacher_W = models((4,), 8, 6, 32, torch.float32, device)
    cases = [
        (ValueError, r"beta must be a number in \[0, 1\], got 1.5",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=1.5)),
        (ValueError, r"teacher_weight has 31 classes, linear_weight 32",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x, teacher_W[:31])),
        (ValueError, r"teacher_input's leading shape \(3,\) differs from input's \(4,\)",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x[:3], teacher_W)),
        (ValueError, r"teacher_input's hidden size 6 \(its last dim\) differs from teacher_weight's 5",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x, teacher_W[:, :5])),
        (ValueError, r"'avg' is not a valid value for reduction",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, reduction="avg")),
        (ValueError, r"temperature must be a number > 0",
         lambda: pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, temperature=-1.0)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_module(device):
    x, W, teacher_x, teacher_W = models((6,), 8, 8, 40, torch.float32, device)
    module = pintail.nn.LinearDistillationLoss(beta=0.5, temperature=2.0, reduction="sum")
    assert torch.equal(module(x, W, teacher_x, teacher_W),
                       pintail.linear_distillation_loss(x, W, teacher_x, teacher_W, beta=0.5, temperature=2.0,
                                                        reduction="sum"))
