"""pintail.linear_cross_entropy against F.cross_entropy(F.linear(...)) in float64: values and
the gradients of input, head and bias, over the option grid, at chunk widths that split
the vocabulary into several chunks with a ragged last one; its workspace, recorded
allocation by allocation; bad input."""

import importlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pintail
from helpers import DTYPES, RTOL, GemmFlops, assert_matches

api = importlib.import_module("pintail.linear_cross_entropy.api")
chunks = importlib.import_module("pintail._loss.chunks")
loss_plans = importlib.import_module("pintail._loss.plans")
tokens = importlib.import_module("pintail.linear_cross_entropy.tokens")
plans = importlib.import_module("pintail.linear_cross_entropy.plans")


@pytest.fixture(autouse=True)
def narrow_chunks(monkeypatch):
    """Chunks of 64 classes (whole multiples of 64) and of 8 rows, so that the small
    vocabularies and batches of these tests take several chunks by default."""
    monkeypatch.setattr(plans, "CHUNK_MULTIPLE", 64)
    monkeypatch.setattr(plans, "MIN_CHUNK_COLUMNS", 64)
    monkeypatch.setattr(plans, "TOKEN_ROWS", 8)
    monkeypatch.setattr(plans, "MIN_TOKEN_ROWS", 4)


def force_plan(monkeypatch, kind):
    """Every call takes `kind` ("vocabulary" or "tokens") at its default width."""
    real = plans.choose

    def forced(M, V, K, element_size, budget, **flags):
        if kind == "tokens":
            return plans.Plan("tokens", min(M, plans.TOKEN_ROWS))
        return plans.Plan("vocabulary", plans.chunk_columns(M, V, K, element_size, budget, flags["sums_dx"]))
    monkeypatch.setattr(plans, "choose", forced)
    return real


def loss_of_logits(logits, t, weight=None, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                   softcap=None):
    """pintail's loss of (M, V) logits as torch ops (softcap first, z-loss a mean over kept rows)."""
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, t, weight, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        kept = (t != ignore_index).to(logits.dtype)
        z_rows = z_loss * torch.logsumexp(logits, 1) ** 2 * kept
        loss = loss + {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / kept.sum()}[reduction]
    return loss


def composition(x, W, t, b=None, **options):
    """What linear_cross_entropy computes, as torch ops on the logits (in x's dtype)."""
    V = W.shape[0]
    loss = loss_of_logits(F.linear(x, W, b).reshape(-1, V), t.reshape(-1), **options)
    return loss.reshape(x.shape[:-1]) if options.get("reduction") == "none" else loss


def relative_errors(got, want):
    """(norm-wise relative error, largest entry error over the truth's rms) of got against want."""
    got, want = got.double(), want.double()
    scale = want.norm().item() or 1.0
    rms = scale / want.numel() ** 0.5
    return (got - want).norm().item() / scale, (got - want).abs().max().item() / rms


def run(fn, leaves, upstream):
    loss = fn(*leaves)
    grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad], upstream)
    return (loss, *grads)


def assert_as_accurate_as_eager(ours, x, W, t, b, options, upstream_seed=0):
    """ours(x, W, b) and its gradients err against float64 torch by at most twice what
    eager torch's composition in the same dtype errs, plus one unit in the dtype's last
    place norm-wise and four in the largest entry (over the truth's rms)."""
    def leaves(dtype):
        return [v.detach().to(dtype).requires_grad_(v.requires_grad) for v in (x, W) + ((b,) if b is not None else ())]

    def theirs(x, W, b=None):
        return composition(x, W, t, b, **{k: (v.to(x.dtype) if isinstance(v, torch.Tensor) else v)
                                          for k, v in options.items()})

    dtype = x.dtype
    upstream = None
    if options.get("reduction") == "none":
        upstream = torch.randn(t.shape, generator=torch.Generator().manual_seed(upstream_seed),
                               dtype=torch.float64).to(x.device)
    truth = run(theirs, leaves(torch.float64), upstream)
    eager = run(theirs, leaves(dtype), upstream.to(dtype) if upstream is not None else None)
    got = run(ours, leaves(dtype), upstream.to(dtype) if upstream is not None else None)
    assert got[0].dtype == eager[0].dtype and got[0].shape == eager[0].shape
    for name, g, e, w in zip(["loss", "dx", "dW", "db"], got, eager, truth):
        assert g.shape == w.shape and g.dtype == e.dtype, (name, g.shape, w.shape, g.dtype, e.dtype)
        assert torch.equal(torch.isnan(g), torch.isnan(w)), name
        finite = ~torch.isnan(w)
        ours_err, eager_err = relative_errors(g[finite], w[finite]), relative_errors(e[finite], w[finite])
        for o, ea, ulps in zip(ours_err, eager_err, (1, 4)):
            assert o <= 2 * ea + ulps * RTOL[dtype], (name, ours_err, eager_err)


OPTIONS = [
    {},
    {"weight": "w", "label_smoothing": 0.1},
    {"reduction": "none", "z_loss": 1e-3, "softcap": 5.0},
    {"reduction": "sum", "label_smoothing": 0.2, "ignore_index": 5},
    {"weight": "w", "z_loss": 1e-2},
    {"reduction": "none", "weight": "w", "label_smoothing": 0.3, "softcap": 3.0},
]


def with_weight(options, V, device):
    return {k: (torch.rand(V, device=device) + 0.1 if v == "w" else v) for k, v in options.items()}


# the default plan for every option set (at these sizes the kept logits for "mean" and "sum",
# vocabulary chunks for "none"), the token chunks for each of "mean" and "sum", and the
# vocabulary chunks for two of them
UNIFORM = [o for o in OPTIONS if o.get("reduction") != "none"]
PLAN_CASES = ([(o, "default") for o in OPTIONS] + [(o, "tokens") for o in UNIFORM]
              + [(o, "vocabulary") for o in UNIFORM[::3]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("options, plan", PLAN_CASES,
                         ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "plain")
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_matches_composition(dtype, options, bias, plan, device, monkeypatch):
    """Each plan against the composition: the default (the kept logits here for "mean" and
    "sum", vocabulary chunks for "none"), the token chunks and the vocabulary chunks forced."""
    if plan != "default":
        force_plan(monkeypatch, plan)
    M, K, V = 23, 40, 300  # chunks of 64: four whole, one of 44; of 8 rows: two whole, one of 7
    options = with_weight(options, V, device)
    x = torch.randn(M, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) * 2 / K**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, device=device).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (M,), device=device)
    t[[2, 7]] = options.get("ignore_index", -100)
    t[0], t[1] = V - 1, 63  # the last class, the last of the first chunk

    def ours(x, W, b=None):
        return pintail.linear_cross_entropy(x, W, t, linear_bias=b, **options)

    assert_as_accurate_as_eager(ours, x, W, t, b, options)


@pytest.mark.uses_reference
def test_float64(device):
    """float64 runs torch on the chunks (the kernels take 16- and 32-bit): exact to 1e-12."""
    M, K, V = 11, 16, 200
    x = torch.randn(2, M, K, dtype=torch.float64, device=device, requires_grad=True)
    W = torch.randn(V, K, dtype=torch.float64, device=device, requires_grad=True)
    t = torch.randint(0, V, (2, M), device=device)
    options = dict(weight=torch.rand(V, dtype=torch.float64, device=device), label_smoothing=0.1, z_loss=1e-3,
                   softcap=4.0)
    ours = pintail.linear_cross_entropy(x, W, t, **options)
    theirs = composition(x, W, t, **options)
    grads = torch.autograd.grad(ours, [x, W])
    expected = torch.autograd.grad(theirs, [x, W])
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, expected):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.kernels_only
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_kernels_run_once_a_chunk(reduction, device, monkeypatch):
    """Vocabulary chunks ("none"): the forward launches the fold kernel once a chunk, the
    backward the gradient kernel once a chunk. Token chunks ("mean"): the forward launches
    both once a chunk, the backward none. Nothing else pintail's."""
    launched = []
    real_launch = chunks.launch
    monkeypatch.setattr(chunks, "launch", lambda kernel, grid, *a, **k: (launched.append(kernel.__name__),
                                                                         real_launch(kernel, grid, *a, **k)))
    M, K, V = 9, 32, 300
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = torch.randn(V, K, device=device, requires_grad=True)
    t = torch.randint(0, V, (M,), device=device)
    loss = pintail.linear_cross_entropy(x, W, t, reduction=reduction, check_target=False)
    forward = ["fold_kernel"] * 5 if reduction == "none" else ["fold_kernel", "gradient_kernel"] * 2
    assert launched == forward
    loss.sum().backward()
    assert launched == forward + (["gradient_kernel"] * 5 if reduction == "none" else [])


def test_model_shapes_and_lse(device):
    """(batch, seq, hidden) input with (batch, seq) targets; reduction none keeps (batch,
    seq); return_lse gives each row's log-sum-exp in float32; ignore_index None is -100."""
    B, S, K, V = 2, 7, 24, 150
    x = torch.randn(B, S, K, device=device)
    W = torch.randn(V, K, device=device) / K**0.5
    t = torch.randint(0, V, (B, S), device=device)
    t[0, 3] = -100
    loss, lse = pintail.linear_cross_entropy(x, W, t, reduction="none", return_lse=True, ignore_index=None)
    logits = F.linear(x.double(), W.double())
    assert loss.shape == (B, S) and lse.shape == (B, S) and lse.dtype == torch.float32
    expected = F.cross_entropy(logits.reshape(-1, V), t.reshape(-1), reduction="none").reshape(B, S)
    assert torch.allclose(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert loss[0, 3] == 0
    assert torch.allclose(lse.double(), torch.logsumexp(logits, -1), rtol=1e-6)


def test_empty_batch_and_all_ignored(device):
    """No rows: mean NaN, sum 0, gradients zero, as torch; every row ignored: mean NaN."""
    K, V = 16, 100
    W = torch.randn(V, K, device=device, requires_grad=True)
    x = torch.randn(0, K, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    for reduction in ("mean", "sum", "none"):
        ours = pintail.linear_cross_entropy(x, W, t, reduction=reduction)
        theirs = F.cross_entropy(F.linear(x, W), t, reduction=reduction)
        assert ours.shape == theirs.shape and torch.equal(ours.isnan(), theirs.isnan())
    pintail.linear_cross_entropy(x, W, t, reduction="sum").backward()
    assert torch.equal(W.grad, torch.zeros_like(W)) and x.grad.shape == x.shape
    x = torch.randn(4, K, device=device)
    t = torch.full((4,), -100, device=device)
    assert pintail.linear_cross_entropy(x, W, t).isnan()


def test_out_dtype_and_probability_targets(device):
    """out_dtype=float32 gives a float32 loss from bf16 inputs; probability targets give torch's result."""
    M, K, V = 6, 16, 90
    x = torch.randn(M, K, device=device).bfloat16()
    W = (torch.randn(V, K, device=device) / 4).bfloat16()
    t = torch.randint(0, V, (M,), device=device)
    loss = pintail.linear_cross_entropy(x, W, t, out_dtype=torch.float32)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss.double(), F.cross_entropy(F.linear(x, W).double(), t), rtol=1e-5)
    probs = torch.softmax(torch.randn(M, V, device=device), -1)
    x32, W32 = x.float(), W.float()
    ours = pintail.linear_cross_entropy(x32, W32, probs, label_smoothing=0.1, reduction="none")
    theirs = F.cross_entropy(F.linear(x32, W32).double(), probs.double(), label_smoothing=0.1, reduction="none")
    assert ours.shape == (M,) and torch.allclose(ours.double(), theirs, rtol=1e-5)


def test_only_required_gradients(device):
    """A frozen head gets no gradient and costs no dW GEMM; a frozen input no dx GEMM."""
    M, K, V = 8, 16, 200
    x = torch.randn(M, K, device=device)
    W = torch.randn(V, K, device=device)
    t = torch.randint(0, V, (M,), device=device)
    _, stats = api._forward(x, W, None, t, None, -100, 0.0, 0.0, 0.0, None, None)
    grad = torch.ones(M, device=device)
    for need in [(True, False, False), (False, True, False), (True, True, False)]:
        with RecordAllocations() as record:
            dx, dW, db = api._backward(grad, x, W, None, t, None, stats, -100, 0.0, 0.0, 0.0, None, None, *need)
        gemms = sum(name in ("aten.mm.out", "aten.mm.default", "aten.addmm.out", "aten.addmm_.default")
                    for name in record.ops)
        assert gemms == 4 * (1 + sum(need)), (need, record.ops)  # 4 chunks: the logits, then each gradient
        assert (dx.numel() > 0, dW.numel() > 0) == need[:2]
    W.requires_grad_()
    x.requires_grad_(False)
    pintail.linear_cross_entropy(x, W, t).backward()
    assert W.grad is not None


class RecordAllocations(TorchDispatchMode):
    """Every tensor an op returns while active (its storage's bytes), the ops' names, and
    the peak of the bytes alive at once of the storages recorded, other than `given`'s."""

    def __init__(self, *given):
        super().__init__()
        self.storages, self.ops, self.alive, self.peak, self.paused = {}, [], {}, 0, False
        self.generation = {}
        self.given = {g.untyped_storage().data_ptr() for g in given if g is not None and g.numel()}

    def __enter__(self):
        # The interpreter copies a kernel's arguments (a GPU launch does not): not recorded.
        self.real_launch = chunks.launch

        def launch(*args, **kwargs):
            self.paused = True
            try:
                self.real_launch(*args, **kwargs)
            finally:
                self.paused = False

        chunks.launch = launch
        return super().__enter__()

    def __exit__(self, *exc):
        chunks.launch = self.real_launch
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        self.ops.append(str(func))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.alive and ptr not in self.given:  # a new storage, perhaps at a freed one's address
                    self.generation[ptr] = self.generation.get(ptr, -1) + 1
                self.storages[ptr, self.generation.get(ptr, 0)] = (storage.nbytes(), t.numel(), tuple(t.shape))
                if ptr not in self.given:
                    self.alive.setdefault(ptr, (storage.nbytes(), []))[1].append(weakref.ref(t))
        self.alive = {p: (n, refs) for p, (n, refs) in self.alive.items() if any(r() is not None for r in refs)}
        self.peak = max(self.peak, sum(n for n, _ in self.alive.values()))
        return out

    def workspace(self, *given):
        """(bytes, elements, shape) of each storage recorded that is not one of the `given`
        tensors' (the call's inputs and what it returns)."""
        returned = {o.untyped_storage().data_ptr() for o in given if o is not None and o.numel()}
        return [v for (ptr, _), v in self.storages.items() if ptr not in returned]


@pytest.mark.kernels_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("budget", ["default", "larger", "whole"])
def test_workspace_within_budget(dtype, budget, device):
    """Every tensor made during the forward and the backward, other than their inputs and
    what they return, holds fewer than M x V elements, and those alive at once fit the
    budget: the default one, a larger one (which takes wider chunks), and one that holds the
    whole logits (one chunk, no accumulator). (The torch reference of the kernels, on the
    reference path, makes temporaries of a chunk's size.)"""
    M, K, V = 32, 48, 1000
    x = torch.randn(M, K, device=device).to(dtype)
    W = (torch.randn(V, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(V, device=device).to(dtype)
    t = torch.randint(0, V, (M,), device=device)
    accumulates = dtype != torch.float32
    limit = {"default": plans.default_budget(M, V, K, x.element_size(), accumulates),
             "larger": plans.default_budget(M, V, K, x.element_size(), accumulates) + M * 256 * x.element_size(),
             "whole": M * plans.buffer_columns(V) * x.element_size()}[budget]
    columns = plans.chunk_columns(M, V, K, x.element_size(), None if budget == "default" else limit, accumulates)
    assert {"default": columns < 64 * 3, "larger": 256 <= columns < V, "whole": columns == V}[budget], columns
    memory_budget = None if budget == "default" else limit
    grad = torch.ones(M, device=device)
    with RecordAllocations(x, W, b, t) as forward:
        loss, stats = api._forward(x, W, b, t, None, -100, 0.1, 1e-3, 0.0, None, memory_budget)
    with RecordAllocations(x, W, b, t, stats, grad) as backward:
        grads = api._backward(grad, x, W, b, t, None, stats, -100, 0.1, 1e-3, 0.0, None, memory_budget,
                              True, True, True)
    # the rows' running state, loss and stats; the bias gradient's float32 sum of a chunk; on
    # the CPU (no mixed-precision GEMM) the float32 copies of the slices dx is summed from
    small = M * 16 * 4 + V * 4
    if accumulates and device.type == "cpu":
        small += loss_plans.CPU_ACCUMULATE_COLUMNS * (M + K) * 4
    for record, outputs in ((forward, (loss, stats)), (backward, grads)):
        workspace = record.workspace(x, W, b, t, stats, grad, *outputs)
        assert workspace, "nothing recorded"
        assert budget == "whole" or all(elements < M * V for _, elements, _ in workspace), workspace
        output_bytes = sum(o.untyped_storage().nbytes() for o in outputs)
        assert record.peak - output_bytes <= limit + small, (record.peak, output_bytes, limit, workspace)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_logits_tensor(reduction, device):
    """The public call, forward and backward, makes no tensor of M x V elements or more
    (dW, V x K, is fewer here)."""
    M, K, V = 48, 32, 1000
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = (torch.randn(V, K, device=device) / K**0.5).requires_grad_()
    b = torch.randn(V, device=device, requires_grad=True)
    t = torch.randint(0, V, (M,), device=device)
    with RecordAllocations() as whole:
        pintail.linear_cross_entropy(x, W, t, linear_bias=b, reduction=reduction).sum().backward()
    assert len(whole.storages) >= 8  # the recording works: outputs, gradients, the chunks' buffers
    assert all(elements < M * V for _, elements, _ in whole.storages.values())


def test_budget_below_the_least_raises(device):
    x = torch.randn(64, 32, device=device, requires_grad=True)
    W = torch.randn(1000, 32, device=device)
    t = torch.randint(0, 1000, (64,), device=device)
    with pytest.raises(ValueError, match="memory_budget=1000 bytes is below the least"):
        pintail.linear_cross_entropy(x, W, t, memory_budget=1000)
    with pytest.raises(TypeError, match="memory_budget must be None or an int"):
        pintail.linear_cross_entropy(x, W, t, memory_budget=1e9)


def test_bad_input(device):
    M, K, V = 4, 8, 30
    x = torch.randn(M, K, device=device)
    W = torch.randn(V, K, device=device)
    t = torch.randint(0, V, (M,), device=device)
    f = pintail.linear_cross_entropy
    cases = [
        (ValueError, "input's hidden size 9 .* differs from linear_weight's 8",
         lambda: f(torch.randn(M, 9, device=device), W, t)),
        (ValueError, r"target must have input's leading shape \(4,\)", lambda: f(x, W, t[:3])),
        (ValueError, r"weight must have shape \(30,\)", lambda: f(x, W, t, weight=torch.ones(29, device=device))),
        (TypeError, "linear_weight has dtype torch.float64, expected input's dtype torch.float32",
         lambda: f(x, W.double(), t)),
        (ValueError, r"linear_bias must have shape \(30,\)", lambda: f(x, W, t,
         linear_bias=torch.ones(3, device=device))),
        (ValueError, "'avg' is not a valid value for reduction", lambda: f(x, W, t, reduction="avg")),
        (ValueError, "label_smoothing must be between", lambda: f(x, W, t, label_smoothing=1.5)),
        (ValueError, r"linear_weight must have shape \(classes, hidden\)", lambda: f(x, W[0], t)),
        (TypeError, "class-index targets must be", lambda: f(x, W, t.short())),
        (ValueError, "softcap must be None or > 0", lambda: f(x, W, t, softcap=0.0)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    bad = t.clone()
    bad[2] = V
    with pytest.raises(IndexError, match=r"pintail.linear_cross_entropy: target\[2\] = 30 is out of bounds"):
        f(x.to(device), W, bad)
    rows = f(x, W, bad, reduction="none", check_target=False)
    assert rows[2].isnan() and rows[[0, 1, 3]].isfinite().all()


def test_tied_embedding(device):
    """One parameter as the input embedding and the head: its gradient sums both uses."""
    V, K, M = 120, 16, 10
    tokens = torch.randint(0, V, (M,), device=device)
    t = torch.randint(0, V, (M,), device=device)
    grads, table = [], torch.randn(V, K, device=device)
    for loss_of in (lambda h, E: pintail.linear_cross_entropy(h, E, t),
                    lambda h, E: F.cross_entropy(F.linear(h, E), t)):
        E = torch.nn.Parameter(table.clone())
        h = torch.tanh(F.embedding(tokens, E))
        loss_of(h, E).backward()
        grads.append(E.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_module(device):
    """pintail.nn.LinearCrossEntropyLoss: torch's constructor and state dict, pintail's result."""
    if not hasattr(torch.nn, "LinearCrossEntropyLoss"):
        pytest.skip("torch.nn.LinearCrossEntropyLoss is in torch 2.13 on")
    torch.manual_seed(3)
    ours = pintail.nn.LinearCrossEntropyLoss(16, 50, bias=True, label_smoothing=0.1, device=device)
    torch.manual_seed(3)
    theirs = torch.nn.LinearCrossEntropyLoss(16, 50, bias=True, label_smoothing=0.1, device=device)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 5, 16, device=device)
    t = torch.randint(0, 50, (2, 5), device=device)
    expected = F.cross_entropy(theirs.linear(x).reshape(-1, 50), t.reshape(-1), label_smoothing=0.1)
    assert torch.allclose(ours(x, t), expected, rtol=1e-5)
    with pytest.raises(ValueError, match="out_features must be"):
        pintail.nn.LinearCrossEntropyLoss(16, 50, out_features=(2,))
    # the base taken on a torch without torch.nn.LinearCrossEntropyLoss keeps its state dict
    weight = torch.rand(50, device=device)
    stand_in = pintail.nn._LinearCrossEntropyLossBase(16, 50, bias=True, weight=weight, device=device)
    assert stand_in.state_dict().keys() == torch.nn.LinearCrossEntropyLoss(16, 50, bias=True, weight=weight,
                                                                           device=device).state_dict().keys()


def test_autocast_casts_like_linear(device):
    """Under autocast the head's GEMMs run in autocast's dtype, as F.linear's, and the float32
    parameters get float32 gradients."""
    M, K, V = 8, 16, 100
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = torch.randn(V, K, device=device, requires_grad=True)
    t = torch.randint(0, V, (M,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = pintail.linear_cross_entropy(x, W, t)
    assert loss.dtype == torch.bfloat16
    expected = pintail.linear_cross_entropy(x.bfloat16(), W.bfloat16(), t)
    assert torch.equal(loss, expected)
    loss.backward()
    assert W.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_double_backward_raises(device):
    x = torch.randn(4, 16, device=device, requires_grad=True)
    W = torch.randn(30, 16, device=device, requires_grad=True)
    t = torch.randint(0, 30, (4,), device=device)
    (grad,) = torch.autograd.grad(pintail.linear_cross_entropy(x, W, t), x, create_graph=True)
    with pytest.raises(RuntimeError, match="a second derivative through a pintail op is not supported"):
        grad.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_budget_of_the_logits_keeps_them(dtype, device):
    """A budget that holds the whole logits keeps them from the forward to the backward:
    three GEMMs in all (not four), as accurate as eager; a second backward raises."""
    M, K, V = 21, 24, 300
    x = torch.randn(M, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, device=device).to(dtype).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    t[3] = -100
    budget = M * plans.buffer_columns(V) * x.element_size()
    options = {"label_smoothing": 0.1, "weight": torch.rand(V, device=device) + 0.1}

    def ours(x, W, b):
        return pintail.linear_cross_entropy(x, W, t, linear_bias=b, memory_budget=budget, **options)

    assert_as_accurate_as_eager(ours, x, W, t, b, options)
    with RecordAllocations() as record:
        loss = ours(x, W, b)
        torch.autograd.grad(loss, (x, W, b), retain_graph=True)
    gemms = [op for op in record.ops if op.split(".")[1] in ("mm", "addmm")]
    assert len(gemms) == 3, record.ops
    with pytest.raises(RuntimeError, match="a second backward through a call whose memory_budget kept the logits"):
        torch.autograd.grad(loss, (x,))


@pytest.mark.large
@pytest.mark.parametrize("budget", ["default", "logits"])
def test_past_2_to_the_31_logits(budget, device):
    """M V = 16400 x 131072 > 2^31 (the kept logits index past int32 under a budget of the
    logits): per-row losses and dx of a few rows as float64, dW as a float32 sum over row
    blocks (norm-wise)."""
    if device.type != "cuda":
        pytest.skip("needs 13 GB of GPU memory")
    M, V, K = 16400, 131072, 64
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    W = (torch.randn(V, K, device=device) / K**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    t[M - 2] = -100
    memory_budget = None if budget == "default" else M * V * 2
    loss = pintail.linear_cross_entropy(x, W, t, reduction="none", memory_budget=memory_budget)
    dy = torch.rand(M, device=device).to(loss.dtype)
    dx, dW = torch.autograd.grad(loss, (x, W), dy)
    for r in (0, M // 2, M - 2, M - 1):
        row64 = x[r:r + 1].detach().double().requires_grad_()
        truth = loss_of_logits(row64 @ W.detach().double().T, t[r:r + 1], reduction="none")
        (dx_truth,) = torch.autograd.grad(truth, row64, dy[r:r + 1].double())
        assert torch.allclose(loss[r:r + 1].double(), truth, rtol=1e-2, atol=1e-2), (r, loss[r], truth)
        assert relative_errors(dx[r:r + 1], dx_truth)[0] < 2e-2, r
    dW_truth = torch.zeros(V, K, device=device)
    for start in range(0, M, 2048):
        rows = slice(start, start + 2048)
        logits = x[rows].detach().float() @ W.detach().float().T
        kept = t[rows] != -100
        g = torch.softmax(logits, 1)
        g[kept.nonzero()[:, 0], t[rows][kept]] -= 1
        dW_truth += (g * (dy[rows].float() * kept)[:, None]).T @ x[rows].detach().float()
    assert relative_errors(dW, dW_truth)[0] < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("plan, gemms", [("tokens", 3), ("logits", 3), ("vocabulary", 4)])
def test_gemm_flops_of_each_plan(dtype, plan, gemms, device):
    """A forward and backward's matrix-product FLOPs: three times 2 M V K for the token
    chunks and the kept logits, four for the vocabulary chunks (the logits twice). (A
    dispatch mode sees into a plan's function, not into a torch.library op. V a multiple of
    64: the three-GEMM plans pad the vocabulary to one.)"""
    M, K, V = 40, 24, 320
    x = torch.randn(M, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    grad = torch.ones(M, device=device)
    options = (-100, 0.1, 0.0, 0.0, None)
    with GemmFlops() as counter:
        if plan == "tokens":
            tokens._forward(x.detach(), W.detach(), None, t, None, *options, 16, True, True, False)
        elif plan == "vocabulary":
            _, stats = api._forward(x.detach(), W.detach(), None, t, None, *options, None)
            api._backward(grad, x.detach(), W.detach(), None, t, None, stats, *options, None, True, True, False)
        else:
            budget = M * plans.buffer_columns(V) * x.element_size()
            pintail.linear_cross_entropy(x, W, t, memory_budget=budget).backward()
    assert counter.flops == gemms * 2 * M * V * K


@pytest.mark.kernels_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [8, 16])
def test_token_chunks_within_budget(dtype, rows, device):
    """The token-chunk plan under a budget of `rows` rows of logits (and its float32 sums):
    chunks of that many rows, and the bytes alive at once beyond the inputs and the
    gradients within the budget (the hidden size small beside the vocabulary, as in a model,
    so that the float32 sums leave the budget short of the whole logits)."""
    M, K, V = 64, 8, 1000
    x = torch.randn(M, K, device=device).to(dtype).requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    sums = dtype != torch.float32
    budget = plans.token_workspace(rows, M, V, K, x.element_size(), sums, sums)
    chosen = plans.choose(M, V, K, x.element_size(), budget, gradients=True, uniform_rows=True, can_keep=True,
                          sums_dx=sums, sums_dW=sums)
    assert chosen == plans.Plan("tokens", rows)
    with RecordAllocations(x, W, t) as record:
        loss = pintail.linear_cross_entropy(x, W, t, memory_budget=budget)
        dx, dW = torch.autograd.grad(loss, (x, W))
    assert all(elements < M * V for _, elements, _ in record.storages.values())
    # the gradients in the inputs' dtype as they are returned, the rows' loss, stats and state,
    # the unit gradient; on the CPU the float32 copies of the slices the sums are taken from
    small = (M + V) * K * x.element_size() + M * 16 * 4 + 64
    if sums and device.type == "cpu":
        small += loss_plans.CPU_ACCUMULATE_COLUMNS * (rows + V + K + rows) * 4
    assert record.peak <= budget + small, (record.peak, budget, small)


@pytest.mark.parametrize("rows, cols, scale", [(1000, 37, "row"), (3, 5, "one"), (70000, 3, "one"), (1, 4, "row"),
                                              (600, 1, None)])
def test_narrowed_in_place(rows, cols, scale, device):
    """chunks.narrowed: total * scale in bf16 over total's own first bytes, as torch rounds it."""
    total = torch.randn(rows + 5, cols, device=device)[:rows]  # a slice of a larger sum, as dW_sum[:V]
    factor = {"row": torch.rand(rows, 1, device=device), "one": torch.rand(1, device=device), None: None}[scale]
    want = (total if factor is None else total * factor).to(torch.bfloat16)
    got = chunks.narrowed(total, torch.bfloat16, factor)
    assert got.data_ptr() == total.data_ptr() and torch.equal(got, want)


@pytest.mark.kernels_only
def test_token_chunks_narrow_their_sums_in_place(device):
    """bf16 dx and dW: the backward scales the float32 sums and rounds them over the first half
    of their own bytes, so no second weight-sized tensor is made (Llama-3.2-1B's head held
    1.5 GiB at once for it, now 1); the gradients as float64 torch's, for a gradient of 0.3."""
    M, K, V = 300, 8, 1000
    x = torch.randn(M, K, device=device).bfloat16().requires_grad_()
    W = (torch.randn(V, K, device=device) / K**0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    budget = plans.token_workspace(64, M, V, K, 2, True, True)
    assert plans.choose(M, V, K, 2, budget, gradients=True, uniform_rows=True, can_keep=True, sums_dx=True,
                        sums_dW=True) == plans.Plan("tokens", 64)
    with RecordAllocations(x, W, t) as record:
        (pintail.linear_cross_entropy(x, W, t, memory_budget=budget) * 0.3).backward()
    assert [n for n, _, _ in record.storages.values() if n >= V * K * 2] == [plans.buffer_columns(V) * K * 4]
    assert W.grad.untyped_storage().nbytes() == plans.buffer_columns(V) * K * 4
    assert x.grad.untyped_storage().nbytes() == M * K * 4
    x64, W64 = (v.detach().double().requires_grad_() for v in (x, W))
    truth = torch.autograd.grad(F.cross_entropy(F.linear(x64, W64), t) * 0.3, (x64, W64))
    x32 = x.detach().float().requires_grad_()
    (same,) = torch.autograd.grad(F.cross_entropy(F.linear(x32, W.detach().float()), t) * 0.3, x32)
    assert_matches(x.grad, truth[0], same.bfloat16())
    assert_matches(W.grad, truth[1], W.grad)


@pytest.mark.kernels_only
def test_autocast_float32_head_keeps_no_other_weight_sized_sum(device):
    """Autocast over a float32 head (the Trainer's mixed precision): the token-chunk plan's
    dW sum is the float32 gradient itself. The only (V, K) tensors made are that gradient
    and the 16-bit copy of the weight the GEMMs read (as F.linear's autocast makes)."""
    M, K, V = 40, 24, 300
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = (torch.randn(V, K, device=device) / K**0.5).requires_grad_()
    t = torch.randint(0, V, (M,), device=device)
    with RecordAllocations(x, W, t) as record:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = pintail.linear_cross_entropy(x, W, t)
        loss.backward()
    weight_sized = [shape for _, _, shape in record.storages.values() if shape == (V, K)]
    assert W.grad.dtype == torch.float32
    assert len(weight_sized) == 2, record.storages
    with torch.autocast(device.type, dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(x, W).float(), t)
    (dW_expected,) = torch.autograd.grad(expected, W)
    assert torch.allclose(W.grad, dW_expected, rtol=2e-2, atol=2e-2 * dW_expected.abs().max().item())


@pytest.mark.parametrize("plan", ["tokens", "logits"])
def test_three_gemm_plans_pad_the_vocabulary(plan, device):
    """V = 300 runs the three GEMMs over 320 classes (zero rows of the head past V: cuBLAS
    takes a vocabulary of no multiple of 64, as GPT-2's, at a fraction of its rate), with the
    loss and gradients of the 300."""
    M, K, V = 40, 24, 300
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = (torch.randn(V, K, device=device) / K**0.5).requires_grad_()
    b = torch.randn(V, device=device, requires_grad=True)
    t = torch.randint(0, V, (M,), device=device)
    options = (-100, 0.1, 0.0, 0.0, None)
    with GemmFlops() as counter:
        if plan == "tokens":
            tokens._forward(x.detach(), W.detach(), b.detach(), t, None, *options, 16, True, True, True)
        else:
            budget = M * plans.buffer_columns(V) * x.element_size()
            loss = pintail.linear_cross_entropy(x, W, t, linear_bias=b, label_smoothing=0.1, memory_budget=budget)
            grads = torch.autograd.grad(loss, (x, W, b))
    assert counter.flops == 3 * 2 * M * 320 * K
    if plan == "logits":
        x64, W64, b64 = (v.detach().double().requires_grad_() for v in (x, W, b))
        truth = F.cross_entropy(F.linear(x64, W64, b64), t, label_smoothing=0.1)
        for g, want in zip(grads, torch.autograd.grad(truth, (x64, W64, b64))):
            assert g.shape == want.shape and torch.allclose(g.double(), want, rtol=1e-4, atol=1e-6)


def test_default_keeps_logits_no_larger_than_the_token_workspace():
    """Without a budget the kept logits serve where they take no more memory than the token
    chunks would (a 16-bit head's float32 dW sum as large as the bf16 logits), in eager mode."""
    def default(M, K, V, can_keep=True, sums_dW=True):
        return plans.choose(M, V, K, 2, None, gradients=True, uniform_rows=True, can_keep=can_keep, sums_dx=True,
                            sums_dW=sums_dW)
    assert default(8192, 4096, 128256) == plans.Plan("logits", 128256)      # Llama-3-8B: 2.0 GB against 2.5
    assert default(16384, 2048, 128256) == plans.Plan("tokens", plans.TOKEN_ROWS)  # Llama-3.2-1B: 4.2 against 1.4
    assert default(8192, 4096, 128256, sums_dW=False) == plans.Plan("tokens", plans.TOKEN_ROWS)  # float32 head
    assert default(8192, 4096, 128256, can_keep=False) == plans.Plan("tokens", plans.TOKEN_ROWS)  # compiled
