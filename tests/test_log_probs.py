"""pintail.log_probs and linear_log_probs against float64 torch: log-probabilities, entropy
and their gradients over an option grid, every dtype, 3-D and non-contiguous inputs, empty
batches, ignored rows, extreme logits; the workspace of the head; compile and opcheck; errors.
The kernels counted."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import pintail
from helpers import DTYPES, GemmFlops
from test_linear_cross_entropy import RecordAllocations

api = importlib.import_module("pintail.log_probs.api")
chunks = importlib.import_module("pintail._loss.chunks")
loss_plans = importlib.import_module("pintail._loss.plans")

OPTIONS = [dict(), dict(temperature=0.7), dict(softcap=5.0, return_entropy=True),
           dict(temperature=1.3, return_entropy=True), dict(temperature=0.8, softcap=3.0, return_entropy=True)]


def truth(logits, target, temperature=1.0, softcap=None, ignore_index=-100, return_entropy=False,
          dtype=torch.float64):
    """torch in `dtype` (float64: the truth): lp (and H) of each row, 0 on ignored rows."""
    z = logits.to(dtype)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    logp = torch.log_softmax(z / temperature, -1)
    kept = target != ignore_index
    lp = torch.where(kept, logp.gather(-1, torch.where(kept, target, 0).long()[..., None])[..., 0], 0.0)
    if not return_entropy:
        return lp
    H = -torch.where(logp > -float("inf"), logp.exp() * logp, 0.0).sum(-1)
    return lp, torch.where(kept, H, 0.0)


def tolerance(dtype, scale):
    return {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}[dtype] * scale


def check_against_truth(ours, want, sources, dtype, scale, torch32=None):
    """Values, and gradients of a random weighting of the outputs, within tolerance. `torch32`:
    torch's float32 composition on the same inputs (its outputs, then its sources in sources'
    order); where given, ours may err by up to twice what it errs, so that a bound holds on any
    CPU, whose float32 GEMMs and reductions round in their own order."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    want = want if isinstance(want, tuple) else (want,)
    composed = (torch32[0] if isinstance(torch32[0], tuple) else (torch32[0],)) if torch32 else (None,) * len(want)
    error = lambda value, truth: 2 * (value.double() - truth).abs().max().item() if value is not None else 0.0
    for o, w, c in zip(ours, want, composed):
        assert o.dtype == torch.promote_types(dtype, torch.float32) and o.shape == w.shape
        allowed = max(tolerance(dtype, scale), error(c, w))
        assert torch.allclose(o.double(), w, rtol=0, atol=allowed), ((o.double() - w).abs().max(), allowed)
    weights = [torch.randn_like(w) for w in want]
    weighted = lambda outputs, cast: sum((o * cast(g, o)).sum() for o, g in zip(outputs, weights))
    grads = torch.autograd.grad(weighted(ours, lambda g, o: g.to(o.dtype)), sources[0])
    expected = torch.autograd.grad(weighted(want, lambda g, o: g), sources[1])
    grads32 = torch.autograd.grad(weighted(composed, lambda g, o: g.to(o.dtype)), torch32[1]) if torch32 \
        else (None,) * len(expected)
    for g, e, c in zip(grads, expected, grads32):
        assert g.dtype == dtype and g.shape == e.shape
        allowed = max(tolerance(dtype, scale) * (e.abs().max().item() + 1e-3), error(c, e))
        assert torch.allclose(g.double(), e, rtol=0, atol=allowed), ((g.double() - e).abs().max(), allowed)


def targets(shape, V, device):
    t = torch.randint(0, V, shape, device=device)
    t.view(-1)[::3] = -100
    return t


# each option set at one shape: a row of one class, 3-D input, rows past the forward's block
SHAPED = list(zip([(7, 33), (2, 3, 1000), (4, 1), (3, 5000), (5, 257)], OPTIONS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, options", SHAPED, ids=lambda v: str(v))
def test_log_probs_matches_torch(dtype, shape, options, device):
    x = (torch.randn(shape, device=device) * 4).to(dtype).requires_grad_()
    t = targets(shape[:-1], shape[-1], device)
    x64 = x.detach().double().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    check_against_truth(pintail.log_probs(x, t, **options), truth(x64, t, **options), ((x,), (x64,)), dtype,
                        scale=1.0, torch32=(truth(x32, t, **options, dtype=torch.float32), (x32,)))


def test_log_probs_views_empty_and_extremes(device):
    """A non-contiguous slice of a wider tensor, a batch of no rows, and logits of 1e4 and -inf."""
    wide = torch.randn(6, 90, device=device) * 3
    x = wide[:, 5:80].requires_grad_()  # rows 90 apart
    t = targets((6,), 75, device)
    x64 = x.detach().double().requires_grad_()
    options = dict(temperature=0.9, return_entropy=True)
    check_against_truth(pintail.log_probs(x, t, **options), truth(x64, t, **options), ((x,), (x64,)),
                        torch.float32, scale=1.0)
    lp, H = pintail.log_probs(torch.zeros(0, 9, device=device, requires_grad=True),
                              torch.zeros(0, dtype=torch.long, device=device), return_entropy=True)
    assert lp.shape == H.shape == (0,)
    extreme = torch.tensor([[1e4, -1e4, 0.0, -float("inf")], [-float("inf"), 3.0, 3.0, -float("inf")]],
                           device=device, requires_grad=True)
    t = torch.tensor([0, 1], device=device)
    lp, H = pintail.log_probs(extreme, t, return_entropy=True)
    assert torch.allclose(lp, torch.tensor([0.0, -0.6931472], device=device), atol=1e-6)
    assert torch.allclose(H, torch.tensor([0.0, 0.6931472], device=device), atol=1e-6)
    (grad,) = torch.autograd.grad((lp + H).sum(), extreme)
    assert torch.isfinite(grad).all()


def test_log_probs_bad_target_gives_nan(device):
    x = torch.randn(3, 10, device=device, requires_grad=True)
    lp, H = pintail.log_probs(x, torch.tensor([1, 10, -100], device=device), return_entropy=True)
    assert torch.isnan(lp[1]) and torch.isnan(H[1]) and lp[2] == 0 and H[2] == 0 and torch.isfinite(lp[0])
    (grad,) = torch.autograd.grad(lp[0] + H[2], x)
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[0]).all() and (grad[2] == 0).all()


@pytest.mark.uses_reference
def test_float64(device):
    x = torch.randn(5, 40, dtype=torch.float64, device=device, requires_grad=True)
    t = targets((5,), 40, device)
    options = dict(temperature=0.8, softcap=4.0, return_entropy=True)
    lp, H = pintail.log_probs(x, t, **options)
    want = truth(x, t, **options)
    assert torch.allclose(lp, want[0], atol=1e-12) and torch.allclose(H, want[1], atol=1e-12)
    W = torch.randn(40, 12, dtype=torch.float64, device=device, requires_grad=True)
    h = torch.randn(5, 12, dtype=torch.float64, device=device, requires_grad=True)
    lp, H = pintail.linear_log_probs(h, W, t, **options)
    want = truth(h @ W.t(), t, **options)
    assert torch.allclose(lp, want[0], atol=1e-12) and torch.allclose(H, want[1], atol=1e-12)
    ours = torch.autograd.grad((lp + H).sum(), (h, W))
    expected = torch.autograd.grad((want[0] + want[1]).sum(), (h, W))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ours, expected))


# ----------------------------------------------------------------------- from a head


def head(M, K, V, dtype, device, bias=False):
    x = (torch.randn(M, K, device=device)).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5 * 2).to(dtype).requires_grad_()
    b = (torch.randn(V, device=device)).to(dtype).requires_grad_() if bias else None
    return x, W, b


@pytest.mark.parametrize("plan", ["chunks", "kept logits"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options, bias", list(zip(OPTIONS, [False, True, False, True, True])), ids=lambda v: str(v))
def test_linear_log_probs_matches_torch(dtype, options, bias, plan, device):
    """Token chunks of 16 rows over 37 (a ragged last one), or the whole logits kept from the
    forward to the backward; a 3-D input, V = 300 (no multiple of 64)."""
    M, K, V = 37, 24, 300
    x, W, b = head(M, K, V, dtype, device, bias)
    x3 = x.view(1, M, K)
    t = targets((1, M), V, device)
    budget = 16 * 320 * x.element_size() + (320 * K * 4 if dtype != torch.float32 else 0)
    if plan == "kept logits":
        budget = M * 320 * x.element_size()
    ours = pintail.linear_log_probs(x3, W, t, linear_bias=b, memory_budget=budget, **options)
    sources64 = [s.detach().double().requires_grad_() for s in (x, W, b) if s is not None]
    logits = F.linear(sources64[0], sources64[1], sources64[2] if bias else None).view(1, M, V)
    # 16-bit logits are rounded once (the GEMM's output) before the kernel reads them
    scale = 1.0 if dtype == torch.float32 else logits.abs().max().item() / 4
    sources = [s.detach().requires_grad_() for s in (x, W, b) if s is not None]  # torch's GEMM in the dtype
    composed = truth(F.linear(sources[0], sources[1], sources[2] if bias else None).view(1, M, V), t, **options,
                     dtype=torch.float32)
    check_against_truth(ours, truth(logits, t, **options), ([s for s in (x, W, b) if s is not None], sources64),
                        dtype, scale, torch32=(composed, sources))


@pytest.mark.kernels_only
def test_linear_log_probs_workspace_and_launches(device, monkeypatch):
    """No (tokens, vocabulary) tensor; the chunks' buffer within the budget; a forward and a
    backward kernel a chunk."""
    M, K, V = 40, 16, 256
    x, W, _ = head(M, K, V, torch.float32, device)
    t = targets((M,), V, device)
    launched = []
    real = api.launch
    monkeypatch.setattr(api, "launch", lambda kernel, grid, *a, **k: (launched.append(kernel.__name__),
                                                                      real(kernel, grid, *a, **k)))
    budget = 16 * V * 4
    with RecordAllocations(x, W, t) as record:
        lp, H = pintail.linear_log_probs(x, W, t, return_entropy=True, memory_budget=budget)
        grads = torch.autograd.grad((lp + H).sum(), (x, W))
    assert all(elements < M * V for _, elements, _ in record.workspace(lp, H, *grads))
    assert record.peak <= budget + 4 * (3 * M + 4 * M) + V * K * 4 + M * K * 4  # + rows' outputs, dW and dx
    assert launched == ["_forward_kernel"] * 3 + ["_backward_kernel"] * 3


@pytest.mark.kernels_only
def test_linear_log_probs_narrows_its_dW_sum_in_place(device, monkeypatch):
    """A bf16 head's gradient is rounded over the first half of its float32 sum's bytes (no
    second (V, K) tensor held beside the sum), to the same bits as a copy."""
    M, K, V = 40, 16, 256
    x, W, _ = head(M, K, V, torch.bfloat16, device)
    t = targets((M,), V, device)
    signs = torch.linspace(-1, 1, M, device=device)

    def gradient():
        return torch.autograd.grad((pintail.linear_log_probs(x, W, t) * signs).sum(), W)[0]

    dW = gradient()
    assert dW.dtype == torch.bfloat16 and dW.untyped_storage().nbytes() == loss_plans.buffer_columns(V) * K * 4
    monkeypatch.setattr(chunks, "narrowed", lambda total, dtype, scale=None: total.to(dtype))
    copied = gradient()
    assert copied.untyped_storage().nbytes() == V * K * 2 and torch.equal(dW, copied)


@pytest.mark.parametrize("entropy", [False, True])
def test_linear_log_probs_kept_logits_three_gemms(entropy, device):
    """A budget of the whole logits: one GEMM forward, two backward (dx, dW), where the token
    chunks make the logits again (four); the same values and gradients as the chunks; a
    second backward raises, naming the budget."""
    M, K, V = 40, 16, 256
    x, W, b = head(M, K, V, torch.float32, device, bias=True)
    t = targets((M,), V, device)
    with GemmFlops() as counter:
        lp, H = pintail.linear_log_probs(x, W, t, linear_bias=b, return_entropy=True, memory_budget=M * V * 4)
        out = lp + H if entropy else lp
        grads = torch.autograd.grad(out.sum(), (x, W, b), retain_graph=True)
    assert counter.flops == 3 * 2 * M * V * K
    with GemmFlops() as counter:  # the token chunks' op, whose GEMMs run inside it
        lp2, H2, stats = api._head_forward(x.detach(), W.detach(), b.detach(), t, -100, 1.0, 0.0, True, 16)
        ones = torch.ones(M, device=device)
        grads2 = api._head_backward(ones, ones if entropy else torch.zeros(M, device=device), x.detach(), W.detach(),
                                    b.detach(), t, stats, H2, -100, 1.0, 0.0, True, 16, True, True, True)
    assert counter.flops == 4 * 2 * M * V * K
    torch.testing.assert_close(lp, lp2)
    torch.testing.assert_close(H, H2)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="second backward through a call whose memory_budget kept the logits"):
        torch.autograd.grad(out.sum(), (x, W, b))


def test_linear_log_probs_autocast_float32_head(device):
    """Under autocast a float32 head gets a float32 gradient (its float32 sum), the rest bf16."""
    M, K, V = 20, 16, 128
    x, W, _ = head(M, K, V, torch.float32, device)
    t = targets((M,), V, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        lp = pintail.linear_log_probs(x, W, t)
    assert lp.dtype == torch.float32
    dx, dW = torch.autograd.grad(lp.sum(), (x, W))
    assert dx.dtype == torch.float32 and dW.dtype == torch.float32
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want = truth(F.linear(x, W).float(), t)
    expected = torch.autograd.grad(want.sum(), W)[0]
    assert torch.allclose(dW, expected.float(), atol=3e-2 * expected.abs().max().item())


def test_compile_fullgraph(device):
    M, K, V = 12, 16, 96
    x, W, _ = head(M, K, V, torch.float32, device)
    t = targets((M,), V, device)
    logits = torch.randn(M, V, device=device, requires_grad=True)

    def step(x, W, logits):
        lp, H = pintail.linear_log_probs(x, W, t, temperature=0.9, return_entropy=True)
        lp2 = pintail.log_probs(logits, t, softcap=3.0)
        return (lp * 2).sum() + H.sum() + lp2.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(x, W, logits)
    want = step(x, W, logits)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (x, W, logits)), torch.autograd.grad(want, (x, W, logits))):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_opcheck(device):
    x = torch.randn(6, 20, device=device, requires_grad=True)
    t = torch.tensor([1, -100, 3, 19, 0, 5], device=device)
    torch.library.opcheck(torch.ops.pintail.log_probs.default, (x, t, -100, 0.9, 3.0, True))
    h, W, b = head(6, 8, 20, torch.float32, device, bias=True)
    torch.library.opcheck(torch.ops.pintail.linear_log_probs.default, (h, W, b, t, -100, 1.0, 0.0, True, 4))
    lp, H, stats = api._head_forward(h.detach(), W.detach(), b.detach(), t, -100, 1.0, 0.0, True, 4)
    g = torch.randn(6, device=device)
    torch.library.opcheck(torch.ops.pintail.linear_log_probs_backward.default,
                          (g, g, h.detach(), W.detach(), b.detach(), t, stats, H, -100, 1.0, 0.0, True, 4, True, True,
                           True), test_utils=("test_schema", "test_faketensor"))


def test_bad_input(device):
    x = torch.randn(4, 10, device=device)
    t = torch.zeros(4, dtype=torch.long, device=device)
    W = torch.randn(10, 6, device=device)
    h = torch.randn(4, 6, device=device)
    cases = [
        (ValueError, r"temperature must be a number > 0, got 0", lambda: pintail.log_probs(x, t, temperature=0)),
        (ValueError, r"softcap must be None or a number > 0, got -1", lambda: pintail.log_probs(x, t, softcap=-1)),
        (TypeError, r"target must hold class indices .* got torch.float32", lambda: pintail.log_probs(x, t.float())),
        (ValueError, r"target must have shape \(4,\), got \(3,\)", lambda: pintail.log_probs(x, t[:3])),
        (ValueError, r"input must be floating point logits", lambda: pintail.log_probs(t, t)),
        (ValueError, r"input's hidden size 10 \(its last dim\) differs from linear_weight's 6",
         lambda: pintail.linear_log_probs(x, W, t)),
        (TypeError, r"linear_weight has dtype torch.float64, expected input's dtype torch.float32",
         lambda: pintail.linear_log_probs(h, W.double(), t)),
        (ValueError, r"memory_budget=10 bytes is below the least this call needs",
         lambda: pintail.linear_log_probs(h, W, t, memory_budget=10)),
        (ValueError, r"process_group needs torch.distributed initialised",
         lambda: pintail.linear_log_probs(h, W, t, process_group=object())),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_modules(device):
    """pintail.nn.LogProbs and LinearLogProbs give the functions' results; the head is an
    nn.Linear whose state dict loads from one."""
    logits = torch.randn(5, 30, device=device)
    t = targets((5,), 30, device)
    lp, H = pintail.nn.LogProbs(temperature=0.9, return_entropy=True)(logits, t)
    want = pintail.log_probs(logits, t, temperature=0.9, return_entropy=True)
    assert torch.equal(lp, want[0]) and torch.equal(H, want[1])
    module = pintail.nn.LinearLogProbs(8, 30, bias=True, device=device, softcap=4.0)
    linear = torch.nn.Linear(8, 30, bias=True, device=device)
    module.linear.load_state_dict(linear.state_dict())
    h = torch.randn(5, 8, device=device)
    assert torch.equal(module(h, t), pintail.linear_log_probs(h, linear.weight, t, linear_bias=linear.bias, softcap=4.0))
